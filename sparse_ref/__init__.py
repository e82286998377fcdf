"""sparse_ref: a reference implementation of sparse-attention KV retrieval, as in SGLang.

Import order matters: ``configure_triton()`` runs before anything imports a Triton
kernel, so that on a machine without a GPU the kernels run through Triton's
interpreter (``TRITON_INTERPRET=1``).
"""

from sparse_ref.device import configure_triton

configure_triton()

from sparse_ref import adaptor, attention, offload, selection  # noqa: E402, F401  (the backend's torch twins: each
from sparse_ref.algorithms import dsa, quest  # noqa: E402, F401  module registers its own, sparse_ref.backend)
from sparse_ref.batch import ForwardBatch, ForwardMode, build_decode_batch, build_extend_batch, decode_step  # noqa: E402
from sparse_ref.config import SparseConfig  # noqa: E402
from sparse_ref.device import default_device, describe_run, execution_mode, fast_mode, has_gpu  # noqa: E402
from sparse_ref.errors import (  # noqa: E402
    SEED_DSA_REQUIRED,
    SEED_TOPK_NEEDS_SEQ_LENS,
    BatchError,
    ConfigError,
    PoolError,
    RankError,
    RetrievalError,
    ShapeError,
    SparseRefError,
    UnknownAlgorithmError,
)
from sparse_ref.memory import KVCacheManager, PageAllocator, ReqToTokenPool, Request, TokenToKVPool  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "SEED_DSA_REQUIRED",
    "SEED_TOPK_NEEDS_SEQ_LENS",
    "BatchError",
    "ConfigError",
    "ForwardBatch",
    "ForwardMode",
    "KVCacheManager",
    "PageAllocator",
    "PoolError",
    "RankError",
    "ReqToTokenPool",
    "Request",
    "RetrievalError",
    "ShapeError",
    "SparseConfig",
    "SparseRefError",
    "TokenToKVPool",
    "UnknownAlgorithmError",
    "build_decode_batch",
    "build_extend_batch",
    "decode_step",
    "default_device",
    "describe_run",
    "execution_mode",
    "fast_mode",
    "has_gpu",
]
