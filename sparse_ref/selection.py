"""Selection math in plain, batched torch: the semantics every kernel must match.

``topk_reference(scores, k, lengths)``: exact top-k over rows of varying length. Entry ``j`` of row ``r``
is a candidate when ``j < lengths[r]`` and its score is neither NaN nor -inf; the ``k`` largest are kept,
ties to the lower id, ``-0.0 == +0.0``; int32 ``[R, width]``, -1 padded, by score or by ascending id.

``select_pages(scores, seq_lens, sparse_mask, page_size, config)``: sink pages, the best
``config.history_budget(history)`` history pages and the recent pages of each row, ascending, -1 padded,
with the row's length (0: the row stays dense). The width ``selection_width(max_pages, config)`` is
static (CUDA graphs need that). ``docs/design.md`` section 3.4 states every rule. ``select_pages_row`` is
the same rule for one request, written to read like SGLang's loop; ``select_pages`` the batched form, no
Python loop over rows and no host sync.
"""
from __future__ import annotations

import torch

from sparse_ref.backend import torch_twin
from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    INT32_MAX,
    INT64_MAX,
    check_choice,
    check_int,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.config import SparseConfig
from sparse_ref.errors import ConfigError, ShapeError


def ceil_div(a, b):
    """Ceiling division for ints and integer tensors."""
    return -(-a // b)


def selection_width(max_pages: int, config: SparseConfig) -> int:
    """Static width of ``selected``: the most pages any row with <= max_pages pages can keep."""
    return config.selection_width(check_selection_width(max_pages, config))


def _candidates(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores with -0.0 folded into +0.0, and the mask of entries that may be selected."""
    s = scores.float() + 0.0  # -0.0 + 0.0 == +0.0, so the two zeros tie
    return s, ~torch.isnan(s) & (s != float("-inf"))


def _ranks_desc(masked: torch.Tensor) -> torch.Tensor:
    """rank[r, j] = position of column j when row r is sorted descending, ties by lower id."""
    order = torch.argsort(masked, dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(masked.shape[1], device=masked.device).expand_as(order))
    return ranks


@torch_twin("topk")
def topk_reference(scores: torch.Tensor, k, lengths: torch.Tensor | None = None, *,
                   order: str = "score", width: int | None = None) -> torch.Tensor:
    """Exact top-k ids per row (see the module docstring). ``k`` is an int or an int tensor [R]."""
    lengths, k_row, width = check_topk_reference(scores, k, lengths, order, width)
    R, N = scores.shape
    device = scores.device
    s, ok = _candidates(scores)
    cols = torch.arange(N, device=device)
    ok &= cols[None, :] < lengths[:, None]
    masked = torch.where(ok, s, torch.full_like(s, float("-inf")))
    ordered = torch.argsort(masked, dim=1, descending=True, stable=True)
    if width > N:
        pad = torch.full((R, width - N), -1, dtype=ordered.dtype, device=device)
        ordered = torch.cat([ordered, pad], dim=1)
    ordered = ordered[:, :width]
    keep = torch.arange(width, device=device)[None, :] < torch.minimum(k_row, ok.sum(1))[:, None]
    ids = torch.where(keep, ordered, torch.full_like(ordered, -1))
    if order == "index":
        big = torch.iinfo(torch.int64).max
        ids = torch.sort(torch.where(keep, ids, torch.full_like(ids, big)), dim=1).values
        ids = torch.where(keep, ids, torch.full_like(ids, -1))  # keep is a prefix of each row
    return ids.to(torch.int32)


def select_pages(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                 config: SparseConfig, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched page selection: no Python loop over requests, no host sync. See the module docstring."""
    page_size, width = check_select_pages(scores, seq_lens, sparse_mask, page_size, config, width)
    return select_pages_unchecked(scores, seq_lens, sparse_mask, page_size, config, width)


@torch_twin("select_pages")
def select_pages_unchecked(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                           config: SparseConfig, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages`` without the argument checks, for callers that checked them already."""
    bs, max_pages = scores.shape
    device = scores.device
    W = selection_width(max_pages, config) if width is None else width
    seq = seq_lens.to(torch.int64)
    n = ceil_div(seq, page_size)
    recent = n.clamp(max=config.num_recent_pages)
    recent_start = n - recent
    sink_end = recent_start.clamp(max=config.num_sink_pages)
    history = recent_start - sink_end
    k = config.history_budget_tensor(history)
    sparse = (sparse_mask & (seq >= config.min_sparse_seq_len) & (n > 0)
              & (sink_end + k + recent < n))

    cols = torch.arange(max_pages, device=device)[None, :]
    s, ok = _candidates(scores)
    in_history = (cols >= sink_end[:, None]) & (cols < recent_start[:, None])
    ok &= in_history
    ranks = _ranks_desc(torch.where(ok, s, torch.full_like(s, float("-inf"))))
    keep = (cols < sink_end[:, None]) | (ok & (ranks < k[:, None]))
    keep |= (cols >= recent_start[:, None]) & (cols < n[:, None])
    keep &= sparse[:, None]

    lengths = keep.sum(dim=1).to(torch.int32)
    key = torch.where(keep, cols.expand(bs, -1), torch.full_like(keep, max_pages, dtype=torch.int64))
    ids = torch.sort(key, dim=1).values[:, :W]
    selected = torch.where(ids < max_pages, ids, torch.full_like(ids, -1)).to(torch.int32)
    return selected, lengths


def select_pages_row(scores_row: torch.Tensor, seq_len: int, page_size: int, config: SparseConfig,
                     sparse: bool = True) -> torch.Tensor:
    """One request's kept logical pages, ascending (empty when the row stays dense).

    The teaching version of ``select_pages``: plain Python control flow on one row.
    """
    page_size, seq_len = check_select_pages_row(scores_row, seq_len, page_size, config)
    n = ceil_div(seq_len, page_size)
    if not sparse or seq_len < config.min_sparse_seq_len or n == 0:
        return torch.empty(0, dtype=torch.int32, device=scores_row.device)
    recent = min(config.num_recent_pages, n)
    recent_start = n - recent
    sink_end = min(config.num_sink_pages, recent_start)
    k = config.history_budget(recent_start - sink_end)
    if sink_end + k + recent >= n:  # keeping everything: nothing to gain, stay dense
        return torch.empty(0, dtype=torch.int32, device=scores_row.device)
    history, ok = _candidates(scores_row[sink_end:recent_start])
    candidates = ok.nonzero().squeeze(1)
    best = torch.argsort(-history[candidates], stable=True)[:k]  # stable: ties keep the lower id
    top = candidates[best] + sink_end
    device = scores_row.device
    kept = torch.cat([torch.arange(sink_end, device=device), top, torch.arange(recent_start, n, device=device)])
    return torch.sort(kept).values.to(torch.int32)


# ------------------------------ argument checks (each entry point above calls one first)
def check_config(config):
    """``config`` if it is a ``SparseConfig`` (validated and frozen at construction)."""
    if not isinstance(config, SparseConfig):
        fail("config", "a SparseConfig", describe(config), "build one with SparseConfig(...).", ConfigError)
    return config


def check_topk_reference(scores, k, lengths, order, width):
    """``(lengths int64 [R], k_row int64 [R], width)`` of a ``topk_reference`` call."""
    check_tensor("scores", scores, dtype=FLOAT_DTYPES, dims=2)
    check_choice("order", order, ("score", "index"))
    R, N = scores.shape
    device = scores.device
    if lengths is None:
        lengths = torch.full((R,), N, dtype=torch.int64, device=device)
    check_tensor("lengths", lengths, dtype=INDEX_DTYPES, dims=1)
    check_rows("lengths", lengths, R, "one per row of scores")
    check_range("lengths", lengths, 0, N, f"a row has at most {N} entries (scores.shape[1]).")
    if isinstance(k, torch.Tensor) and k.dim() > 0:
        check_tensor("k", k, dtype=INDEX_DTYPES, dims=1, fix="pass an int, or one k per row.")
        check_rows("k", k, R, "one per row of scores")
        check_range("k", k, 0, INT64_MAX)
        k_row = k.to(torch.int64)
        default_width = int(k_row.max()) if R else 0
    else:
        default_width = check_int("k", k, low=0, high=INT64_MAX, error=ShapeError)
        k_row = torch.full((R,), default_width, dtype=torch.int64, device=device)
    check_same_device("topk_reference", "scores", {"scores": scores, "lengths": lengths, "k": k_row})
    if width is None:  # the output is k wide (-1 padded): a k beyond int32 needs an explicit width
        width = check_int("k", default_width, high=INT32_MAX, error=ShapeError,
                          fix="the output width defaults to k; pass width= (at most 2**31 - 1) for a larger k.")
    width = check_int("width", width, low=0, high=INT32_MAX, error=ShapeError)
    return lengths.to(device, torch.int64), k_row, width


def check_selection_width(max_pages, config) -> int:
    check_config(config)
    return check_int("max_pages", max_pages, low=0, high=INT32_MAX, error=ShapeError)


def check_selection_inputs(scores, seq_lens, sparse_mask, page_size, config) -> int:
    """Type, shape, dtype, device and range checks shared by every page-selection implementation; the page size."""
    check_tensor("scores", scores, dtype=FLOAT_DTYPES, dims=2, fix="pass one score per logical page, [bs, max_pages].")
    bs, max_pages = scores.shape
    for name, t, dtype in (("seq_lens", seq_lens, INDEX_DTYPES), ("sparse_mask", sparse_mask, torch.bool)):
        check_tensor(name, t, dtype=dtype, dims=1)
        check_rows(name, t, bs, "one per row of scores")
    check_same_device("page selection", "scores", {"scores": scores, "seq_lens": seq_lens, "sparse_mask": sparse_mask})
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    check_config(config)
    check_range("seq_lens", seq_lens, 0, max_pages * page_size,
                f"scores cover {max_pages} pages of {page_size} tokens: score every page of the longest request.")
    return page_size


def check_select_pages(scores, seq_lens, sparse_mask, page_size, config, width) -> tuple[int, int | None]:
    """``(page_size, width)`` of a ``select_pages`` call, as ints."""
    page_size = check_selection_inputs(scores, seq_lens, sparse_mask, page_size, config)
    if width is not None:
        W = config.selection_width(scores.shape[1])
        width = check_int("width", width, low=W, error=ShapeError,
                          fix=f"leave width=None: selection_width is {W} here (a narrower output cuts rows off).")
    return page_size, width


def check_select_pages_row(scores_row, seq_len, page_size, config) -> tuple[int, int]:
    check_tensor("scores_row", scores_row, dtype=FLOAT_DTYPES, dims=1)
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    check_config(config)
    seq_len = check_int("seq_len", seq_len, low=0, high=scores_row.shape[0] * page_size, error=ShapeError,
                        fix=f"{scores_row.shape[0]} scored pages of {page_size} tokens: score the whole request.")
    return page_size, seq_len
