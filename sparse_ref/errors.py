"""Exception types of sparse_ref.

Every error the package raises on bad input is a ``SparseRefError``, which is a
``ValueError``, so code written against SGLang's ``ValueError`` keeps working.
The two seed messages from SGLang's sparse retrieval are kept verbatim as
constants; our errors start with them and then say what arrived and how to fix it.

This module is a leaf: it imports nothing from the package, so the Triton
launchers in ``sparse_ref.kernels`` may import it.
"""

from __future__ import annotations

# The messages SGLang raises, verbatim (see shared/seeds/).
SEED_TOPK_NEEDS_SEQ_LENS = "forward_batch with seq_lens is required for TopK retrieval"
SEED_DSA_REQUIRED = "Required: indexer, forward_batch, x, q_lora, positions"


class SparseRefError(ValueError):
    """Base class for every input error raised by sparse_ref."""


class PoolError(SparseRefError):
    """A memory pool was exhausted, freed twice, or addressed out of range."""


class ConfigError(SparseRefError):
    """A configuration field holds a value outside its allowed range."""


class BatchError(SparseRefError):
    """A ForwardBatch (or the pieces used to build one) is inconsistent."""


class RetrievalError(SparseRefError):
    """``retrieve_topk`` was called without what it needs (see the seed messages)."""


class ShapeError(SparseRefError):
    """A tensor has the wrong shape, dtype or device."""


class UnknownAlgorithmError(SparseRefError):
    """``create_sparse_algorithm`` was given a name the registry does not know."""


def describe(t) -> str:
    """A short description of a tensor (or anything else) for error messages."""
    shape = getattr(t, "shape", None)
    if shape is not None and hasattr(t, "dtype"):
        return f"tensor of shape {tuple(shape)}, dtype {t.dtype}, device {t.device}"
    return f"{type(t).__name__} {t!r}"[:200]


def check_tensor(name: str, t, *, dtype=None, dims=None, device=None, fix: str = "") -> None:
    """Raise ShapeError unless ``t`` is a tensor with the given dtype(s), rank and device.

    ``dtype`` may be one dtype or a tuple of them; ``dims`` an int rank or a tuple of ranks.
    """
    import torch

    tail = f" Fix: {fix}" if fix else ""
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {describe(t)}.{tail}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ShapeError(f"{name}: expected dtype {want}, got {t.dtype}.{tail}")
    if dims is not None:
        allowed_dims = dims if isinstance(dims, tuple) else (dims,)
        if t.dim() not in allowed_dims:
            want = " or ".join(f"{d}-D" for d in allowed_dims)
            raise ShapeError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}.{tail}")
    if device is not None and t.device.type != torch.device(device).type:
        raise ShapeError(f"{name}: expected a tensor on {device}, got one on {t.device}.{tail}")
