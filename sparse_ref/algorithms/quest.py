"""Quest: score each KV page by an upper bound on ``q . k`` over the keys it holds.

Quest (Tang et al., 2024, arXiv 2406.10774) keeps each page's elementwise min and max key per KV head.
Since ``min_d <= k_d <= max_d``, every key of the page has ``q . k <= q+ . max + q- . min`` (``q+ = max(q, 0)``,
``q- = min(q, 0)``): a page that scores low holds no key the query attends to strongly. GQA ``"mean"``
(SGLang) averages a group's query heads first; ``"per_kv_head"`` bounds each head and sums.
Bounds (fp32, or 16-bit rounded outward) are built when a page completes and dropped when the pool frees it;
a page without bounds scores ``-inf``. The backend picks torch (gather, ``bmm``) or Triton (one launch each
for scores and bounds, the same bits). The contract: ``docs/design.md`` section 3.5.
"""
from __future__ import annotations

import torch

from sparse_ref.algorithms.base import SparseAlgorithm, check_algorithm_batch, check_algorithm_layer
from sparse_ref.backend import torch_twin
from sparse_ref.batch import ForwardMode
from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_list,
    check_range,
    check_tensor,
    describe,
    fail,
    skip_value_checks,
)
from sparse_ref.errors import BatchError, ConfigError, PoolError, ShapeError


def split_query_sign(queries: torch.Tensor, num_kv_heads: int, head_dim: int, gqa_mode: str):
    """``(q_pos, q_neg)`` fp32 ``[bs, H_kv, D]``: score = q_pos . max + q_neg . min (SGLang's errors on bad shapes)."""
    queries = check_quest_queries(queries, num_kv_heads, head_dim)  # [bs, H_q, D], or SGLang's errors
    bs, num_q_heads = queries.shape[:2]
    q = queries.float().reshape(bs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    if gqa_mode == "mean":
        q = q.mean(dim=2)
        return q.clamp(min=0), q.clamp(max=0)
    return q.clamp(min=0).sum(dim=2), q.clamp(max=0).sum(dim=2)  # per_kv_head: the sum of per-head bounds


def quest_page_scores_reference(q_pos: torch.Tensor, q_neg: torch.Tensor, page_min: torch.Tensor,
                                page_max: torch.Tensor, page_valid: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The torch Quest scores: fp32 ``[bs, max_pages]``, ``q_pos . max[p] + q_neg . min[p]``, -inf where invalid
    (``pages``: physical ids ``[bs, max_pages]``). One gather of the bounds and a ``bmm``: the kernel's reference."""
    check_quest_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages)
    return _page_scores(q_pos, q_neg, page_min, page_max, page_valid, pages)


def _page_scores(q_pos, q_neg, page_min, page_max, page_valid, pages) -> torch.Tensor:
    """``quest_page_scores_reference`` on checked inputs (no host sync: it runs inside the scoring path)."""
    bs, max_pages = pages.shape
    num_pages = page_min.shape[0]
    hd = page_min.shape[1] * page_min.shape[2]
    pages = pages.long()
    gathered_max = page_max.reshape(num_pages, hd)[pages].float()  # [bs, max_pages, H_kv*D]
    gathered_min = page_min.reshape(num_pages, hd)[pages].float()
    scores = torch.bmm(gathered_max, q_pos.reshape(bs, hd, 1)) + torch.bmm(gathered_min, q_neg.reshape(bs, hd, 1))
    scores = scores.squeeze(2)
    return torch.where(page_valid[pages], scores, torch.full_like(scores, float("-inf")))


@torch_twin("quest_scores")
def quest_scores_torch(queries: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, page_valid: torch.Tensor,
                       req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int, max_pages: int,
                       gqa_mode: str) -> torch.Tensor:
    """The backend's torch Quest scores from raw queries (the kernel's signature): sign split, each logical page's
    physical page (``req_to_token`` at its first token; past a row's length, masked by selection), then
    ``_page_scores``: fp32 ``[bs, max_pages]``."""
    num_pages, num_kv_heads, head_dim = page_min.shape
    q_pos, q_neg = split_query_sign(queries.to(page_min.device), num_kv_heads, head_dim, gqa_mode)
    first_token_of_page = torch.arange(max_pages, device=req_to_token.device) * page_size
    rows = req_pool_indices.to(req_to_token.device).long()
    pages = req_to_token[rows[:, None], first_token_of_page[None, :]].long() // page_size
    return _page_scores(q_pos, q_neg, page_min, page_max, page_valid, pages.to(page_min.device).clamp(0, num_pages - 1))


@torch_twin("update_bounds")
def update_bounds_torch(k_buffer: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                        page_valid: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor, page_size: int, prefix_lens: torch.Tensor | None = None) -> None:
    """The backend's torch bounds update (the kernel's signature): after a prefill (``prefix_lens``) the bounds of
    every page the new tokens completed, logical ``[prefix // P, seq_len // P)`` (a host loop over the requests);
    after a decode step the page each row's newest token filled, where ``seq_len % P == 0`` (batched)."""
    num_pages, num_kv_heads, head_dim = page_min.shape
    k_pages = k_buffer.view(num_pages, page_size, num_kv_heads, head_dim)
    pages, write = pages_to_summarize(req_to_token, req_pool_indices, seq_lens, page_size, prefix_lens)
    pages, write = pages.to(page_min.device), write.to(page_min.device)
    for chunk, w in zip(pages.split(4096), write.split(4096), strict=True):  # bounded temporaries at long context
        k = k_pages[chunk.to(k_pages.device)].to(page_min.device).float()  # [chunk, P, H_kv, D]
        mn, mx = round_bounds_outward(k.amin(dim=1), k.amax(dim=1), page_min.dtype)
        page_min[chunk] = torch.where(w[:, None, None], mn, page_min[chunk])
        page_max[chunk] = torch.where(w[:, None, None], mx, page_max[chunk])
        page_valid[chunk] = page_valid[chunk] | w


def pages_to_summarize(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       page_size: int, prefix_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, write)``: the physical pages whose bounds a prefill (``prefix_lens``: every page completed, logical
    ``[prefix // P, seq_len // P)``, a host loop) or a decode step (each row's newest page, ``write`` where its last
    token completed it) builds."""
    P, device = page_size, req_to_token.device
    rows, seq_lens = req_pool_indices.to(device).long(), seq_lens.to(device)
    if prefix_lens is None:
        newest = (seq_lens - 1).clamp(min=0)
        return req_to_token[rows, (newest // P) * P].long() // P, (seq_lens > 0) & (seq_lens % P == 0)
    firsts = [torch.arange(a // P, b // P, device=device) * P for a, b in zip(prefix_lens.tolist(), seq_lens.tolist(),
                                                                            strict=True)]
    pages = [req_to_token[r, f].long() // P for r, f in zip(rows.tolist(), firsts, strict=True)]
    pages = torch.cat(pages) if pages else torch.zeros(0, dtype=torch.long, device=device)
    return pages, torch.ones_like(pages, dtype=torch.bool)


BOUNDS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def round_bounds_outward(page_min: torch.Tensor, page_max: torch.Tensor, dtype: torch.dtype):
    """``page_min`` rounded DOWN and ``page_max`` rounded UP to ``dtype``: 16-bit bounds halve the bytes scoring
    reads, and rounding outward keeps ``min16 <= k <= max16``, so the score still bounds every key (nearest, then
    one ulp outward where that landed inside). Past fp16's range a bound becomes infinite: use bfloat16."""
    if dtype == torch.float32:
        return page_min, page_max
    lo, hi = page_min.to(dtype), page_max.to(dtype)
    lo = torch.where(lo.float() > page_min, torch.nextafter(lo, torch.full_like(lo, float("-inf"))), lo)
    hi = torch.where(hi.float() < page_max, torch.nextafter(hi, torch.full_like(hi, float("inf"))), hi)
    return lo, hi


class QuestAlgorithm(SparseAlgorithm):
    """Quest page scoring over per-page key min/max (see the module docstring)."""

    name = "quest"

    def __init__(self, config=None, device="cpu", backend: str = "auto", bounds_dtype: torch.dtype = torch.float32):
        super().__init__(config, device, backend)
        check_quest(bounds_dtype, BOUNDS_DTYPES)
        self.bounds_dtype = bounds_dtype

    def initialize_representation_pool(self, start_layer: int, end_layer: int, token_to_kv_pool,
                                       req_to_token_pool, page_allocator=None) -> None:
        """Allocate the min/max pools of layers ``[start_layer, end_layer)``; ``invalidate_pages`` listens to
        the pool's allocator (and ``page_allocator``, if given), so a freed page's bounds are never selected."""
        allocators = check_quest_allocators(token_to_kv_pool, page_allocator)
        super().initialize_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool)
        pool = token_to_kv_pool
        self.num_pages, self.num_kv_heads, self.head_dim = pool.num_pages, pool.num_kv_heads, pool.head_dim
        shape = (pool.num_pages, pool.num_kv_heads, pool.head_dim)
        layers = range(start_layer, end_layer)
        self.page_min = {i: torch.zeros(shape, dtype=self.bounds_dtype, device=self.device) for i in layers}
        self.page_max = {i: torch.zeros(shape, dtype=self.bounds_dtype, device=self.device) for i in layers}
        self.page_valid = {i: torch.zeros(pool.num_pages, dtype=torch.bool, device=self.device) for i in layers}
        for allocator in allocators:
            allocator.add_free_listener(self.invalidate_pages)

    # ---------------------------------------------------------------- bounds
    def construct_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a prefill: bounds of every page the new tokens completed (logical ``[prefix // P, seq_len // P)``)."""
        check_quest_hook(self, "construct_representations", layer_id, forward_batch, k_buffer)
        fb = forward_batch
        self.backend.update_bounds(k_buffer, self.page_min[layer_id], self.page_max[layer_id],
                                   self.page_valid[layer_id], self.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                   fb.seq_lens, self.page_size, fb.extend_prefix_lens)

    def update_representations(self, layer_id: int, forward_batch, k_buffer: torch.Tensor) -> None:
        """After a decode step: the bounds of the page each row's newest token filled (``seq_len % P == 0``), kept
        only there; batched, no host sync."""
        check_quest_hook(self, "update_representations", layer_id, forward_batch, k_buffer)
        fb = forward_batch
        self.backend.update_bounds(k_buffer, self.page_min[layer_id], self.page_max[layer_id],
                                   self.page_valid[layer_id], self.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                   fb.seq_lens, self.page_size)

    def invalidate_pages(self, pages) -> None:
        """Forget the bounds of freed physical ``pages`` in every layer (the free-listener hook)."""
        pages = check_invalidate_pages(self, pages).to(self.device)
        for layer in self.page_valid:
            self.page_valid[layer][pages] = False
            self.page_min[layer][pages] = 0.0
            self.page_max[layer][pages] = 0.0

    # ---------------------------------------------------------------- scoring
    def score_pages(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                    forward_batch) -> torch.Tensor:
        """fp32 ``[bs, max_pages]`` Quest bounds of each logical page; -inf where a page has no bounds."""
        check_score_pages(self, queries, layer_id, forward_batch)
        return self.backend.quest_scores(queries.to(self.device), self.page_min[layer_id], self.page_max[layer_id],
                                         self.page_valid[layer_id], self.req_to_token_pool.req_to_token.to(self.device),
                                         req_pool_indices.to(self.device), self.page_size, self.max_pages,
                                         self.config.gqa_mode)


# ------------------------------ argument checks (each entry point above calls one first)
def check_quest_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages) -> None:
    """The inputs of ``quest_page_scores_reference``: shapes that agree, and every page id in ``[0, num_pages)``."""
    check_tensor("page_min", page_min, dtype=FLOAT_DTYPES, dims=3, fix="pass the bounds [num_pages, H_kv, D].")
    num_pages, h_kv, d = page_min.shape
    check_tensor("page_max", page_max, dtype=FLOAT_DTYPES, shape=(num_pages, h_kv, d), device=page_min.device.type)
    check_tensor("page_valid", page_valid, dtype=torch.bool, shape=(num_pages,), device=page_min.device.type)
    check_tensor("pages", pages, dtype=INDEX_DTYPES, dims=2, device=page_min.device.type,
                 fix="pass physical pages [bs, max_pages] (req_to_token at each page's first token // page_size).")
    for name, q in (("q_pos", q_pos), ("q_neg", q_neg)):
        check_tensor(name, q, dtype=FLOAT_DTYPES, shape=(pages.shape[0], h_kv, d), device=page_min.device.type,
                     fix="pass split_query_sign(queries) [bs, H_kv, D].")
    check_range("pages", pages, 0, num_pages - 1, f"physical page ids lie in [0, {num_pages}) (page 0 is padding).")


def check_quest_queries(queries, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Decode queries as ``[bs, H_q, D]``; SGLang's Quest messages (verbatim, then the fix) for shapes it refuses."""
    bs = queries.shape[0]
    if queries.dim() == 2:
        hidden = queries.shape[1]
        if hidden % head_dim != 0:
            raise ShapeError(f"Quest query hidden size {hidden} not divisible by head_dim {head_dim}. Fix: pass "
                             f"queries as [bs, H_q * {head_dim}] (all query heads of the layer, flattened) or as "
                             f"[bs, H_q, {head_dim}].")
        queries = queries.reshape(bs, hidden // head_dim, head_dim)
    elif queries.dim() != 3 or queries.shape[2] != head_dim:
        raise ShapeError(f"Unsupported query shape for Quest: {queries.shape}. Fix: pass one decode query per "
                         f"request, [bs, H_q * {head_dim}] or [bs, H_q, {head_dim}] (head_dim of the KV pool is "
                         f"{head_dim}).")
    num_q_heads = queries.shape[1]
    if num_q_heads % num_kv_heads != 0 or num_q_heads == 0:
        raise ShapeError(f"Query heads {num_q_heads} not divisible by KV heads {num_kv_heads}. Fix: pass all H_q "
                         "query heads of the layer; with grouped-query attention H_q must be a multiple of the "
                         f"pool's {num_kv_heads} KV heads.")
    return queries


def check_quest(bounds_dtype, bounds_dtypes) -> None:
    if bounds_dtype not in bounds_dtypes:
        fail("bounds_dtype", f"one of {bounds_dtypes}", repr(bounds_dtype), "torch.float32 (exact bounds), or "
             "torch.bfloat16 / torch.float16 (half the bytes to score; min rounded down, max up).", ConfigError)


def check_quest_allocators(token_to_kv_pool, page_allocator) -> list:
    """The allocators whose frees Quest must hear: the pool's own (required) and an extra one (optional)."""
    allocators = [a for a in (getattr(token_to_kv_pool, "allocator", None), page_allocator) if a is not None]
    if not allocators or not all(callable(getattr(a, "add_free_listener", None)) for a in allocators):
        fail("token_to_kv_pool.allocator", "a PageAllocator (with add_free_listener) that frees its pages",
             describe(getattr(token_to_kv_pool, "allocator", None)),
             "pass a sparse_ref.TokenToKVPool (it carries its allocator), or set pool.allocator.", PoolError)
    return allocators


def check_quest_hook(algo, fn: str, layer_id, forward_batch, k_buffer) -> None:
    """The inputs of ``construct_representations`` / ``update_representations``, every page to summarize real."""
    check_algorithm_layer(algo, layer_id)
    check_algorithm_batch(algo, fn, forward_batch)
    want_mode, other = ((ForwardMode.EXTEND, "after a decode step call update_representations") if
                        fn == "construct_representations" else
                        (ForwardMode.DECODE, "after a prefill call construct_representations"))
    if forward_batch.forward_mode is not want_mode:
        article = "an" if want_mode is ForwardMode.EXTEND else "a"
        raise BatchError(f"{fn}: expected {article} {want_mode.name} batch, got {forward_batch.forward_mode}. "
                         f"Fix: {other} instead.")
    want = (algo.num_pages * algo.page_size, algo.num_kv_heads, algo.head_dim)
    host = isinstance(k_buffer, torch.Tensor) and k_buffer.is_pinned()  # an offloaded layer's keys (unified address)
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, shape=want, device=None if host else algo.device.type,
                 fix="pass token_to_kv_pool.get_key_buffer(layer_id) (or an offloaded layer's pinned host keys).")
    fb = forward_batch
    if not skip_value_checks():
        check_real_pages(algo, *pages_to_summarize(algo.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                                   fb.seq_lens, algo.page_size, fb.extend_prefix_lens if
                                                   fn == "construct_representations" else None))


def check_real_pages(algo, pages: torch.Tensor, write: torch.Tensor) -> None:
    """Pages whose bounds are about to be built (where ``write``) hold real tokens: never padding page 0."""
    if bool(((pages < 1) & write).any()):
        fail("forward_batch.seq_lens", "lengths within each request's tokens (every page to summarize mapped to "
             f"a page in [1, {algo.num_pages}) by req_to_token)", "a length that reaches padding page 0",
             "pass the batch built for these requests (build_extend_batch / build_decode_batch).", BatchError)


def check_invalidate_pages(algo, pages) -> torch.Tensor:
    pages = torch.tensor(check_index_list("invalidate_pages(pages)", pages), dtype=torch.int64)
    check_range("invalidate_pages(pages)", pages, 0, algo.num_pages - 1,
                "pass physical pages of this pool (a negative id does not wrap to the last page).", PoolError)
    return pages


def check_score_pages(algo, queries, layer_id, forward_batch) -> None:
    """The layer, the query shape (Quest's messages) and, eagerly, every real token's page in [1, num_pages)."""
    check_algorithm_layer(algo, layer_id)
    check_quest_queries(queries, algo.num_kv_heads, algo.head_dim)
    if skip_value_checks() or forward_batch.batch_size == 0:
        return
    req_to_token = algo.req_to_token_pool.req_to_token
    rows = forward_batch.req_pool_indices.to(req_to_token.device).long()
    n = -(-forward_batch.seq_lens.to(req_to_token.device) // algo.page_size)
    cols = torch.arange(algo.max_pages, device=req_to_token.device)
    raw = req_to_token[rows[:, None], cols[None, :] * algo.page_size].long() // algo.page_size
    bad = (cols[None, :] < n[:, None]) & ((raw < 1) | (raw >= algo.num_pages))
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(f"req_to_token: request {r} (row {int(rows[r])}) maps logical page {j} to physical page "
                         f"{int(raw[r, j])}, outside the KV pool's usable pages [1, {algo.num_pages}). Fix: fill "
                         "req_to_token through KVCacheManager (admit/grow), and pass forward_batch for the same "
                         "requests.")
