"""The sparse-algorithm contract (lifecycle hooks) and the default page-granular retrieval.

Lifecycle, per layer ``start_layer <= layer < end_layer`` (``end_layer`` is exclusive,
everywhere in this package):

1. ``initialize_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool)``
   once, when the engine starts;
2. ``construct_representations(layer_id, forward_batch, k_buffer)`` after a prefill (EXTEND);
3. ``update_representations(layer_id, forward_batch, k_buffer)`` after each decode step;
4. ``retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, **kwargs)`` before
   attention, which returns what to read.

A *page* algorithm only has to say how good each page is: ``score_pages`` returns one fp32
score per logical page of every request. The base class turns scores into a selection
(``sparse_ref.selection.select_pages``: sink pages + the best history pages + recent pages).

Why ``retrieve_topk`` needs ``forward_batch.seq_lens``: the req_to_token row of a request is
only meaningful up to its length; past it the row holds zeros or slots of an earlier request.
Without the lengths, top-k cannot tell a real page from garbage (SGLang's first seed error).

A row becomes sparse based on its **current** ``seq_len`` (the tokens in the cache now,
including the token being decoded), not on its prompt length: a short prompt that has
decoded enough tokens turns sparse mid-generation, and the decision is re-made every step.
"""

from __future__ import annotations

import torch

from sparse_ref.batch import ForwardBatch
from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    capturing,
    check_choice,
    check_device,
    check_int,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.config import SparseConfig
from sparse_ref.errors import SEED_TOPK_NEEDS_SEQ_LENS, BatchError, ConfigError, PoolError, RetrievalError
from sparse_ref.selection import ceil_div, select_pages_row, select_pages_unchecked, selection_width

SELECTION_BACKENDS = ("auto", "torch", "triton")

_FIX_SEQ_LENS = (
    "Fix: pass the batch through, retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, "
    "forward_batch=forward_batch), where forward_batch.seq_lens (int64 [bs]) holds each request's current "
    "length, including the token being decoded."
)


def forward_batch_with_seq_lens(kwargs: dict):
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


class SparseAlgorithm:
    """Base class: the lifecycle hooks and the default page-granular ``retrieve_topk``.

    Subclasses implement ``score_pages``. ``selection_backend`` picks who turns the scores
    into pages: ``"torch"`` (``selection.select_pages``), ``"triton"``
    (``sparse_ref.kernels.page_select.select_pages_triton``, same signature and output) or
    ``"auto"`` (Triton for CUDA tensors, torch otherwise).
    """

    name = "base"

    def __init__(self, config: SparseConfig | None = None, device="cpu", selection_backend: str = "auto"):
        if config is not None and not isinstance(config, SparseConfig):
            fail("config", "a SparseConfig or None", describe(config), error=ConfigError)
        check_choice("selection_backend", selection_backend, SELECTION_BACKENDS)
        self.config = config if config is not None else SparseConfig()
        self.device = check_device("device", device)
        self.selection_backend = selection_backend
        self.start_layer = self.end_layer = 0
        self.token_to_kv_pool = self.req_to_token_pool = self.page_size = None

    # ---------------------------------------------------------------- lifecycle
    def initialize_representation_pool(self, start_layer: int, end_layer: int, token_to_kv_pool,
                                       req_to_token_pool) -> None:
        """Remember the pools and the layers ``[start_layer, end_layer)`` this algorithm serves."""
        page_size = check_int("token_to_kv_pool.page_size", getattr(token_to_kv_pool, "page_size", None), low=1,
                              error=PoolError, fix="pass the engine's TokenToKVPool.")
        check_tensor("req_to_token_pool.req_to_token", getattr(req_to_token_pool, "req_to_token", None),
                     dtype=torch.int32, dims=2, fix="pass the engine's ReqToTokenPool.", error=PoolError)
        fix = "end_layer is exclusive: to serve layers 0..L-1, pass start_layer=0, end_layer=L."
        self.start_layer = check_int("start_layer", start_layer, low=0, error=PoolError, fix=fix)
        self.end_layer = check_int("end_layer", end_layer, low=start_layer + 1, error=PoolError, fix=fix,
                                   high=getattr(token_to_kv_pool, "num_layers", None))
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size

    def construct_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a prefill: build whatever the algorithm scores with. Default: nothing."""
        self.check_layer(layer_id)

    def update_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a decode step: refresh representations. Default: nothing."""
        self.check_layer(layer_id)

    def check_layer(self, layer_id) -> None:
        """Raise PoolError unless the pools are set up and ``start_layer <= layer_id < end_layer``."""
        if self.req_to_token_pool is None:
            raise PoolError(
                f"{type(self).__name__}: the representation pool is not initialized. Fix: call "
                "initialize_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool) first."
            )
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not (
                self.start_layer <= layer_id < self.end_layer):
            raise PoolError(
                f"layer_id: expected an int in [{self.start_layer}, {self.end_layer}) (end_layer is exclusive), "
                f"got {layer_id!r}. Fix: call the algorithm only for the layers it was initialized with."
            )

    def check_forward_batch(self, fn: str, forward_batch) -> None:
        """``forward_batch`` is a ``ForwardBatch`` whose rows and lengths fit this algorithm's req_to_token."""
        if not isinstance(forward_batch, ForwardBatch):
            fail(f"{fn}: forward_batch", "a sparse_ref.ForwardBatch", describe(forward_batch),
                 "build it with build_extend_batch / build_decode_batch.", BatchError)
        size, max_len = self.req_to_token_pool.req_to_token.shape
        check_range("forward_batch.req_pool_indices", forward_batch.req_pool_indices, 0, size - 1,
                    "pass rows of this algorithm's req_to_token.", BatchError)
        check_range("forward_batch.seq_lens", forward_batch.seq_lens, 0, max_len,
                    f"lengths are at most max_context_len={max_len} of req_to_token.", BatchError)

    # ---------------------------------------------------------------- scoring
    @property
    def max_pages(self) -> int:
        """Pages a req_to_token row can hold: ``ceil(max_context_len / P)``; the static width of scores."""
        return ceil_div(self.req_to_token_pool.req_to_token.shape[1], self.page_size)

    def score_pages(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                    forward_batch) -> torch.Tensor:
        """fp32 ``[bs, max_pages]``: score of logical page ``j`` of request ``r``.

        Pages at or past a row's ``ceil(seq_len / P)`` may hold anything: selection masks them.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not score pages. Fix: subclass SparseAlgorithm and implement "
            "score_pages(queries, layer_id, req_pool_indices, forward_batch) -> fp32 [bs, max_pages], "
            "or use a registered algorithm such as 'quest'."
        )

    # ---------------------------------------------------------------- retrieval
    def _check_retrieve_inputs(self, queries, layer_id, req_pool_indices, sparse_mask, forward_batch) -> None:
        """Eager checks. Shape/dtype checks cost no sync; value checks are skipped while a graph captures."""
        self.check_layer(layer_id)
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
        if bs == 0 or capturing():
            return
        size, max_len = self.req_to_token_pool.req_to_token.shape
        check_range("req_pool_indices", req_pool_indices, 0, size - 1, "pass rows of req_to_token.")
        check_range("forward_batch.seq_lens", seq_lens, 0, max_len,
                    f"lengths are at most max_context_len={max_len} of req_to_token.")
        if not torch.equal(req_pool_indices.long(), batch_rows.long()):
            fail("req_pool_indices", f"forward_batch.req_pool_indices {batch_rows.tolist()} (the same requests, in "
                 "the same order: seq_lens bound each row)", str(req_pool_indices.tolist()),
                 "pass forward_batch.req_pool_indices, or build the batch for these requests.", RetrievalError)

    def _select(self, scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor):
        backend = check_choice("selection_backend", self.selection_backend, SELECTION_BACKENDS)
        if backend == "auto":
            backend = "triton" if scores.is_cuda else "torch"
        if backend == "triton":
            from sparse_ref.kernels import page_select  # lazy: optional kernel module

            if scores.shape[1] <= page_select.MAX_REGISTER_PAGES:  # one program holds a row in registers
                return page_select.select_pages_triton(scores, seq_lens, sparse_mask, self.page_size, self.config,
                                                       check_values=False)  # checked by retrieve_topk
        return select_pages_unchecked(scores, seq_lens, sparse_mask, self.page_size, self.config)

    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, **kwargs):
        """Batched page retrieval: ``(selected, lengths)``.

        * ``selected``: int32 ``[bs, W]``, each row's kept logical page ids, ascending, -1 padded,
          ``W = selection_width(max_pages, config)`` (static);
        * ``lengths``: int32 ``[bs]``; 0 means the row stays dense (attend to all its pages).

        Needs ``forward_batch=`` with ``seq_lens``. A row goes sparse based on its *current*
        ``seq_len``, not its prompt length. No Python loop over requests, no ``.item()``, no host
        sync once the eager checks are skipped (they are, while a CUDA graph captures), so the
        whole call can be captured and replayed.
        """
        forward_batch = forward_batch_with_seq_lens(kwargs)
        seq_lens = forward_batch.seq_lens
        self._check_retrieve_inputs(queries, layer_id, req_pool_indices, sparse_mask, forward_batch)
        scores = self.score_pages(queries, layer_id, req_pool_indices, forward_batch)
        return self._select(scores, seq_lens.to(scores.device), sparse_mask.to(scores.device))

    def retrieve_topk_loop(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                           sparse_mask: torch.Tensor, **kwargs):
        """The same contract as ``retrieve_topk``, as a per-request Python loop shaped like SGLang's.

        Kept to teach (and as the baseline the batched path is timed against). Scores come from
        one batched ``score_pages`` call: scoring each request alone could round differently in the
        last bit on a GPU (reductions pick their strategy by shape), and the two paths must return
        identical tensors. What the loop spells out is the selection, one request at a time.
        """
        forward_batch = forward_batch_with_seq_lens(kwargs)
        seq_lens = forward_batch.seq_lens
        self._check_retrieve_inputs(queries, layer_id, req_pool_indices, sparse_mask, forward_batch)
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
