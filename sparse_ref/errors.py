"""Exception types of sparse_ref: every error on bad input is a ``SparseRefError``, a ``ValueError`` (code
written against SGLang's ``ValueError`` keeps working). SGLang's two seed messages are constants, verbatim;
our errors start with them, then say what arrived and the fix. A leaf module (the kernel launchers import
it); the checks that raise these errors live in ``sparse_ref.checks``.
"""
from __future__ import annotations

# The messages SGLang raises, verbatim.
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


class RankError(SparseRefError):
    """Tensor parallel: a call failed on a rank with an error that is not a project error (out of memory, say)."""
