"""DeepSeek sparse attention (DSA): the lightning indexer, its FP8 key cache, and ``DSAAlgorithm``.

The lightning indexer picks, for every query token, the ``index_topk`` earlier tokens of its request that
attention will read, as DeepSeek-V3.2-Exp's ``Indexer`` does: project, RoPE, Hadamard, FP8, head weights, the
causal score ``I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])`` and the top-k (ascending
positions, -1 padded); ``docs/design.md`` section 3.6 gives each step's formula. The FP8 keys live in
``memory.IndexerKeyCache``, paged like the KV pool. A batch is scored at once through a page table (the
Triton kernel or its batched torch reference: no loop over requests, no host sync); ``index_scores_loop`` is
the readable per-request version. ``DSAAlgorithm`` wraps the call in the retrieval contract, as SGLang does.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from sparse_ref.adaptor import lengths_from_selection, to_attention_metadata
from sparse_ref.algorithms.base import SparseAlgorithm
from sparse_ref.backend import choose_backend, torch_twin
from sparse_ref.batch import ForwardBatch, ForwardMode
from sparse_ref.checks import (
    INDEX_DTYPES,
    check_int,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
    skip_value_checks,
)
from sparse_ref.config import IndexerConfig
from sparse_ref.errors import SEED_DSA_REQUIRED, BatchError, ConfigError, RetrievalError, ShapeError
from sparse_ref.fp8 import FP8_DTYPE, quantize_fp8
from sparse_ref.hadamard import hadamard_rotate
from sparse_ref.memory import IndexerKeyCache
from sparse_ref.rope import apply_rope


def paged_indexer_logits_reference(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
                                   block_table: torch.Tensor, token_req: torch.Tensor, bounds: torch.Tensor,
                                   width: int, *, chunk_elements: int = 1 << 27) -> torch.Tensor:
    """Batched torch reference of ``kernels.dsa.paged_indexer_logits``: fp32 ``[T, width]``, ``I[t, s]`` for
    ``s < bounds[t]``, ``-inf`` after. One gather of the keys through ``block_table``; query tokens in chunks of
    at most ``chunk_elements`` fp32 intermediates (a trip count from shapes alone: no host sync)."""
    T, H, D = q.shape
    P = keys.shape[1]
    n_pages = -(-width // P)
    pages = block_table[:, :n_pages].long()
    if pages.shape[1] < n_pages:  # rows shorter than the width: pad with the padding page
        pages = torch.nn.functional.pad(pages, (0, n_pages - pages.shape[1]))
    raw = keys.view(torch.uint8) if keys.dtype == FP8_DTYPE else keys  # gather FP8 as bytes (any device)
    k_all = raw[pages].reshape(pages.shape[0], n_pages * P, D)[:, :width]  # [bs, width, D]
    s_all = scales[pages].reshape(pages.shape[0], n_pages * P)[:, :width]
    out = torch.empty(T, width, dtype=torch.float32, device=q.device)
    step = max(1, chunk_elements // max(1, width * (D + H)))
    pos = torch.arange(width, device=q.device)
    for lo in range(0, T, step):
        rows = token_req[lo: lo + step].long()
        k_rows = k_all[rows].view(FP8_DTYPE) if keys.dtype == FP8_DTYPE else k_all[rows]
        dots = torch.bmm(k_rows.float(), q[lo: lo + step].float().transpose(1, 2))  # [c, width, H]
        logits = (dots.clamp_min(0) * weights[lo: lo + step, None, :].float()).sum(-1) * s_all[rows]
        visible = pos[None, :] < bounds[lo: lo + step, None]
        out[lo: lo + step] = torch.where(visible, logits, torch.full_like(logits, float("-inf")))
    return out


@torch_twin("dsa_logits")
def paged_indexer_logits_torch(q, weights, keys, scales, block_table, token_req, bounds, width,
                               fill_tail: bool = True) -> torch.Tensor:
    """The backend's torch logits (the kernel's signature): the reference, whose tail is always ``-inf``."""
    return paged_indexer_logits_reference(q, weights, keys, scales, block_table, token_req, bounds, width)


# ----------------------------------------------------------------------------- the indexer
class IndexerQK(NamedTuple):
    """Per token: ``q`` ``[T, H, D]``, ``q_scale`` ``[T, H]``, head ``weights`` ``[T, H]`` (q_scale folded in),
    ``k`` ``[T, D]``, ``k_scale`` ``[T]``; FP8 ``q``/``k``, or fp32 with scales of 1."""

    q: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``I[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] · k[s])``, fp32 ``[T, S]`` (no causal mask)."""
    dots = torch.einsum("thd,sd->ths", q.float(), k.float())
    return torch.einsum("th,ths->ts", weights.float(), dots.clamp_min(0)) * k_scale.float()[None, :]


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2-Exp's lightning indexer: ``wq_b``, ``wk``, ``k_norm`` and ``weights_proj``, fp32, drawn from
    ``seed`` (two indexers of one config and seed are identical); keys in the cache ``attach_cache`` sets."""

    def __init__(self, config: IndexerConfig, *, seed: int = 0, device="cpu", cache: IndexerKeyCache | None = None,
                 backend="auto"):
        super().__init__()
        check_indexer(config)
        self.backend = choose_backend(backend, device)  # FP8 keys before Ada: its torch logits (sparse_ref.backend)
        self.config = config
        c = config
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=c.layer_norm_eps)
        self.weights_proj = nn.Linear(c.hidden_size, c.n_heads, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.wq_b, self.wk, self.weights_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * lin.in_features ** -0.5)
        self.to(device)
        self.cache = None
        if cache is not None:
            self.attach_cache(cache)

    @property
    def device(self) -> torch.device:
        return self.wk.weight.device

    def attach_cache(self, cache: IndexerKeyCache) -> LightningIndexer:
        """Use ``cache`` for keys from now on; returns ``self``. Its config must match the indexer's."""
        check_attach_cache(self, cache)
        self.cache = cache
        return self

    # ------------------------------------------------------------------ stages
    @staticmethod
    def _linear(layer: nn.Linear, inp: torch.Tensor) -> torch.Tensor:
        """``layer(inp)`` in fp64, rounded to fp32: a BLAS matmul's last bit depends on the batch, and one ulp can
        cross an FP8 rounding boundary; this way prefill, chunked prefill and decode give bit-identical keys."""
        return torch.nn.functional.linear(inp.double(), layer.weight.double()).float()

    @torch.no_grad()
    def project(self, x: torch.Tensor, q_lora: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 1: ``q = wq_b(q_lora)`` ``[T, H, D]`` and ``k = k_norm(wk(x))`` ``[T, D]`` (fp32)."""
        c = self.config
        q = self._linear(self.wq_b, q_lora).view(-1, c.n_heads, c.head_dim)
        k = self.k_norm(self._linear(self.wk, x))
        return q, k

    @torch.no_grad()
    def add_positions(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Stage 2: RoPE on the first ``rope_dim`` dims of q and k."""
        c = self.config
        return (apply_rope(q, positions, c.rope_dim, c.rope_theta, c.rope_interleaved),
                apply_rope(k, positions, c.rope_dim, c.rope_theta, c.rope_interleaved))

    @torch.no_grad()
    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 3: the orthonormal Hadamard rotation ``x @ H / sqrt(head_dim)`` of q and k."""
        return hadamard_rotate(q), hadamard_rotate(k)

    @torch.no_grad()
    def quantize(self, q: torch.Tensor, k: torch.Tensor):
        """Stage 4: ``(q8, q_scale [T, H], k8, k_scale [T])``; with ``use_fp8=False``, the inputs and scales of 1."""
        c = self.config
        if not c.use_fp8:
            return q, q.new_ones(q.shape[:-1]), k, k.new_ones(k.shape[:-1])
        q8, q_scale = quantize_fp8(q, c.quant_block, c.ue8m0)
        k8, k_scale = quantize_fp8(k, c.quant_block, c.ue8m0)
        return q8, q_scale.squeeze(-1), k8, k_scale.squeeze(-1)

    @torch.no_grad()
    def head_weights(self, x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
        """Stage 5: ``weights_proj(x) * n_heads**-0.5 * q_scale * head_dim**-0.5`` ``[T, H]`` (fp32)."""
        c = self.config
        return self._linear(self.weights_proj, x) * c.n_heads ** -0.5 * q_scale * c.head_dim ** -0.5

    @torch.no_grad()
    def prepare(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor) -> IndexerQK:
        """Stages 1-5 for a batch of new tokens (no cache involved)."""
        q, k = self.project(x, q_lora)
        q, k = self.add_positions(q, k, positions)
        q, k = self.rotate(q, k)
        q8, q_scale, k8, k_scale = self.quantize(q, k)
        return IndexerQK(q8, q_scale, self.head_weights(x, q_scale), k8, k_scale)

    # ------------------------------------------------------------------ scoring over the cache
    @torch.no_grad()
    def logits(self, qk: IndexerQK, forward_batch: ForwardBatch, layer_id: int, width: int, *,
               fill_tail: bool = True) -> torch.Tensor:
        """fp32 ``[T, width]``: ``I[t, s]`` for ``s <= positions[t]``, then ``-inf`` (``fill_tail``) or unwritten."""
        fb, cache = forward_batch, self.cache
        T = fb.positions.shape[0]
        if fb.forward_mode is ForwardMode.DECODE:
            token_req = torch.arange(T, dtype=torch.int32, device=self.device)
        else:
            token_req = torch.repeat_interleave(torch.arange(fb.batch_size, dtype=torch.int32, device=self.device),
                                                fb.extend_seq_lens, output_size=T)
        bounds = (fb.positions + 1).to(torch.int32)
        block_table = cache.block_table(fb.req_pool_indices)
        keys, scales = cache.key_pages(layer_id), cache.scale_pages(layer_id)
        return self.backend.dsa_logits(qk.q.contiguous(), qk.weights.float().contiguous(), keys, scales, block_table,
                                       token_req, bounds, width, fill_tail)

    @torch.no_grad()
    def index_scores(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                     forward_batch: ForwardBatch, layer_id: int, *, width: int | None = None) -> torch.Tensor:
        """Write the new keys, then score every new token causally: fp32 ``[T, width]``, ``-inf`` past a token's
        position. ``width``: ``max(seq_lens)`` by default (a host sync; pass it to avoid one)."""
        check_indexer_call(self, x, q_lora, positions, forward_batch, layer_id)
        width = check_index_width(self, forward_batch, width)
        qk = self.prepare(x, q_lora, positions)
        self.cache.write(layer_id, forward_batch.out_cache_loc, qk.k, qk.k_scale)
        return self.logits(qk, forward_batch, layer_id, width)

    @torch.no_grad()
    def index_scores_loop(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                          forward_batch: ForwardBatch, layer_id: int) -> torch.Tensor:
        """The readable reference of ``index_scores``: request by request, keys read slot by slot."""
        check_indexer_call(self, x, q_lora, positions, forward_batch, layer_id)
        fb, cache = forward_batch, self.cache
        qk = self.prepare(x, q_lora, positions)
        cache.write(layer_id, fb.out_cache_loc, qk.k, qk.k_scale)
        seq_lens = fb.seq_lens.tolist()
        counts = [1] * len(seq_lens) if fb.forward_mode is ForwardMode.DECODE else fb.extend_seq_lens.tolist()
        scores = torch.full((positions.shape[0], max(seq_lens, default=0)), float("-inf"), device=x.device)
        start = 0
        for i, (seq_len, n) in enumerate(zip(seq_lens, counts, strict=True)):
            rows = slice(start, start + n)
            start += n
            slots = cache.req_to_token_pool.req_to_token[fb.req_pool_indices[i], :seq_len]
            keys, key_scales = cache.read(layer_id, slots)
            logits = indexer_logits(qk.q[rows], qk.weights[rows], keys, key_scales)
            causal = torch.arange(seq_len, device=x.device)[None, :] <= positions[rows, None]
            scores[rows, :seq_len] = torch.where(causal, logits, torch.full_like(logits, float("-inf")))
        return scores

    def select(self, scores: torch.Tensor, positions: torch.Tensor, order: str = "index") -> torch.Tensor:
        """Top ``index_topk`` positions of the first ``positions[t] + 1`` entries of each row, int32, -1 padded."""
        lengths = positions.long() + 1
        k = self.config.index_topk
        return self.backend.topk(scores, k, lengths, order=order, width=k)

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch, layer_id: int, *, order: str = "index") -> torch.Tensor:
        """Write the new tokens' keys at ``out_cache_loc``; return int32 ``[T, index_topk]``: each token's best
        positions of its own request (``<=`` its position), ascending (``order="score"``: best first), -1 padded.
        DECODE never syncs with the host (CUDA-graph safe); EXTEND reads ``max(seq_lens)`` once."""
        check_indexer_call(self, x, q_lora, positions, forward_batch, layer_id)
        fb = forward_batch
        if fb.forward_mode is ForwardMode.DECODE:
            width = self.cache.req_to_token_pool.req_to_token.shape[1]
        else:
            width = int(fb.seq_lens.max()) if fb.batch_size else 0
        qk = self.prepare(x, q_lora, positions)
        self.cache.write(layer_id, fb.out_cache_loc, qk.k, qk.k_scale)
        return self.select(self.logits(qk, fb, layer_id, width, fill_tail=False), positions, order)

# ----------------------------------------------------------------------------- the algorithm
DSA_REQUIRED = ("indexer", "forward_batch", "x", "q_lora", "positions")


class DSAAlgorithm(SparseAlgorithm):
    """DeepSeek sparse attention as a sparse algorithm: retrieval *is* the indexer call, ``(selection, None)`` as
    in SGLang (the hooks do nothing; ``queries`` is unused). Rows whose ``sparse_mask`` is False are all -1 (dense),
    which SGLang's DSA does not do. Feed the selection to ``to_attention_metadata`` with ``page_size=1``."""


    name = "deepseek_dsa"

    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, attn_metadata=None, **kwargs):
        indexer, fb = check_dsa_retrieve(self, layer_id, req_pool_indices, sparse_mask, kwargs)
        selection = indexer(x=kwargs["x"], q_lora=kwargs["q_lora"], positions=kwargs["positions"],
                            forward_batch=fb, layer_id=layer_id)
        T = selection.shape[0]
        counts = torch.ones_like(fb.seq_lens) if fb.forward_mode is ForwardMode.DECODE else fb.extend_seq_lens
        dense_tokens = torch.repeat_interleave(~sparse_mask, counts, output_size=T)
        return selection.masked_fill(dense_tokens[:, None], -1), None

    def retrieve_topk_loop(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                           sparse_mask: torch.Tensor, attn_metadata=None, **kwargs):
        """The same as ``retrieve_topk``: the indexer already scores request by request."""
        return self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, attn_metadata, **kwargs)

    def retrieve_attention_metadata(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                                    sparse_mask: torch.Tensor, forward_batch, req_to_token: torch.Tensor, out=None,
                                    **kwargs):
        """``retrieve_topk`` (its kwargs), then the adaptor at page size 1: tokens, not pages."""
        selected, _ = self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask,
                                         forward_batch=forward_batch, **kwargs)
        lengths = lengths_from_selection(selected)
        return selected, lengths, *to_attention_metadata(selected, lengths, sparse_mask, forward_batch, req_to_token,
                                                         1, out, self.backend)


# ------------------------------ argument checks (each entry point above calls one first)
_INDEXER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_indexer(config) -> None:
    if not isinstance(config, IndexerConfig):
        raise ConfigError(f"LightningIndexer: config must be an IndexerConfig, got {type(config).__name__}.")


def check_attach_cache(indexer, cache) -> None:
    if not isinstance(cache, IndexerKeyCache):
        raise ConfigError(f"attach_cache: expected an IndexerKeyCache, got {type(cache).__name__}.")
    if cache.config.head_dim != indexer.config.head_dim or cache.config.use_fp8 != indexer.config.use_fp8:
        c, i = cache.config, indexer.config
        raise ConfigError(f"attach_cache: the cache holds head_dim={c.head_dim}, use_fp8={c.use_fp8} keys but the "
                          f"indexer makes head_dim={i.head_dim}, use_fp8={i.use_fp8}. Fix: build the cache with the "
                          "indexer's config.")
    if cache.device.type != indexer.device.type:
        raise ConfigError(f"attach_cache: the cache is on {cache.device} but the indexer on {indexer.device}.")


def check_indexer_call(indexer, x, q_lora, positions, forward_batch, layer_id) -> None:
    """Every check of an indexer call before any work (value checks need a host sync; skipped while capturing)."""
    c, dev = indexer.config, indexer.device.type
    if indexer.cache is None:
        raise ConfigError("LightningIndexer: no key cache attached. Fix: indexer.attach_cache(IndexerKeyCache."
                          "for_manager(manager, indexer.config)), or IndexerKeyCache.from_pools(token_to_kv_pool, "
                          "req_to_token_pool, indexer.config).")
    if not isinstance(forward_batch, ForwardBatch):
        fail("forward_batch", "a sparse_ref.ForwardBatch", describe(forward_batch),
             "build it with build_extend_batch / build_decode_batch.", BatchError)
    indexer.cache.check_layer(layer_id)
    fb = forward_batch
    T = fb.positions.shape[0]
    check_tensor("x", x, dtype=_INDEXER_DTYPES, shape=(T, c.hidden_size), device=dev,
                 fix=f"pass the hidden states of the batch's {T} new tokens, [T, hidden_size].")
    check_tensor("q_lora", q_lora, dtype=_INDEXER_DTYPES, shape=(T, c.q_lora_rank), device=dev,
                 fix=f"pass the low-rank query latents of the batch's {T} new tokens, [T, q_lora_rank].")
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(T,), device=dev,
                 fix="pass forward_batch.positions.")
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        check_tensor(f"forward_batch.{name}", getattr(fb, name), device=dev,
                     fix="build the batch on the indexer's device.")
    bs = fb.batch_size
    counts = fb.extend_seq_lens if fb.forward_mode is ForwardMode.EXTEND else None
    if counts is not None:
        check_rows("forward_batch.extend_seq_lens", counts, bs, error=BatchError)
    if skip_value_checks() or bs == 0:
        return
    req_to_token = indexer.cache.req_to_token_pool.req_to_token
    rows, max_len = req_to_token.shape
    check_range("forward_batch.req_pool_indices", fb.req_pool_indices, 0, rows - 1, error=BatchError)
    check_range("forward_batch.seq_lens", fb.seq_lens, 0, max_len, error=BatchError,
                fix="seq_lens may not exceed max_context_len.")
    if not torch.equal(positions.long(), fb.positions):
        raise BatchError("positions: differ from forward_batch.positions; RoPE and the causal mask would use "
                         "other positions than the cache. Fix: pass positions=forward_batch.positions.")
    counts = torch.ones_like(fb.seq_lens) if counts is None else counts
    if int(counts.min()) < 0 or int(counts.sum()) != T:
        raise BatchError(f"forward_batch: new tokens per request {counts.tolist()} do not add up to the {T} "
                         "tokens of positions. Fix: build the batch with build_extend_batch / build_decode_batch.")
    token_req = torch.repeat_interleave(torch.arange(bs, device=positions.device), counts)
    own_len = fb.seq_lens[token_req]
    bad = (positions < 0) | (positions >= own_len)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        fail(f"positions[{t}]", f"a position in [0, seq_len={int(own_len[t])}) of request {int(token_req[t])}",
             str(int(positions[t])), "seq_lens must count the new tokens.", BatchError)
    expected = req_to_token[fb.req_pool_indices[token_req], positions.long()].long()
    if not torch.equal(expected, fb.out_cache_loc):
        t = int((expected != fb.out_cache_loc).nonzero()[0, 0])
        fail(f"forward_batch.out_cache_loc[{t}]", f"slot {int(expected[t])}, where req_to_token keeps that "
             "token (its key would be written where its request never reads it)", str(int(fb.out_cache_loc[t])),
             "build the batch from the pool.", BatchError)
    indexer.cache.check_history(layer_id, fb.req_pool_indices, fb.seq_lens - counts)


def check_index_width(indexer, forward_batch, width) -> int:
    """The width of ``index_scores``: ``max(seq_lens)`` by default (one host sync), at most ``max_context_len``."""
    if width is None:
        width = int(forward_batch.seq_lens.max()) if forward_batch.batch_size else 0
    return check_int("width", width, low=0, high=indexer.cache.req_to_token_pool.req_to_token.shape[1],
                     error=ShapeError)


def missing_dsa_kwargs_message(missing) -> str:
    """The seed message, then exactly which of the five kwargs are missing, why they matter and the fix."""
    return (
        f"{SEED_DSA_REQUIRED}. Missing: {', '.join(missing)} (not passed, or None). DSA retrieval runs the model's "
        "lightning indexer, which scores every cached token of a request from the hidden states (x), the low-rank "
        "query latent (q_lora) and the token positions, and needs the batch (forward_batch) to find each request's "
        "keys. Fix: algo.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, indexer=indexer, "
        "forward_batch=forward_batch, x=hidden_states, q_lora=q_lora, positions=forward_batch.positions)"
    )


def check_dsa_retrieve(algo, layer_id, req_pool_indices, sparse_mask, kwargs: dict):
    """``(indexer, forward_batch)`` of ``DSAAlgorithm.retrieve_topk``: the seed error names the kwargs missing."""
    missing = [name for name in DSA_REQUIRED if kwargs.get(name) is None]
    if missing:
        raise RetrievalError(missing_dsa_kwargs_message(missing))
    indexer, fb = kwargs["indexer"], kwargs["forward_batch"]
    if not callable(indexer):
        fail("indexer", "the model's LightningIndexer (a callable module)", describe(indexer), error=RetrievalError)
    if not isinstance(fb, ForwardBatch):
        fail("forward_batch", "a sparse_ref.ForwardBatch", describe(fb), error=RetrievalError)
    if algo.req_to_token_pool is not None:
        algo.check_layer(layer_id)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, shape=(fb.batch_size,),
                 fix="pass forward_batch.req_pool_indices.")
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, shape=(fb.batch_size,),
                 fix="pass a bool tensor [bs], True for requests that may go sparse.")
    check_same_device("retrieve_topk", "req_pool_indices", {"req_pool_indices": req_pool_indices,
                      "sparse_mask": sparse_mask, "forward_batch.req_pool_indices": fb.req_pool_indices})
    if not skip_value_checks() and not torch.equal(req_pool_indices.long(), fb.req_pool_indices):
        raise BatchError("req_pool_indices: differ from forward_batch.req_pool_indices (another request's "
                         "row would be scored). Fix: pass forward_batch.req_pool_indices.")
    return indexer, fb
