"""Fused page selection: history top-k + sink pages + recent pages, ascending, -1 padded, lengths.

Semantics: ``sparse_ref.selection.select_pages`` (and so ``retrieve_topk_loop``). This module
reuses the radix-select chain of ``kernels/topk.py`` in its page mode: every program derives
its row's plan from ``seq_lens`` on the device (pages ``n = ceil(seq_len / page_size)``, the
recent window, the sink window, the history budget and the dense/sparse decision), selects the
history winners in ascending page order, and the row's first program writes the sink pages
before them, the recent pages after them, the -1 padding and the row length.

Because sink < history < recent page ids, "ascending order" is just concatenation: no sort.
No value is read back to the host, so the call can be captured in a CUDA graph.

The config is duck-typed (``keep_ratio``, ``page_budget``, ``num_recent_pages``,
``num_sink_pages``, ``min_sparse_seq_len``): a kernel file imports nothing from the package
except ``sparse_ref.errors``.
"""

from __future__ import annotations

import math

import torch

from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.kernels.topk import capturing, check_same_device, check_scores, launch_select


def _config_ints(config) -> dict:
    """The config's fields as plain Python values (checked, since the config is duck-typed)."""
    try:
        fields = {name: getattr(config, name) for name in
                  ("keep_ratio", "page_budget", "num_recent_pages", "num_sink_pages", "min_sparse_seq_len")}
    except AttributeError as e:
        raise SparseRefError(f"select_pages_triton: config must look like a SparseConfig, got "
                             f"{type(config).__name__} ({e}). Fix: pass sparse_ref.SparseConfig(...).") from e
    for name in ("num_recent_pages", "num_sink_pages", "min_sparse_seq_len"):
        v = fields[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SparseRefError(f"select_pages_triton: config.{name} must be an int >= 0, got {v!r}.")
    if fields["page_budget"] is None:
        r = fields["keep_ratio"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 < r <= 1:
            raise SparseRefError(f"select_pages_triton: config.keep_ratio must be in (0, 1], got {r!r}.")
    elif isinstance(fields["page_budget"], bool) or not isinstance(fields["page_budget"], int) \
            or fields["page_budget"] < 1:
        raise SparseRefError(f"select_pages_triton: config.page_budget must be an int >= 1, "
                             f"got {fields['page_budget']!r}.")
    return fields


def history_budget(history: int, fields: dict) -> int:
    """The config's ``history_budget`` rule on a Python int (same float64 arithmetic)."""
    if history <= 0:
        return 0
    if fields["page_budget"] is not None:
        return min(fields["page_budget"], history)
    return min(max(math.floor(history * fields["keep_ratio"]), 1), history)


def page_selection_width(max_pages: int, fields: dict) -> int:
    """``selection_width``: the static width of ``selected`` (the most pages any row can keep)."""
    recent = min(fields["num_recent_pages"], max_pages)
    sink = min(fields["num_sink_pages"], max_pages - recent)
    return min(max(max_pages, 0), sink + history_budget(max_pages - recent - sink, fields) + recent)


def _budget_table(max_pages: int, keep_ratio: float, device: torch.device) -> torch.Tensor:
    """table[h] = history budget for h history pages, computed in float64 exactly like select_pages."""
    h = torch.arange(max_pages + 1, device=device, dtype=torch.int64)
    k = torch.floor(h.double() * keep_ratio).long().clamp(min=1)
    return torch.minimum(k, h).to(torch.int32)


_TABLES: dict = {}


def budget_table(max_pages: int, keep_ratio: float, device: torch.device) -> torch.Tensor:
    """The budget table, cached per (device, size, ratio); never cached from inside a graph capture."""
    key = (str(device), max_pages, keep_ratio)
    if key in _TABLES:
        return _TABLES[key]
    table = _budget_table(max_pages, keep_ratio, device)
    if not capturing():
        _TABLES[key] = table
    return table


def select_pages_triton(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                        config, width: int | None = None, *, splits: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages`` on the GPU (or the interpreter): ``(selected int32 [bs, W], lengths int32 [bs])``.

    ``splits`` forces the number of programs per row (None: chosen from the GPU size).
    """
    fn = "select_pages_triton"
    check_scores("scores", scores, fn)
    bs, max_pages = scores.shape
    for name, t, dtypes in (("seq_lens", seq_lens, (torch.int32, torch.int64)), ("sparse_mask", sparse_mask,
                                                                                  (torch.bool,))):
        if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != 1 or t.shape[0] != bs:
            want = " or ".join(str(d) for d in dtypes)
            raise ShapeError(f"{fn}: {name} must be a 1-D {want} tensor with one entry per request ({bs}), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}. "
                             f"Fix: pass forward_batch.{name if name == 'seq_lens' else 'sparse_mask'} for this batch.")
        check_same_device(name, t, scores, fn)
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise SparseRefError(f"{fn}: page_size must be a positive int, got {page_size!r}. "
                             f"Fix: pass the KV pool's page size.")
    fields = _config_ints(config)
    if bs and not capturing():
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > max_pages * page_size:
            raise SparseRefError(
                f"{fn}: seq_lens must lie in [0, {max_pages * page_size}] (scores cover {max_pages} pages of "
                f"{page_size} tokens), got min {lo}, max {hi}. Fix: score every page of the longest request.")
    W = page_selection_width(max_pages, fields)
    if width is not None:  # wider is allowed (extra -1 padding); narrower would cut rows off
        if isinstance(width, bool) or not isinstance(width, int) or width < W:
            raise SparseRefError(f"{fn}: width must be an int >= {W} (selection_width for {max_pages} pages and "
                                 f"this config), got {width!r}; a narrower output would cut rows off. "
                                 f"Fix: leave width=None.")
        W = min(width, max_pages)  # as select_pages: a row never keeps more pages than it has
    device = scores.device
    selected = torch.empty((bs, W), dtype=torch.int32, device=device)
    lengths = torch.empty((bs,), dtype=torch.int32, device=device)
    if bs == 0:
        return selected, lengths
    if max_pages == 0:  # no pages at all: every row is dense
        return selected.fill_(-1), lengths.zero_()
    page = dict(seq_lens=seq_lens.contiguous(), sparse_mask=sparse_mask.contiguous(), page_size=page_size,
                num_recent=fields["num_recent_pages"], num_sink=fields["num_sink_pages"],
                min_seq=fields["min_sparse_seq_len"])
    if fields["page_budget"] is not None:
        page["page_budget"] = min(fields["page_budget"], max_pages)
    else:
        page["budget_table"] = budget_table(max_pages, float(fields["keep_ratio"]), device)
    launch_select(scores, W, page=page, splits=splits, out=selected, lengths_out=lengths)
    return selected, lengths
