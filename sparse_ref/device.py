"""Where the code runs: a CUDA GPU, or the CPU with Triton's interpreter. Triton picks compiling or
interpreting when a kernel module is imported, so ``configure_triton()`` (called first by
``sparse_ref/__init__.py``) sets ``TRITON_INTERPRET=1`` before that, only without a GPU and when the user
has not set it.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

from sparse_ref.errors import ConfigError

FAST_ENV = "SPARSE_REF_FAST"
# How environment switches are read. Triton reads TRITON_INTERPRET the same way
# (case-insensitive "1", "true", "on", "yes" are on; anything else is off).
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def has_gpu() -> bool:
    """True when a CUDA device is visible to torch."""
    return torch.cuda.is_available()


def configure_triton() -> None:
    """Turn on Triton's interpreter when there is no GPU (unless the user chose already). The interpreter does a
    kernel's arithmetic in numpy, which warns where a GPU computes IEEE NaN and inf silently (a NaN score, an fp16
    overflow): those warnings say nothing about the kernel, so they are silenced."""
    if not has_gpu() and "TRITON_INTERPRET" not in os.environ:
        if "triton" in sys.modules:  # its own helpers (tl.cumsum's combine) were made for compiling already
            raise ConfigError("sparse_ref: triton was imported before sparse_ref on a machine without a GPU, so "
                              "its kernels cannot run through the interpreter. Fix: import sparse_ref first, or "
                              "export TRITON_INTERPRET=1 before starting Python.")
        os.environ["TRITON_INTERPRET"] = "1"
    if triton_interpreted():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")


def triton_interpreted() -> bool:
    """True when Triton kernels run through the interpreter on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def default_device() -> torch.device:
    """CUDA when present (and not forced off by the interpreter), else CPU."""
    if has_gpu() and not triton_interpreted():
        return torch.device("cuda")
    return torch.device("cpu")


def fast_mode() -> bool:
    """Small sizes for quick runs.

    ``SPARSE_REF_FAST=1`` (or true/on/yes) forces small sizes, ``SPARSE_REF_FAST=0``
    (or false/off/no) forces realistic ones; unset or empty, it is fast exactly when
    there is no GPU (the interpreter is slow). Any other value raises ``ConfigError``.
    """
    value = os.environ.get(FAST_ENV, "").strip().lower()
    if value == "":
        return default_device().type == "cpu"
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{FAST_ENV}: expected one of {_TRUE + _FALSE} (or unset), got {os.environ[FAST_ENV]!r}. "
        f"Fix: export {FAST_ENV}=1 for small sizes, {FAST_ENV}=0 for realistic ones."
    )


def execution_mode() -> str:
    """A one-line description of where kernels run, for notebooks to print."""
    if default_device().type == "cuda":
        name = torch.cuda.get_device_name()
        return f"GPU: {name} (Triton compiled), torch {torch.__version__}"
    interp = "Triton interpreter" if triton_interpreted() else "no Triton interpreter (TRITON_INTERPRET off)"
    return f"CPU: {interp}, torch {torch.__version__}"


def describe_run() -> str:
    """The mode line plus whether fast mode is on, and why; what each notebook's first cell prints."""
    fast = fast_mode()
    if os.environ.get(FAST_ENV, "").strip():
        why = f"{FAST_ENV}={os.environ[FAST_ENV].strip()}"
    elif fast:
        why = f"no GPU, so small sizes; {FAST_ENV}=0 forces realistic ones"
    else:
        why = f"a GPU, so realistic sizes; {FAST_ENV}=1 forces small ones"
    return f"{execution_mode()} | fast mode: {'on' if fast else 'off'} ({why})"
