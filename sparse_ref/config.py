"""``SparseConfig``: the knobs of page-granular sparse retrieval, validated on construction.

A bad value raises ``ConfigError`` naming the field, the value and the allowed range.
Page size is not here: it belongs to the KV pool and the algorithm reads it from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparse_ref.errors import ConfigError

GQA_MODES = ("mean", "per_kv_head")


@dataclass
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
            raise ConfigError(
                f"SparseConfig: keep_ratio={self.keep_ratio} and page_budget={self.page_budget} were both "
                "given; expected exactly one. Fix: pass keep_ratio=None or page_budget=None."
            )
        if self.keep_ratio is None and self.page_budget is None:
            self.keep_ratio = 0.25
        if self.keep_ratio is not None:
            r = self.keep_ratio
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0.0 < r <= 1.0:
                raise ConfigError(f"SparseConfig.keep_ratio: expected a number in (0, 1], got {r!r}.")
            self.keep_ratio = float(r)
        if self.page_budget is not None:
            _check_int("page_budget", self.page_budget, 1)
        _check_int(
            "num_recent_pages", self.num_recent_pages, 1,
            " The last page holds the token being decoded, so at least 1 recent page is always kept.",
        )
        _check_int("num_sink_pages", self.num_sink_pages, 0)
        _check_int("min_sparse_seq_len", self.min_sparse_seq_len, 0)
        if self.gqa_mode not in GQA_MODES:
            raise ConfigError(f"SparseConfig.gqa_mode: expected one of {GQA_MODES}, got {self.gqa_mode!r}.")

    def history_budget(self, history: int) -> int:
        """How many of ``history`` scorable pages to keep (a Python int; see ``selection``)."""
        if history <= 0:
            return 0
        if self.page_budget is not None:
            return min(self.page_budget, history)
        return min(max(math.floor(history * self.keep_ratio), 1), history)


def _check_int(field: str, value, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"SparseConfig.{field}: expected an integer >= {low}, got {value!r}.{why}")
