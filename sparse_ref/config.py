"""``SparseConfig``: the knobs of page-granular sparse retrieval, validated on construction.

A bad value raises ``ConfigError`` naming the field, the value and the allowed range. The
config is frozen: change a field with ``dataclasses.replace(config, field=value)``, which
validates again. Integers must fit the int32 arithmetic of the kernels.
Page size is not here: it belongs to the KV pool and the algorithm reads it from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparse_ref.checks import INT32_MAX, check_choice, check_float, check_int, fail
from sparse_ref.errors import ConfigError

GQA_MODES = ("mean", "per_kv_head")


@dataclass(frozen=True)
class SparseConfig:
    """How many pages each sparse row keeps.

    Budget: exactly one of ``keep_ratio`` (a fraction of the history pages) and
    ``page_budget`` (a fixed number of history pages). With neither given,
    ``keep_ratio=0.25``.

    * ``num_recent_pages`` (>= 1): the last pages, always kept. The last page holds
      the token being decoded and the adaptor's KV-length formula relies on it.
    * ``num_sink_pages`` (>= 0, default 0 as in SGLang): the first pages, always kept.
    * ``min_sparse_seq_len`` (>= 0): rows whose *current* seq_len is below this stay dense.
    * ``gqa_mode``: how Quest folds query heads onto KV heads: ``"mean"`` (SGLang's
      choice: average each GQA group's query) or ``"per_kv_head"`` (score with every
      query head and sum, a tighter bound per head).
    """

    keep_ratio: float | None = None
    page_budget: int | None = None
    num_recent_pages: int = 4
    num_sink_pages: int = 0
    min_sparse_seq_len: int = 0
    gqa_mode: str = "mean"

    def __post_init__(self) -> None:
        if self.keep_ratio is not None and self.page_budget is not None:
            fail("SparseConfig", "exactly one of keep_ratio and page_budget",
                 f"keep_ratio={self.keep_ratio} and page_budget={self.page_budget} were both given",
                 "pass keep_ratio=None or page_budget=None.", ConfigError)
        ratio = 0.25 if self.keep_ratio is None and self.page_budget is None else self.keep_ratio
        if ratio is not None:
            ratio = check_float("SparseConfig.keep_ratio", ratio, low=0, high=1, low_open=True)
        object.__setattr__(self, "keep_ratio", ratio)  # frozen: the one write, during construction
        if self.page_budget is not None:  # stored as a plain int (a 0-d tensor would leak into cache keys)
            object.__setattr__(self, "page_budget",
                               check_int("SparseConfig.page_budget", self.page_budget, low=1, high=INT32_MAX))
        check_int("SparseConfig.num_recent_pages", self.num_recent_pages, low=1, high=INT32_MAX,
                  fix="The last page holds the token being decoded, so at least 1 recent page is always kept.")
        check_int("SparseConfig.num_sink_pages", self.num_sink_pages, low=0, high=INT32_MAX)
        check_int("SparseConfig.min_sparse_seq_len", self.min_sparse_seq_len, low=0, high=INT32_MAX)
        check_choice("SparseConfig.gqa_mode", self.gqa_mode, GQA_MODES)

    def history_budget(self, history: int) -> int:
        """How many of ``history`` scorable pages to keep (a Python int; see ``selection``)."""
        if history <= 0:
            return 0
        if self.page_budget is not None:
            return min(self.page_budget, history)
        return min(max(math.floor(history * self.keep_ratio), 1), history)

    def history_budget_tensor(self, history: torch.Tensor) -> torch.Tensor:
        """``history_budget`` for an int tensor of history sizes (float64, so it rounds like Python's floats)."""
        if self.page_budget is not None:
            return history.clamp(max=self.page_budget)
        k = torch.floor(history.double() * self.keep_ratio).long().clamp(min=1)
        return torch.minimum(k, history)

    def selection_width(self, max_pages: int) -> int:
        """Static width of a selection: the most pages any row with <= ``max_pages`` pages can keep."""
        recent = min(self.num_recent_pages, max_pages)
        sink = min(self.num_sink_pages, max_pages - recent)
        return min(max_pages, sink + self.history_budget(max_pages - recent - sink) + recent)
