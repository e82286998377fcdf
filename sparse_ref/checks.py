"""Argument checks for the public entry points, in one place.

Every public function of ``sparse_ref`` and every kernel launcher in ``sparse_ref.kernels``
checks its arguments with these helpers at the entry point, before any kernel launch. A failed
check raises a ``SparseRefError`` subclass whose message says:

    <argument>: expected <what>, got <what arrived>. Fix: <how to fix it>

Internal invariants (things no caller can break) are plain ``assert`` statements instead, so
the reading path of the algorithms stays short.

Checks that read tensor *values* (ranges of ids and lengths) need a host sync; they are
skipped while a CUDA graph captures (``capturing()``), where the launchers' own clamps keep
every access in bounds.

This module is a leaf (it imports only torch and ``sparse_ref.errors``), so kernel files may
import it.
"""

from __future__ import annotations

import math
import numbers
from typing import NoReturn

import torch

from sparse_ref.errors import ConfigError, ShapeError, SparseRefError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def capturing() -> bool:
    """True while a CUDA graph is being captured: then no check may read device data."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
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


def check_device(name: str, device, error: type[SparseRefError] = ConfigError) -> torch.device:
    """``device`` as a ``torch.device`` that holds data (cpu or cuda; not meta, not a typo)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        fail(name, "a device such as 'cpu' or 'cuda'", describe(device), error=error)
    if dev.type == "meta":
        fail(name, "a device with data (cpu or cuda)", "meta", error=error)
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
    if t.numel() == 0 or capturing():
        return
    lo, hi = (int(x) for x in t.aminmax()) if t.dtype != torch.bool else (0, 1)
    if lo < low or hi > high:
        fail(name, f"values in [{low}, {high}]", f"min {lo}, max {hi}", fix, error)
