"""The production top-k kernels a user would pick instead of ours, timed beside ours in the same run when present.

* **SGLang** ``fast_topk`` (``torch.ops.sgl_kernel.fast_topk``, what ``fast_topk_v2`` calls; k = 2048 only, ids
  in no particular order) and ``fast_topk_transform_fused`` (the same selection written through a page table).
  The ``sgl_kernel`` package is not imported (its ``__init__`` loads a 1 GB attention library): point
  ``SPARSE_REF_SGL_KERNEL_LIB`` at ``sgl_kernel/sm90/common_ops.abi3.so`` from the ``sglang-kernel`` wheel
  built for the installed torch (0.4.5 for torch 2.11, CUDA 13) and it is loaded alone.
* **FlashInfer** ``flashinfer.top_k(scores, k, sorted=False)`` (radix, any k), when ``import flashinfer`` works.

Every peer is checked against ``topk_reference`` on the timed inputs (the set of ids of each row, as their
ids come in their own order) and the row records whether it was exact. A peer that is missing, refuses the
shape or fails is ``None`` in the row with the reason beside it: no number is made up.
"""

from __future__ import annotations

import os
from functools import partial

import torch

SGL_LIB_ENV = "SPARSE_REF_SGL_KERNEL_LIB"
_LOADED: dict = {}


def sglang_ops():
    """``(ops, None)``: ``torch.ops.sgl_kernel`` with ``fast_topk`` loaded; or ``(None, why not)``."""
    if "sgl" not in _LOADED:
        path = os.environ.get(SGL_LIB_ENV, "")
        if not path:
            _LOADED["sgl"] = None, f"{SGL_LIB_ENV} is not set (the path of sglang-kernel's sm90 common_ops.abi3.so)"
        elif not os.path.isfile(path):
            _LOADED["sgl"] = None, f"{SGL_LIB_ENV}={path}: no such file"
        else:
            try:
                torch.ops.load_library(path)
                _LOADED["sgl"] = torch.ops.sgl_kernel, None
                torch.ops.sgl_kernel.fast_topk  # noqa: B018 (raises when the library has no such op)
            except Exception as e:  # noqa: BLE001 (a library built for another torch fails here, with its reason)
                _LOADED["sgl"] = None, f"loading {path} failed: {type(e).__name__}: {str(e)[:200]}"
    return _LOADED["sgl"]


def flashinfer_module():
    """``(flashinfer, None)``, or ``(None, why not)``."""
    if "fi" not in _LOADED:
        try:
            import flashinfer

            _LOADED["fi"] = flashinfer, None
        except Exception as e:  # noqa: BLE001 (not installed, or a dependency missing: say which)
            _LOADED["fi"] = None, f"import flashinfer failed: {type(e).__name__}: {str(e)[:200]}"
    return _LOADED["fi"]


def topk_calls(x: torch.Tensor, k: int) -> dict:
    """Each peer's call for rows ``x`` and ``k`` (index order against ours), or the reason it has none."""
    if x.device.type != "cuda":
        return {"sglang fast_topk": "needs a CUDA GPU", "flashinfer top_k": "needs a CUDA GPU"}
    R, N = x.shape
    out: dict = {}
    ops, why = sglang_ops()
    if ops is None:
        out["sglang fast_topk"] = why
    elif k != 2048:
        out["sglang fast_topk"] = f"k = {k}: fast_topk takes k = 2048 only"
    else:
        idx, lengths = torch.empty(R, k, dtype=torch.int32, device=x.device), torch.full((R,), N, dtype=torch.int32,
                                                                                         device=x.device)
        out["sglang fast_topk"] = (partial(ops.fast_topk, x, idx, lengths, None), idx)
    fi, why = flashinfer_module()
    out["flashinfer top_k"] = why if fi is None else (partial(fi.top_k, x, k, sorted=False), None)
    return out


def ids_of(result, buffer) -> torch.Tensor:
    """The ids a peer's call returned (in its own order): the output buffer it wrote, or its returned indices."""
    if buffer is not None:
        return buffer
    return result[1] if isinstance(result, tuple) else result


def exact(ids: torch.Tensor, x: torch.Tensor, k: int) -> bool:
    """Whether every row's ids are the reference's top-k as a set (ties: any k of the tied keys at the k-th value
    are a valid answer for a peer whose tie rule differs, so rows are compared by the scores they select)."""
    from sparse_ref.selection import topk_reference

    want = topk_reference(x.float().cpu(), k, order="index")
    got = ids.long().cpu()
    if got.shape != want.shape or bool(((got < 0) | (got >= x.shape[1])).any()):
        return False
    xs = x.float().cpu()
    return bool(torch.equal(xs.gather(1, got).sort(1).values, xs.gather(1, want.long()).sort(1).values))


def time_peers(timer, copies: list, k: int) -> dict:
    """``{peer: {"us": median µs, "exact": bool} | None, peer + " (why not)": reason}`` on the same input copies."""
    out = {}
    for name, call in topk_calls(copies[0], k).items():
        if isinstance(call, str):
            out[name], out[f"{name} (why not)"] = None, call
            continue
        try:
            calls = [topk_calls(x, k)[name] for x in copies]
            us = timer.cold([fn for fn, _ in calls])
            fn, buffer = calls[0]
            out[name] = {"us": round(us, 2), "exact": exact(ids_of(fn(), buffer), copies[0], k), "timing": timer.mode}
            print(f"    beside it: {name} {us:9.1f} us ({'exact' if out[name]['exact'] else 'NOT exact'})", flush=True)
        except Exception as e:  # noqa: BLE001 (a peer that refuses a shape is recorded, not fatal)
            out[name], out[f"{name} (why not)"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    return out
