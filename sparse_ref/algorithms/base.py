"""The sparse-algorithm contract (lifecycle hooks) and the default page-granular retrieval.

Hooks, per layer in ``[start_layer, end_layer)``: ``initialize_representation_pool`` once,
``construct_representations`` after a prefill, ``update_representations`` after each decode step,
``retrieve_topk`` before attention. A page algorithm only scores pages (``score_pages``); the base class
selects. ``retrieve_topk`` needs ``forward_batch.seq_lens`` (SGLang's first seed error): past it a row holds
zeros or an earlier request's slots. The contract: ``docs/design.md`` section 3.4.
"""
from __future__ import annotations

import torch

from sparse_ref import checks
from sparse_ref.backend import choose_backend
from sparse_ref.batch import ForwardBatch, check_batch_slots
from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_int,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
    skip_value_checks,
)
from sparse_ref.config import SparseConfig
from sparse_ref.errors import SEED_TOPK_NEEDS_SEQ_LENS, BatchError, ConfigError, PoolError, RetrievalError
from sparse_ref.selection import ceil_div, select_pages_row, selection_width


class SparseAlgorithm:
    """Base class: the lifecycle hooks and the default page-granular ``retrieve_topk``; subclasses implement
    ``score_pages``. ``backend`` (``sparse_ref.backend``) runs each step, torch or Triton, with the same output."""

    name = "base"

    def __init__(self, config: SparseConfig | None = None, device="cpu", backend="auto"):
        self.device = check_algorithm(config, device)
        self.config = config if config is not None else SparseConfig()
        self.backend = choose_backend(backend, self.device)  # "auto", "torch", "triton", or the engine's Backend
        self.start_layer = self.end_layer = 0
        self.token_to_kv_pool = self.req_to_token_pool = self.page_size = None

    # ---------------------------------------------------------------- lifecycle
    def initialize_representation_pool(self, start_layer: int, end_layer: int, token_to_kv_pool,
                                       req_to_token_pool) -> None:
        """Remember the pools and the layers ``[start_layer, end_layer)`` this algorithm serves."""
        self.start_layer, self.end_layer, self.page_size = check_representation_pool(
            start_layer, end_layer, token_to_kv_pool, req_to_token_pool)
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool

    def construct_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a prefill: build whatever the algorithm scores with. Default: nothing."""
        self.check_layer(layer_id)

    def update_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a decode step: refresh representations. Default: nothing."""
        self.check_layer(layer_id)

    def check_layer(self, layer_id) -> None:
        """Raise PoolError unless the pools are set up and ``start_layer <= layer_id < end_layer``."""
        check_algorithm_layer(self, layer_id)

    # ---------------------------------------------------------------- scoring
    @property
    def max_pages(self) -> int:
        """Pages a req_to_token row can hold: ``ceil(max_context_len / P)``; the static width of scores."""
        return ceil_div(self.req_to_token_pool.req_to_token.shape[1], self.page_size)

    def score_pages(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                    forward_batch) -> torch.Tensor:
        """fp32 ``[bs, max_pages]``: score of logical page ``j`` of request ``r`` (past a row's length: masked)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not score pages. Fix: subclass SparseAlgorithm and implement "
            "score_pages(queries, layer_id, req_pool_indices, forward_batch) -> fp32 [bs, max_pages], "
            "or use a registered algorithm such as 'quest'."
        )

    # ---------------------------------------------------------------- retrieval
    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, **kwargs):
        """Batched page retrieval: ``(selected, lengths)``: int32 ``[bs, selection_width]`` kept logical pages,
        ascending, -1 padded, and int32 ``[bs]`` counts (0: the row stays dense). Needs ``forward_batch=``; a row
        goes sparse on its *current* length. No loop over requests and, while a graph captures, no host sync."""
        forward_batch = check_retrieve(self, queries, layer_id, req_pool_indices, sparse_mask, kwargs)
        scores = self.score_pages(queries, layer_id, req_pool_indices, forward_batch)
        return self.backend.select_pages(scores, forward_batch.seq_lens.to(scores.device),
                                         sparse_mask.to(scores.device), self.page_size, self.config)

    def retrieve_attention_metadata(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                                    sparse_mask: torch.Tensor, forward_batch, req_to_token: torch.Tensor, out=None,
                                    **kwargs):
        """``retrieve_topk`` then the adaptor, as the decode step's one retrieval call: ``(selected, lengths,
        page_table, kv_lens, cu_kv_lens)``; on the Triton side one launch selects and writes the table (at bs=1 a
        launch costs about what the table does). ``out``: optional int32 ``(page_table, kv_lens, cu_kv_lens)``.
        An algorithm that overrides ``retrieve_topk`` overrides this too (``DSAAlgorithm`` does)."""
        forward_batch = check_retrieve_metadata(self, queries, layer_id, req_pool_indices, sparse_mask,
                                                forward_batch, req_to_token)
        scores = self.score_pages(queries, layer_id, req_pool_indices, forward_batch)
        on = scores.device
        return self.backend.select_to_table(scores, forward_batch.seq_lens.to(on), sparse_mask.to(on), self.page_size,
                                            self.config, forward_batch.req_pool_indices.to(on), req_to_token, out)

    def retrieve_topk_loop(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                           sparse_mask: torch.Tensor, **kwargs):
        """``retrieve_topk`` as a per-request loop shaped like SGLang's, to teach: the selection one request at a
        time (scores from one batched call: scored alone, a row could round differently in the last bit)."""
        forward_batch = check_retrieve(self, queries, layer_id, req_pool_indices, sparse_mask, kwargs)
        seq_lens = forward_batch.seq_lens
        scores = self.score_pages(queries, layer_id, req_pool_indices, forward_batch)
        bs, max_pages = scores.shape
        device = scores.device
        width = selection_width(max_pages, self.config)
        selected = torch.full((bs, width), -1, dtype=torch.int32, device=device)
        lengths = torch.zeros(bs, dtype=torch.int32, device=device)
        for i in range(bs):
            if not bool(sparse_mask[i]):
                continue  # this request attends densely: length 0
            seq_len = int(seq_lens[i])  # the *current* length, including the token being decoded
            kept = select_pages_row(scores[i], seq_len, self.page_size, self.config)
            selected[i, : kept.numel()] = kept
            lengths[i] = kept.numel()
        return selected, lengths


# ------------------------------ argument checks (each entry point above calls one first)
_FIX_SEQ_LENS = (
    "Fix: pass the batch through, retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, "
    "forward_batch=forward_batch), where forward_batch.seq_lens (int64 [bs]) holds each request's current "
    "length, including the token being decoded."
)


def check_forward_batch_kwarg(kwargs: dict):
    """The ``forward_batch`` keyword, checked to carry ``seq_lens``; else the seed error, then what arrived."""
    if "forward_batch" not in kwargs:
        got = f"got kwargs {sorted(kwargs)} and no forward_batch"
    elif kwargs["forward_batch"] is None:
        got = "got forward_batch=None"
    elif not hasattr(kwargs["forward_batch"], "seq_lens"):
        got = f"forward_batch of type {type(kwargs['forward_batch']).__name__} has no seq_lens"
    elif kwargs["forward_batch"].seq_lens is None:
        got = f"forward_batch of type {type(kwargs['forward_batch']).__name__} has seq_lens=None"
    else:
        return kwargs["forward_batch"]
    raise RetrievalError(f"{SEED_TOPK_NEEDS_SEQ_LENS}: {got}. {_FIX_SEQ_LENS}")


def check_algorithm(config, device) -> torch.device:
    if config is not None and not isinstance(config, SparseConfig):
        fail("config", "a SparseConfig or None", describe(config), error=ConfigError)
    return check_device("device", device)


def check_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool) -> tuple[int, int, int]:
    """``(start_layer, end_layer, page_size)`` of ``initialize_representation_pool``."""
    page_size = check_int("token_to_kv_pool.page_size", getattr(token_to_kv_pool, "page_size", None), low=1,
                          error=PoolError, fix="pass the engine's TokenToKVPool.")
    check_tensor("req_to_token_pool.req_to_token", getattr(req_to_token_pool, "req_to_token", None),
                 dtype=torch.int32, dims=2, fix="pass the engine's ReqToTokenPool.", error=PoolError)
    fix = "end_layer is exclusive: to serve layers 0..L-1, pass start_layer=0, end_layer=L."
    start_layer = check_int("start_layer", start_layer, low=0, error=PoolError, fix=fix)
    end_layer = check_int("end_layer", end_layer, low=start_layer + 1, error=PoolError, fix=fix,
                          high=getattr(token_to_kv_pool, "num_layers", None))
    return start_layer, end_layer, page_size


def check_algorithm_layer(algo, layer_id) -> None:
    """PoolError unless the pools are set up and ``start_layer <= layer_id < end_layer``."""
    if algo.req_to_token_pool is None:
        raise PoolError(f"{type(algo).__name__}: the representation pool is not initialized. Fix: call initialize_"
                        "representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool) first.")
    if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not (
            algo.start_layer <= layer_id < algo.end_layer):
        raise PoolError(f"layer_id: expected an int in [{algo.start_layer}, {algo.end_layer}) (end_layer is exclusive),"
                        f" got {layer_id!r}. Fix: call the algorithm only for the layers it was initialized with.")


def check_algorithm_batch(algo, fn: str, forward_batch) -> None:
    """``forward_batch`` is a ``ForwardBatch`` whose rows and lengths fit the algorithm's req_to_token."""
    if not isinstance(forward_batch, ForwardBatch):
        fail(f"{fn}: forward_batch", "a sparse_ref.ForwardBatch", describe(forward_batch),
             "build it with build_extend_batch / build_decode_batch.", BatchError)
    size, max_len = algo.req_to_token_pool.req_to_token.shape
    check_range("forward_batch.req_pool_indices", forward_batch.req_pool_indices, 0, size - 1,
                "pass rows of this algorithm's req_to_token.", BatchError)
    check_range("forward_batch.seq_lens", forward_batch.seq_lens, 0, max_len,
                f"lengths are at most max_context_len={max_len} of req_to_token.", BatchError)
    check_batch_slots(algo.req_to_token_pool.req_to_token, forward_batch)


def check_retrieve(algo, queries, layer_id, req_pool_indices, sparse_mask, kwargs: dict):
    """The inputs of a page algorithm's ``retrieve_topk`` (value checks skipped while a graph captures)."""
    forward_batch = check_forward_batch_kwarg(kwargs)
    check_algorithm_layer(algo, layer_id)
    seq_lens, batch_rows = forward_batch.seq_lens, getattr(forward_batch, "req_pool_indices", None)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, dims=1,
                 fix="pass forward_batch.req_pool_indices.")
    bs = req_pool_indices.shape[0]
    check_tensor("queries", queries, dtype=FLOAT_DTYPES, dims=(2, 3),
                 fix="pass one query per request, [bs, H_q*D] or [bs, H_q, D].")
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, dims=1,
                 fix="pass a bool tensor [bs], True for rows that may go sparse.")
    check_tensor("forward_batch.seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1)
    check_tensor("forward_batch.req_pool_indices", batch_rows, dtype=INDEX_DTYPES, dims=1)
    for name, t in (("queries", queries), ("sparse_mask", sparse_mask), ("forward_batch.seq_lens", seq_lens),
                    ("forward_batch.req_pool_indices", batch_rows)):
        check_rows(name, t, bs, "one per entry of req_pool_indices")
    check_same_device("retrieve_topk", "req_pool_indices", {
        "req_pool_indices": req_pool_indices, "queries": queries, "sparse_mask": sparse_mask,
        "forward_batch.seq_lens": seq_lens, "forward_batch.req_pool_indices": batch_rows})
    if bs == 0 or skip_value_checks():
        return forward_batch
    size, max_len = algo.req_to_token_pool.req_to_token.shape
    check_range("req_pool_indices", req_pool_indices, 0, size - 1, "pass rows of req_to_token.")
    check_range("forward_batch.seq_lens", seq_lens, 0, max_len,
                f"lengths are at most max_context_len={max_len} of req_to_token.")
    if not torch.equal(req_pool_indices.long(), batch_rows.long()):
        fail("req_pool_indices", f"forward_batch.req_pool_indices {batch_rows.tolist()} (the same requests, in "
             "the same order: seq_lens bound each row)", str(req_pool_indices.tolist()),
             "pass forward_batch.req_pool_indices, or build the batch for these requests.", RetrievalError)
    if isinstance(forward_batch, ForwardBatch):
        check_batch_slots(algo.req_to_token_pool.req_to_token, forward_batch)
    return forward_batch


def check_retrieve_metadata(algo, queries, layer_id, req_pool_indices, sparse_mask, forward_batch, req_to_token):
    """``retrieve_topk``'s inputs, then the table ``req_to_token`` and (eagerly) every token of a row on a real page."""
    forward_batch = check_retrieve(algo, queries, layer_id, req_pool_indices, sparse_mask,
                                   {"forward_batch": forward_batch})
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, device=queries.device,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    if req_pool_indices.shape[0] and not skip_value_checks():
        checks.check_tokens_on_real_pages(forward_batch.seq_lens, forward_batch.req_pool_indices, req_to_token,
                                          algo.page_size, "forward_batch.seq_lens")
    return forward_batch
