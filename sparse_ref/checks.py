"""The argument-check helpers that every module shares.

Each public function of ``sparse_ref`` and each kernel launcher of ``sparse_ref.kernels`` opens with one
call to its own entry-point check, which lives at the bottom of the same module ("argument checks"). Those
checks are built on the helpers here (``check_tensor``, ``check_int``, ``check_range``, ``fail``, ...) and on
the few checks that several modules share (selections against req_to_token, score matrices, kernel
devices, the command lines). A failed check raises a ``SparseRefError`` subclass whose message says:

    <argument>: expected <what>, got <what arrived>. Fix: <how to fix it>

Internal invariants (things no caller can break) are plain ``assert`` statements instead.

Checks that read tensor *values* (ranges of ids and lengths) need a host sync. They are skipped while a
CUDA graph captures, and inside ``values_checked()``, the block in which a caller has already checked the
values once for the whole batch (the engine's decode step): ``skip_value_checks()`` says which.

This module is a leaf (it imports only torch, ``sparse_ref.errors`` and, inside one function,
``sparse_ref.device``), so every module, kernels included, may import it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import NoReturn

import torch

from sparse_ref.errors import (
    BatchError,
    ConfigError,
    PoolError,
    ShapeError,
    SparseRefError,
)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def capturing() -> bool:
    """True while a CUDA graph is being captured: then no check may read device data."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_values_checked_depth = 0  # > 0 inside values_checked()


@contextlib.contextmanager
def values_checked():
    """A block whose caller has checked its tensors' values already, once for the whole batch: the value checks
    inside skip their host reads (one sync each on a GPU). The engine runs a decode step's layers in one."""
    global _values_checked_depth
    _values_checked_depth += 1
    try:
        yield
    finally:
        _values_checked_depth -= 1


def skip_value_checks() -> bool:
    """True where a check must not read device values (a CUDA graph captures) or need not (``values_checked``)."""
    return _values_checked_depth > 0 or capturing()


def describe(x) -> str:
    """A short description of a value for error messages (tensors by shape, dtype and device)."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"[:200]


def fail(name: str, expected: str, got: str, fix: str = "", error: type[SparseRefError] = ShapeError) -> NoReturn:
    """Raise ``error`` with the standard message: argument, what was expected, what arrived, the fix."""
    tail = f" Fix: {fix}" if fix else ""
    raise error(f"{name}: expected {expected}, got {got}.{tail}")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None, fix: str = "",
              error: type[SparseRefError] = ConfigError) -> int:
    """``value`` as a Python int, refusing bools, floats, strings and anything outside ``[low, high]``.

    Integer-valued 0-d tensors and numpy integers are accepted (and converted).
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, "an int", describe(value), fix, error)
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        fail(name, f"an int in [{lo}, {hi}]", repr(value), fix, error)
    return value


def check_float(name: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, fix: str = "", error: type[SparseRefError] = ConfigError) -> float:
    """``value`` as a finite Python float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    lo, hi = "-inf" if low is None else low, "inf" if high is None else high
    want = f"a finite number in {'(' if low_open else '['}{lo}, {hi}]"
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    try:  # (an int too large for a float overflows: refuse it like infinity)
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        fail(name, want, describe(value), fix, error)
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        fail(name, want, repr(value), fix, error)
    return value


def check_choice(name: str, value, choices, fix: str = "", error: type[SparseRefError] = ConfigError):
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, (str, int)) or value not in choices:
        fail(name, f"one of {tuple(choices)}", repr(value), fix, error)
    return value


def check_kv_dtype(name: str, dtype, error: type[SparseRefError]) -> None:
    """A floating ``torch.dtype`` (K/V are stored in it), not a string."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail(name, "a floating torch.dtype such as torch.float16", describe(dtype),
             "pass the dtype object, e.g. dtype=torch.bfloat16, not a string.", error)


def check_device(name: str, device, error: type[SparseRefError] = ConfigError) -> torch.device:
    """``device`` as a ``torch.device`` that holds data (cpu or cuda; not meta, not a typo)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        fail(name, "a device such as 'cpu' or 'cuda'", describe(device), error=error)
    if dev.type not in ("cpu", "cuda"):
        fail(name, "'cpu' or 'cuda' (what the kernels and references run on)", repr(str(dev)), error=error)
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        fail(name, f"a CUDA GPU torch can see ({torch.cuda.device_count()} here)", repr(str(dev)),
             "pass device='cpu' (the kernels run through Triton's interpreter), or a GPU that is there.", error)
    return dev


def check_tensor(name: str, t, *, dtype=None, dims=None, shape=None, device=None, contiguous: bool = False,
                 fix: str = "", error: type[SparseRefError] = ShapeError) -> torch.Tensor:
    """``t`` if it is a tensor with the given dtype(s), rank(s), shape, device type and layout.

    * ``dtype``: one dtype or a tuple of them;
    * ``dims``: an int rank or a tuple of ranks;
    * ``shape``: a tuple whose ``None`` entries match any size (implies the rank);
    * ``device``: a device or device type the tensor must live on (the type is compared).
    """
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", describe(t), fix, error)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            fail(name, "dtype " + " or ".join(str(d) for d in allowed), str(t.dtype), fix, error)
    if dims is not None:
        ranks = dims if isinstance(dims, tuple) else (dims,)
        if t.dim() not in ranks:
            fail(name, "a " + " or ".join(f"{d}-D" for d in ranks) + " tensor", f"shape {tuple(t.shape)}",
                 fix, error)
    if shape is not None:
        ok = t.dim() == len(shape) and all(w is None or w == g for w, g in zip(shape, t.shape, strict=False))
        if not ok:
            want = "[" + ", ".join("any" if w is None else str(w) for w in shape) + "]"
            fail(name, f"shape {want}", f"shape {tuple(t.shape)}", fix, error)
    if device is not None and t.device.type != torch.device(device).type:
        fail(name, f"a tensor on {torch.device(device).type}", f"one on {t.device}", fix, error)
    if t.device.type == "meta":
        fail(name, "a tensor with data (cpu or cuda)", "a meta tensor", fix, error)
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}", f"pass {name}.contiguous().", error)
    return t


def check_same_device(fn: str, reference: str, tensors: dict, error: type[SparseRefError] = ShapeError) -> None:
    """Every tensor in ``tensors`` (name -> tensor or None) lives on the device of ``tensors[reference]``."""
    device = tensors[reference].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            fail(f"{fn}: {name}", f"a tensor on {device} (the device of {reference})", f"one on {t.device}",
                 f"move it with {name}.to({str(device)!r}).", error)


def check_rows(name: str, t: torch.Tensor, rows: int, what: str = "one per request",
               error: type[SparseRefError] = ShapeError) -> None:
    """``t`` has ``rows`` entries along its first dimension."""
    if t.dim() == 0 or t.shape[0] != rows:
        fail(name, f"{rows} rows ({what})", f"shape {tuple(t.shape)}", error=error)


def check_range(name: str, t: torch.Tensor, low: int, high: int, fix: str = "",
                error: type[SparseRefError] = ShapeError) -> None:
    """Every value of integer tensor ``t`` lies in ``[low, high]`` (one host sync; skipped while capturing)."""
    if t.numel() == 0 or skip_value_checks():
        return
    lo, hi = (int(x) for x in t.aminmax()) if t.dtype != torch.bool else (0, 1)
    if lo < low or hi > high:
        fail(name, f"values in [{low}, {high}]", f"min {lo}, max {hi}", fix, error)


# --------------------------------------------------------------------------------------------- ids and sizes
def check_index_list(name: str, indices, error: type[SparseRefError] = PoolError) -> list[int]:
    """Ints from an int, a sequence of ints or an integer tensor; anything else (floats too) raises."""
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            fail(name, "an integer tensor", f"dtype {indices.dtype}", error=error)
        return indices.reshape(-1).tolist()
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        indices = [indices]
    return [check_int(name, i, error=error) for i in indices]


def check_fits_memory(what: str, nbytes: int) -> None:
    if nbytes > 2**45:
        fail(what, "buffers that fit in a machine's memory (at most 32 TiB)", f"a request for {nbytes} bytes",
             "check the sizes: a typo in one of them multiplies the whole allocation.", PoolError)


# ------------------------------------------------- selections against req_to_token (adaptor and page-table kernels)
def check_new_token_slots(req_to_token, rows, positions, out_cache_loc, batch: str = "forward_batch.",
                          error=BatchError) -> None:
    """Eager: each new token's ``out_cache_loc`` is the slot req_to_token keeps for it (row ``rows[t]``, position
    ``positions[t]``): a write anywhere else lands where its request never reads it, or in another request's KV.
    The engine's batches (``batch.check_batch_slots``) and the swap-in kernel's share it."""
    if skip_value_checks() or positions.numel() == 0:
        return
    rows, positions = rows.to(req_to_token.device).long(), positions.to(req_to_token.device).long()
    if int(rows.min()) < 0 or int(positions.min()) < 0 or int(rows.max()) >= req_to_token.shape[0] or \
            int(positions.max()) >= req_to_token.shape[1]:
        fail(f"{batch}positions", f"rows and positions inside req_to_token {tuple(req_to_token.shape)}",
             f"rows {rows.tolist()[:8]}, positions {positions.tolist()[:8]}", "build the batch from these pools.",
             error)
    want = req_to_token[rows, positions].long().to(out_cache_loc.device)
    if bool((want == 0).any()):  # slot 0 lies in padding page 0: no request's token is ever kept there
        t = int((want == 0).nonzero()[0, 0])
        fail(f"{batch}seq_lens", "lengths within each request's tokens (every new token has a slot in "
             "req_to_token)", f"new token {t} at position {int(positions[t])} of row {int(rows[t])}, which holds "
             "no token", "build the batch for these requests after allocating their tokens (build_decode_batch "
             "/ decode_step).", error)
    if not torch.equal(want, out_cache_loc.long()):
        t = int((want != out_cache_loc.long()).nonzero()[0, 0])
        fail(f"{batch}out_cache_loc[{t}]", f"slot {int(want[t])}, where req_to_token keeps that token (a write to "
             "another slot lands where its request never reads it, or in another request's KV)",
             str(int(out_cache_loc[t])), "build the batch from the pool (build_decode_batch / decode_step).", error)


# ------------------------------------------------- selections against req_to_token (adaptor and page-table kernels)
def check_tokens_on_real_pages(seq_lens, rows, req_to_token, page_size: int, name: str = "seq_lens") -> None:
    """Eager: every token ``[0, seq_len)`` of each row lies on a real page (req_to_token never names page 0)."""
    if seq_lens.numel() == 0 or skip_value_checks():
        return
    t = torch.arange(req_to_token.shape[1], device=req_to_token.device)
    padding = (t[None, :] < seq_lens.to(t.device)[:, None]) & (req_to_token[rows.to(t.device).long()] < page_size)
    if bool(padding.any()):
        r, tok = (int(x) for x in padding.nonzero()[0])
        fail(name, "lengths within each request's tokens", f"row {r} has seq_len {int(seq_lens[r])} but token {tok} "
             "maps to padding page 0", "pass the batch built for these requests.")


def check_selection_values(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size: int,
                           batch: str = "") -> None:
    """Eager value checks of a selection against its batch (host syncs; skipped while a graph captures): lengths
    and rows in range, every token of a request on a real page, each sparse row naming only its own pages, in
    order, once, its last page last. ``batch``: the prefix of the batch fields' names in messages."""
    bs, width = selected.shape
    if bs == 0 or skip_value_checks():
        return
    check_range(f"{batch}seq_lens", seq_lens, 0, req_to_token.shape[1])
    check_range(f"{batch}req_pool_indices", rows, 0, req_to_token.shape[0] - 1)
    check_range("lengths", lengths, 0, width, "(the width of selected).")
    check_tokens_on_real_pages(seq_lens, rows, req_to_token, page_size, f"{batch}seq_lens")
    n = -(-seq_lens.long() // page_size)  # pages per request
    cols = torch.arange(width, device=selected.device)
    live = cols[None, :] < lengths[:, None]
    sparse = sparse_mask & (lengths > 0)
    bad = sparse[:, None] & live & ((selected < 0) | (selected >= n[:, None]))
    bad |= sparse[:, None] & ~live & (selected != -1)
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(
            f"selected: row {r} entry {j} is {int(selected[r, j])}; expected its first lengths[r]={int(lengths[r])} "
            f"entries in [0, {int(n[r])}) (ceil(seq_len / page_size) pages of that request) and -1 after. "
            "A request may only name its own pages. Fix: pass the (selected, lengths) of retrieve_topk unchanged."
        )
    ids = torch.where(live & sparse[:, None], selected.long(), torch.full_like(selected, -1, dtype=torch.long))
    ids = torch.sort(ids, dim=1).values
    if bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any()):
        raise ShapeError("selected: a row names the same page twice; each kept page must appear once.")
    if page_size > 1 and width > 0:  # (width 0: every length is 0, every row dense)
        last = selected.long().gather(1, (lengths.long() - 1).clamp(min=0)[:, None]).squeeze(1)
        wrong = sparse & (last != n - 1)
        if bool(wrong.any()):
            r = int(wrong.nonzero()[0, 0])
            raise ShapeError(
                f"selected: row {r} ends with page {int(last[r])}, not its last page {int(n[r] - 1)}. The KV length "
                "(len - 1) * P + last_page_len needs the last (partial) page kept last. Fix: keep num_recent_pages "
                ">= 1 and pass the ascending selection of retrieve_topk."
            )


# ------------------------------------------------------------------------- shared by several kernel launchers
def check_kernel_device(name: str, t: torch.Tensor, fix: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors through the interpreter; refuse anything else."""
    from sparse_ref.device import triton_interpreted

    if t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreted()):
        return
    fail(name, "a tensor on a CUDA device (or on CPU with TRITON_INTERPRET=1)", f"one on {t.device}", fix)


def check_scores(fn: str, name: str, scores) -> None:
    """dtype, rank, stride, device and size checks for a [rows, N] score matrix."""
    check_tensor(f"{fn}: {name}", scores, dtype=FLOAT_DTYPES, dims=2, fix="pass a 2-D float tensor [rows, N].")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        fail(f"{fn}: {name}", "unit stride along the last dim", f"strides {scores.stride()}",
             f"pass {name}.contiguous().")
    check_kernel_device(f"{fn}: {name}", scores, "move it with .cuda().")
    if scores.shape[1] >= 2**31 - 1:
        fail(f"{fn}: {name}", "rows shorter than 2**31 - 1", f"N={scores.shape[1]}", "split the rows.")


def check_quest_bounds_pool(page_min, page_max, page_valid) -> tuple[int, int, int]:
    """The Quest bounds pool of one layer, checked: ``(num_pages, H_kv, D)``."""
    check_tensor("page_min", page_min, dtype=FLOAT_DTYPES, dims=3, contiguous=True,
                 fix="pass QuestAlgorithm.page_min[layer_id], [num_pages, H_kv, D].")
    check_tensor("page_max", page_max, dtype=page_min.dtype, shape=tuple(page_min.shape), contiguous=True,
                 fix="pass QuestAlgorithm.page_max[layer_id] of the same layer as page_min.")
    check_tensor("page_valid", page_valid, dtype=torch.bool, shape=(page_min.shape[0],), contiguous=True,
                 fix="pass QuestAlgorithm.page_valid[layer_id], one bool per physical page.")
    return tuple(page_min.shape)
