"""The two configurations: ``SparseConfig`` (page retrieval) and ``IndexerConfig`` (the DSA indexer).

Both are validated on construction (a bad value raises ``ConfigError`` naming the field, the value and
the allowed range) and store the normalised values they checked. ``SparseConfig`` is frozen: change a
field with ``dataclasses.replace(config, field=value)``, which validates again. Integers must fit the
int32 arithmetic of the kernels. Page size is not here: it belongs to the KV pool.
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
    """How many pages each sparse row keeps: one budget (``keep_ratio`` of the history pages, default 0.25,
    or ``page_budget`` pages), ``num_recent_pages`` (>= 1: the last page holds the token being decoded),
    ``num_sink_pages`` (default 0, as in SGLang), ``min_sparse_seq_len`` (shorter *current* rows stay dense)
    and Quest's ``gqa_mode`` (``"mean"`` or ``"per_kv_head"``). ``docs/design.md`` section 3.3."""

    keep_ratio: float | None = None
    page_budget: int | None = None
    num_recent_pages: int = 4
    num_sink_pages: int = 0
    min_sparse_seq_len: int = 0
    gqa_mode: str = "mean"

    def __post_init__(self) -> None:
        for name, value in check_sparse_config(self).items():
            object.__setattr__(self, name, value)  # frozen: the checked values, written once at construction

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


@dataclass
class IndexerConfig:
    """Shapes and numerics of the lightning indexer; defaults are DeepSeek-V3.2-Exp's. ``hidden_size`` and
    ``q_lora_rank``: widths of ``x`` and ``q_lora``; ``n_heads``, ``head_dim`` (a power of two, for the
    Hadamard), ``rope_dim`` (even, ``<= head_dim``), ``index_topk`` (positions kept per token); ``use_fp8``,
    ``block_size`` (values per FP8 scale, ``>= head_dim``: each q head and key is one block, so q's scale
    folds into the head weights), ``ue8m0`` (power-of-two scales, DeepSeek's ``scale_fmt``; off by
    default); ``rope_theta``, ``rope_interleaved``; ``layer_norm_eps`` of ``k_norm``."""

    hidden_size: int = 7168
    q_lora_rank: int = 1536
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    index_topk: int = 2048
    use_fp8: bool = True
    block_size: int = 128
    ue8m0: bool = False
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_indexer_config(self)

    @property
    def quant_block(self) -> int:
        """Values per FP8 scale as used: one whole ``head_dim`` vector (a block never spans two)."""
        return self.head_dim

    @property
    def key_bytes_per_token(self) -> int:
        """Cache bytes per token and layer: the key (1 byte per value in FP8, 4 in fp32) + one fp32 scale."""
        return self.head_dim * (1 if self.use_fp8 else 4) + 4


# ------------------------------ argument checks (each entry point above calls one first)
def check_sparse_config(config) -> dict:
    """The checked, normalised fields of a ``SparseConfig`` (plain ints and floats: never a tensor or numpy scalar)."""
    if config.keep_ratio is not None and config.page_budget is not None:
        fail("SparseConfig", "exactly one of keep_ratio and page_budget",
             f"keep_ratio={config.keep_ratio} and page_budget={config.page_budget} were both given",
             "pass keep_ratio=None or page_budget=None.", ConfigError)
    ratio = 0.25 if config.keep_ratio is None and config.page_budget is None else config.keep_ratio
    fields = {"keep_ratio": None if ratio is None else
              check_float("SparseConfig.keep_ratio", ratio, low=0, high=1, low_open=True),
              "page_budget": None if config.page_budget is None else
              check_int("SparseConfig.page_budget", config.page_budget, low=1, high=INT32_MAX)}
    fields["num_recent_pages"] = check_int(
        "SparseConfig.num_recent_pages", config.num_recent_pages, low=1, high=INT32_MAX,
        fix="The last page holds the token being decoded, so at least 1 recent page is always kept.")
    fields["num_sink_pages"] = check_int("SparseConfig.num_sink_pages", config.num_sink_pages, low=0, high=INT32_MAX)
    fields["min_sparse_seq_len"] = check_int("SparseConfig.min_sparse_seq_len", config.min_sparse_seq_len, low=0,
                                             high=INT32_MAX)
    fields["gqa_mode"] = check_choice("SparseConfig.gqa_mode", config.gqa_mode, GQA_MODES)
    return fields


def check_indexer_config(c) -> None:
    for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "index_topk", "block_size"):
        check_int(f"IndexerConfig.{name}", getattr(c, name), low=1)
    for name in ("use_fp8", "ue8m0", "rope_interleaved"):
        if not isinstance(getattr(c, name), bool):
            fail(f"IndexerConfig.{name}", "True or False", repr(getattr(c, name)), error=ConfigError)
    if c.head_dim & (c.head_dim - 1):
        fail("IndexerConfig.head_dim", "a power of two (the fast Hadamard transform needs one)", str(c.head_dim),
             "use 32, 64, 128, ...", ConfigError)
    check_int("IndexerConfig.rope_dim", c.rope_dim, low=0, high=c.head_dim, fix="RoPE rotates pairs of dims.")
    if c.rope_dim % 2:
        fail("IndexerConfig.rope_dim", "an even int (RoPE rotates pairs of dims)", str(c.rope_dim), error=ConfigError)
    if c.block_size < c.head_dim:
        fail("IndexerConfig.block_size", f">= head_dim={c.head_dim} (one q scale per (token, head) and one k scale "
             "per token: each head_dim vector is a single FP8 block)", str(c.block_size),
             "block_size=128 with head_dim <= 128.", ConfigError)
    check_float("IndexerConfig.rope_theta", c.rope_theta, low=1, low_open=True)
    check_float("IndexerConfig.layer_norm_eps", c.layer_norm_eps, low=0, low_open=True)
