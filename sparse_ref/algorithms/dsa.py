"""DeepSeek sparse attention (DSA): the lightning indexer, its FP8 key cache, and ``DSAAlgorithm``.

The lightning indexer picks, for every query token, the ``index_topk`` earlier tokens of
its request that attention will read. It follows DeepSeek-V3.2-Exp's reference ``Indexer``:

1. **project**: ``q = wq_b(q_lora)`` as ``[T, n_heads, head_dim]``; ``k = k_norm(wk(x))``,
   one ``head_dim`` key per token shared by all heads (``k_norm`` is a LayerNorm). The
   projections are computed in fp64 and rounded to fp32, so a token's values never depend on
   the batch it arrives in (see ``LightningIndexer._linear``);
2. **RoPE** on the first ``rope_dim`` dims of q and k, non-interleaved ("rotate half"),
   as DeepSeek's reference indexer does (see ``sparse_ref.rope`` for why not interleaved);
3. **Hadamard**: rotate q and k by ``H / sqrt(head_dim)`` (``sparse_ref.hadamard``): dot
   products are unchanged, outlier channels are spread out before quantising;
4. **FP8**: e4m3 with one fp32 scale per block (``sparse_ref.fp8``): per token for k, per
   token and head for q. A block never spans two vectors, so with ``head_dim <= block_size``
   each vector is one block (DeepSeek: ``head_dim == block_size == 128``);
5. **weights**: ``w[t, h] = weights_proj(x)[t, h] * n_heads**-0.5 * q_scale[t, h] * head_dim**-0.5``
   (q's scale is folded into the head weight, as in the reference);
6. **score**: ``I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] · k[s])`` over the
   FP8 values, for ``s <= position[t]`` of the same request (causal); ``-inf`` elsewhere;
7. **top-k**: the ``index_topk`` best logical positions per token, int32, -1 padded, by
   ``sparse_ref.selection.topk_reference`` (ties to the lower position; NaN and -inf never
   chosen), returned in ascending position order, the order the adaptor expects.

``use_fp8=False`` runs the same pipeline with no quantisation (scales are 1).

**The key cache.** ``IndexerKeyCache`` keeps, per layer and per physical KV slot, the
quantised key (``head_dim`` bytes of FP8) and its fp32 scale: 132 bytes per token at
``head_dim=128``. It is addressed like the KV pool: logical token ``t`` of request ``r``
lives at slot ``req_to_token[r, t]`` (page 0 is padding and never written). Attach it
once: ``indexer.attach_cache(IndexerKeyCache.for_manager(manager, config))`` (or ``from_pools``
with the two pools; ``for_manager`` also forgets the keys of freed pages). Then
``indexer(x, q_lora, positions, forward_batch, layer_id)``:

* writes the new tokens' keys at ``forward_batch.out_cache_loc``;
* EXTEND (prefill, or a chunk after ``extend_prefix_lens`` cached tokens): scores each new
  token against its request's keys ``0 .. position`` (cached prefix + this chunk);
* DECODE: scores the one new token per request against the whole history;
* returns the selected positions, int32 ``[T, index_topk]``.

**DSAAlgorithm** (registered as ``deepseek_dsa``) wraps that call in the retrieval contract,
as SGLang's ``deepseek_dsa.py`` does: ``retrieve_topk(...)`` needs ``indexer``,
``forward_batch``, ``x``, ``q_lora`` and ``positions`` and returns ``(selection, None)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from sparse_ref.algorithms.base import SparseAlgorithm
from sparse_ref.batch import ForwardBatch, ForwardMode
from sparse_ref.errors import (
    SEED_DSA_REQUIRED,
    BatchError,
    ConfigError,
    PoolError,
    RetrievalError,
    ShapeError,
    check_tensor,
    describe,
)
from sparse_ref.fp8 import FP8_DTYPE, quantize_fp8
from sparse_ref.hadamard import hadamard_rotate, is_power_of_two
from sparse_ref.rope import apply_rope
from sparse_ref.selection import topk_reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- configuration
@dataclass
class IndexerConfig:
    """Shapes and numerics of the lightning indexer. Defaults are DeepSeek-V3.2-Exp's.

    * ``hidden_size``: width of ``x`` (the layer's hidden states);
    * ``q_lora_rank``: width of ``q_lora`` (MLA's low-rank query latent);
    * ``n_heads``, ``head_dim``: indexer heads and their dim (a power of two, for the Hadamard);
    * ``rope_dim``: the first ``rope_dim`` dims get RoPE (even, ``<= head_dim``);
    * ``index_topk``: positions kept per query token;
    * ``use_fp8``: quantise q and k to FP8 e4m3 (False: full precision, for teaching/testing);
    * ``block_size``: values per FP8 scale. A block never spans two vectors, so it must be
      ``>= head_dim``; each q head and each key is then one block with one scale, which is
      what lets q's scale fold into the head weights (the score formula above);
    * ``ue8m0``: round scales up to powers of two (DeepSeek's checkpoint config sets
      ``scale_fmt="ue8m0"``); off by default so scales are exactly ``amax / 448``;
    * ``rope_theta``, ``rope_interleaved``: RoPE base and layout (DeepSeek's indexer: not interleaved);
    * ``layer_norm_eps``: epsilon of ``k_norm``.
    """

    hidden_size: int = 7168
    q_lora_rank: int = 1536
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    index_topk: int = 2048
    use_fp8: bool = True
    block_size: int = 128
    ue8m0: bool = False
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "index_topk", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"IndexerConfig.{name}: expected a positive int, got {value!r}.")
        for name in ("use_fp8", "ue8m0", "rope_interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"IndexerConfig.{name}: expected True or False, got {getattr(self, name)!r}.")
        if not is_power_of_two(self.head_dim):
            raise ConfigError(
                f"IndexerConfig.head_dim: expected a power of two (the fast Hadamard transform needs one), "
                f"got {self.head_dim}. Fix: use 32, 64, 128, ..."
            )
        r = self.rope_dim
        if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2 or r > self.head_dim:
            raise ConfigError(
                f"IndexerConfig.rope_dim: expected an even int in [0, head_dim={self.head_dim}] (RoPE rotates "
                f"pairs of dims), got {r!r}."
            )
        if self.block_size < self.head_dim:
            raise ConfigError(
                f"IndexerConfig.block_size: expected >= head_dim={self.head_dim}, got {self.block_size}. The score "
                "folds one q scale per (token, head) into the head weights and multiplies one k scale per token, "
                "so each head_dim vector must be a single FP8 block. Fix: block_size=128 with head_dim <= 128."
            )
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1.0:
            raise ConfigError(f"IndexerConfig.rope_theta: expected a number > 1, got {theta!r}.")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ConfigError(f"IndexerConfig.layer_norm_eps: expected a number > 0, got {eps!r}.")

    @property
    def quant_block(self) -> int:
        """Values per FP8 scale as used: one whole ``head_dim`` vector (a block never spans two)."""
        return self.head_dim

    @property
    def key_bytes_per_token(self) -> int:
        """Cache bytes per token and layer: the key (1 byte per value in FP8, 4 in fp32) + one fp32 scale."""
        return self.head_dim * (1 if self.use_fp8 else 4) + 4


# ----------------------------------------------------------------------------- the key cache
class IndexerKeyCache:
    """Per layer: keys ``[num_slots, head_dim]`` (FP8, or fp32 when ``use_fp8=False``) and fp32 scales ``[num_slots]``.

    One entry per physical KV slot, so the indexer's key for logical token ``t`` of
    request ``r`` is at slot ``req_to_token[r, t]``, exactly where the KV pool keeps that
    token's K and V. Slots ``0 .. page_size-1`` (page 0) are padding and never written.
    ``written[layer]`` marks slots that hold a key, so reading a history that was never
    indexed (e.g. a chunk whose prefix skipped the indexer) raises instead of scoring zeros.
    """

    def __init__(self, num_slots: int, num_layers: int, config: IndexerConfig, req_to_token_pool, *,
                 page_size: int = 1, device=None):
        if not isinstance(config, IndexerConfig):
            raise ConfigError(f"IndexerKeyCache: config must be an IndexerConfig, got {type(config).__name__}.")
        for name, value in (("num_slots", num_slots), ("num_layers", num_layers), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PoolError(f"IndexerKeyCache: {name} must be a positive int, got {value!r}.")
        if num_slots <= page_size:
            raise PoolError(f"IndexerKeyCache: num_slots={num_slots} leaves no slot past the padding page "
                            f"(page_size={page_size}).")
        if not hasattr(req_to_token_pool, "req_to_token"):
            raise PoolError(f"IndexerKeyCache: req_to_token_pool must be a ReqToTokenPool, got "
                            f"{type(req_to_token_pool).__name__}.")
        self.config = config
        self.num_slots, self.num_layers, self.page_size = num_slots, num_layers, page_size
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(device) if device is not None else req_to_token_pool.req_to_token.device
        key_dtype = FP8_DTYPE if config.use_fp8 else torch.float32
        self.keys = [torch.zeros(num_slots, config.head_dim, dtype=key_dtype, device=self.device)
                     for _ in range(num_layers)]
        self.scales = [torch.zeros(num_slots, dtype=torch.float32, device=self.device) for _ in range(num_layers)]
        self.written = [torch.zeros(num_slots, dtype=torch.bool, device=self.device) for _ in range(num_layers)]

    @classmethod
    def from_pools(cls, token_to_kv_pool, req_to_token_pool, config: IndexerConfig,
                   num_layers: int | None = None) -> IndexerKeyCache:
        """A cache with one entry per slot of ``token_to_kv_pool`` (and its layer count, unless given)."""
        return cls(token_to_kv_pool.num_slots, num_layers or token_to_kv_pool.num_layers, config, req_to_token_pool,
                   page_size=token_to_kv_pool.page_size, device=token_to_kv_pool.device)

    @classmethod
    def for_manager(cls, manager, config: IndexerConfig, num_layers: int | None = None) -> IndexerKeyCache:
        """``from_pools`` for a ``KVCacheManager``, also told when pages are freed (``invalidate_pages``).

        The recommended constructor: a freed page may be handed to another request, and its
        stale keys must then never pass for that request's history.
        """
        cache = cls.from_pools(manager.token_to_kv_pool, manager.req_to_token_pool, config, num_layers)
        manager.allocator.add_free_listener(cache.invalidate_pages)
        return cache

    def invalidate_pages(self, pages: torch.Tensor) -> None:
        """Forget the keys of freed physical pages (every layer): reading them again raises until rewritten."""
        pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).to(self.device)
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)
        slots = slots[(slots >= 0) & (slots < self.num_slots)]
        for written in self.written:
            written[slots] = False

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer: 132 at head_dim 128 in FP8 (128 key bytes + a 4-byte scale)."""
        return self.config.key_bytes_per_token

    def check_layer(self, layer_id) -> None:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise PoolError(f"layer_id: expected an int in [0, {self.num_layers}) (the indexer cache's layers), "
                            f"got {layer_id!r}.")

    def write(self, layer_id: int, loc: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> None:
        """Store ``keys`` ``[n, head_dim]`` and ``scales`` ``[n]`` at physical slots ``loc`` ``[n]``."""
        self.check_layer(layer_id)
        check_tensor("loc", loc, dtype=(torch.int32, torch.int64), dims=1, device=self.device.type)
        n = loc.shape[0]
        want = (n, self.config.head_dim)
        if tuple(keys.shape) != want or tuple(scales.shape) != (n,):
            raise ShapeError(f"IndexerKeyCache.write: expected keys {want} and scales ({n},), got "
                             f"{tuple(keys.shape)} and {tuple(scales.shape)}.")
        if n:
            lo, hi = int(loc.min()), int(loc.max())
            if lo < self.page_size or hi >= self.num_slots:
                raise PoolError(f"IndexerKeyCache.write: slots must lie in [{self.page_size}, {self.num_slots}) "
                                f"(page 0 is padding), got min {lo}, max {hi}.")
        loc = loc.long()
        self.keys[layer_id][loc] = keys.to(self.keys[layer_id].dtype)
        self.scales[layer_id][loc] = scales.float()
        self.written[layer_id][loc] = True

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (as fp32 values: FP8 values are exact in fp32) and scales at ``slots``."""
        self.check_layer(layer_id)
        slots = slots.long()
        return self.keys[layer_id][slots].float(), self.scales[layer_id][slots]


# ----------------------------------------------------------------------------- the indexer
class IndexerQK(NamedTuple):
    """What the indexer scores with: per token ``q`` ``[T, H, D]`` with ``q_scale`` ``[T, H]``,
    head weights ``[T, H]`` (q_scale already folded in) and ``k`` ``[T, D]`` with ``k_scale`` ``[T]``.
    In FP8 mode ``q``/``k`` are ``float8_e4m3fn``; otherwise fp32 with scales of 1."""

    q: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``I[t, s] = k_scale[s] * sum_h weights[t, h] * relu(q[t, h] · k[s])``, fp32 ``[T, S]``.

    ``q`` ``[T, H, D]``, ``weights`` ``[T, H]``, ``k`` ``[S, D]``, ``k_scale`` ``[S]``; FP8 inputs are
    read as their exact fp32 values. No causal mask here: the caller applies it.
    """
    dots = torch.einsum("thd,sd->ths", q.float(), k.float())
    return torch.einsum("th,ths->ts", weights.float(), dots.clamp_min(0)) * k_scale.float()[None, :]


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2-Exp's lightning indexer (see the module docstring for the pipeline).

    Parameters: ``wq_b`` (``q_lora_rank -> n_heads*head_dim``), ``wk`` (``hidden_size -> head_dim``),
    ``k_norm`` (LayerNorm over ``head_dim``), ``weights_proj`` (``hidden_size -> n_heads``); all
    fp32, initialised from ``seed`` (normal with std ``fan_in**-0.5``), so two indexers built with
    the same config and seed are identical. The key cache is attached with ``attach_cache``.
    """

    def __init__(self, config: IndexerConfig, *, seed: int = 0, device="cpu", cache: IndexerKeyCache | None = None):
        super().__init__()
        if not isinstance(config, IndexerConfig):
            raise ConfigError(f"LightningIndexer: config must be an IndexerConfig, got {type(config).__name__}.")
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
        if not isinstance(cache, IndexerKeyCache):
            raise ConfigError(f"attach_cache: expected an IndexerKeyCache, got {type(cache).__name__}.")
        if cache.config.head_dim != self.config.head_dim or cache.config.use_fp8 != self.config.use_fp8:
            raise ConfigError(
                f"attach_cache: the cache holds head_dim={cache.config.head_dim}, use_fp8={cache.config.use_fp8} "
                f"keys but the indexer makes head_dim={self.config.head_dim}, use_fp8={self.config.use_fp8}. "
                "Fix: build the cache with the indexer's config."
            )
        if cache.device.type != self.device.type:
            raise ConfigError(f"attach_cache: the cache is on {cache.device} but the indexer on {self.device}.")
        self.cache = cache
        return self

    # ------------------------------------------------------------------ stages
    @staticmethod
    def _linear(layer: nn.Linear, inp: torch.Tensor) -> torch.Tensor:
        """``layer(inp)`` computed in fp64 and rounded to fp32: the same bits for a token in any batch.

        A BLAS matmul may round the last bit of a row differently depending on how many rows it
        multiplies, and one fp32 ulp can move a value across an FP8 rounding boundary (a whole FP8
        step, 2^-3 relative). Rounding an fp64 product to fp32 makes each token's q, k and head
        weights independent of the batch it came in, so prefill, chunked prefill and decode give
        bit-identical keys. (Production kernels promise no such thing; a reference should.)
        """
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
    def index_scores(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                     forward_batch: ForwardBatch, layer_id: int) -> torch.Tensor:
        """Write the new keys, then score every new token causally: fp32 ``[T, max(seq_lens)]``.

        Entry ``[t, s]`` is ``I[t, s]`` for ``s <= positions[t]`` of token t's request, ``-inf`` past it.
        """
        token_req, starts = self._check_call(x, q_lora, positions, forward_batch, layer_id)
        qk = self.prepare(x, q_lora, positions)
        cache = self.cache
        cache.write(layer_id, forward_batch.out_cache_loc, qk.k, qk.k_scale)

        req_to_token = cache.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens.tolist()
        counts = torch.bincount(token_req, minlength=len(seq_lens)).tolist()
        T = positions.shape[0]
        width = max(seq_lens) if seq_lens else 0
        scores = torch.full((T, width), float("-inf"), dtype=torch.float32, device=x.device)
        for i, (seq_len, start, n) in enumerate(zip(seq_lens, starts, counts, strict=True)):
            if n == 0:
                continue
            slots = req_to_token[forward_batch.req_pool_indices[i], :seq_len].long()
            written = cache.written[layer_id][slots]
            if not bool(written.all()):
                missing = (~written).nonzero().squeeze(1)[:8].tolist()
                raise BatchError(
                    f"request {i} (req_to_token row {int(forward_batch.req_pool_indices[i])}): the indexer cache "
                    f"of layer {layer_id} holds no key for positions {missing}{'...' if (~written).sum() > 8 else ''}"
                    f" of its history. Fix: run the indexer over every earlier chunk (prefix) of the request first."
                )
            keys, key_scales = cache.read(layer_id, slots)
            rows = slice(start, start + n)
            logits = indexer_logits(qk.q[rows], qk.weights[rows], keys, key_scales)
            causal = torch.arange(seq_len, device=x.device)[None, :] <= positions[rows, None]
            scores[rows, :seq_len] = torch.where(causal, logits, torch.full_like(logits, float("-inf")))
        return scores

    def select(self, scores: torch.Tensor, positions: torch.Tensor, order: str = "index") -> torch.Tensor:
        """Top ``index_topk`` positions per row of ``scores``, int32 ``[T, index_topk]``, -1 padded."""
        return topk_reference(scores, self.config.index_topk, positions.long() + 1, order=order,
                              width=self.config.index_topk)

    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch, layer_id: int, *, order: str = "index") -> torch.Tensor:
        """Write the new tokens' keys at ``out_cache_loc``; return their selected positions.

        int32 ``[T, index_topk]``: for each new token, the logical positions of its own request
        (all ``<= its position``) with the best index scores, ascending (``order="score"``:
        best first), -1 padded when the history is shorter than ``index_topk``.
        """
        scores = self.index_scores(x, q_lora, positions, forward_batch, layer_id)
        return self.select(scores, positions, order)

    # ------------------------------------------------------------------ input checks
    def _check_call(self, x, q_lora, positions, forward_batch, layer_id) -> tuple[torch.Tensor, list[int]]:
        """Every check before any work. Returns each token's request index and each request's first token."""
        c = self.config
        if self.cache is None:
            raise ConfigError(
                "LightningIndexer: no key cache attached. Fix: indexer.attach_cache(IndexerKeyCache.for_manager("
                "manager, indexer.config)), or IndexerKeyCache.from_pools(token_to_kv_pool, req_to_token_pool, "
                "indexer.config)."
            )
        if not isinstance(forward_batch, ForwardBatch):
            raise BatchError(f"forward_batch: expected a sparse_ref.ForwardBatch, got {describe(forward_batch)}. "
                             "Fix: build it with build_extend_batch / build_decode_batch.")
        self.cache.check_layer(layer_id)
        dev = self.device.type
        check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2, device=dev,
                     fix=f"pass the hidden states of the new tokens, [num_tokens, hidden_size={c.hidden_size}].")
        check_tensor("q_lora", q_lora, dtype=FLOAT_DTYPES, dims=2, device=dev,
                     fix=f"pass the low-rank query latents, [num_tokens, q_lora_rank={c.q_lora_rank}].")
        check_tensor("positions", positions, dtype=(torch.int32, torch.int64), dims=1, device=dev,
                     fix="pass forward_batch.positions.")
        T = positions.shape[0]
        for name, t, width in (("x", x, c.hidden_size), ("q_lora", q_lora, c.q_lora_rank)):
            if tuple(t.shape) != (T, width):
                raise ShapeError(f"{name}: expected shape ({T}, {width}) (one row per entry of positions, "
                                 f"width {'hidden_size' if name == 'x' else 'q_lora_rank'}), got {tuple(t.shape)}.")
        fb = forward_batch
        for name in ("req_pool_indices", "seq_lens", "positions", "out_cache_loc"):
            t = getattr(fb, name)
            if t.device.type != dev:
                raise ShapeError(f"forward_batch.{name} is on {t.device} but the indexer is on {self.device}. "
                                 "Fix: build the batch on the indexer's device.")
        if fb.positions.shape[0] != T:
            raise BatchError(f"positions has {T} entries but forward_batch has {fb.positions.shape[0]} new tokens. "
                             "Fix: pass the batch's own tokens (x, q_lora and positions of forward_batch).")
        if not torch.equal(positions.long(), fb.positions):
            raise BatchError("positions: differ from forward_batch.positions; RoPE and the causal mask would use "
                             "other positions than the cache. Fix: pass positions=forward_batch.positions.")
        bs = fb.batch_size
        seq_lens = fb.seq_lens
        req_to_token = self.cache.req_to_token_pool.req_to_token
        if bs:
            rows, max_len = req_to_token.shape
            lo, hi = int(fb.req_pool_indices.min()), int(fb.req_pool_indices.max())
            if lo < 0 or hi >= rows:
                raise BatchError(f"forward_batch.req_pool_indices: expected rows in [0, {rows}), got [{lo}, {hi}].")
            if int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_len:
                raise BatchError(f"forward_batch.seq_lens: expected values in [0, {max_len}] (max_context_len), got "
                                 f"[{int(seq_lens.min())}, {int(seq_lens.max())}].")
        if fb.forward_mode is ForwardMode.DECODE:
            counts = torch.ones(bs, dtype=torch.int64, device=positions.device)
        else:
            counts = fb.extend_seq_lens
        if counts.shape[0] != bs or (bs and int(counts.min()) < 0) or int(counts.sum()) != T:
            raise BatchError(f"forward_batch: new tokens per request {counts.tolist()} do not add up to the {T} "
                             "tokens of positions. Fix: build the batch with build_extend_batch / build_decode_batch.")
        token_req = torch.repeat_interleave(torch.arange(bs, device=positions.device), counts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        if T:
            own_len = seq_lens[token_req]
            bad = (positions < 0) | (positions >= own_len)
            if bool(bad.any()):
                t = int(bad.nonzero()[0, 0])
                raise BatchError(f"positions[{t}] = {int(positions[t])} is outside [0, seq_len={int(own_len[t])}) of "
                                 f"its request {int(token_req[t])}. Fix: seq_lens must count the new tokens.")
            expected_loc = req_to_token[fb.req_pool_indices[token_req], positions.long()].long()
            if not torch.equal(expected_loc, fb.out_cache_loc):
                t = int((expected_loc != fb.out_cache_loc).nonzero()[0, 0])
                raise BatchError(
                    f"forward_batch.out_cache_loc[{t}] = {int(fb.out_cache_loc[t])} but req_to_token maps that token "
                    f"(request {int(token_req[t])}, position {int(positions[t])}) to slot {int(expected_loc[t])}: "
                    "its key would be written where its request never reads it. Fix: build the batch from the pool."
                )
        return token_req, starts


# ----------------------------------------------------------------------------- the algorithm
DSA_REQUIRED = ("indexer", "forward_batch", "x", "q_lora", "positions")


def missing_dsa_kwargs_message(missing) -> str:
    """The seed message, then exactly which of the five kwargs are missing, why they matter and the fix."""
    return (
        f"{SEED_DSA_REQUIRED}. Missing: {', '.join(missing)} (not passed, or None). DSA retrieval runs the model's "
        "lightning indexer, which scores every cached token of a request from the hidden states (x), the low-rank "
        "query latent (q_lora) and the token positions, and needs the batch (forward_batch) to find each request's "
        "keys. Fix: algo.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, indexer=indexer, "
        "forward_batch=forward_batch, x=hidden_states, q_lora=q_lora, positions=forward_batch.positions)"
    )


class DSAAlgorithm(SparseAlgorithm):
    """DeepSeek sparse attention as a sparse algorithm: retrieval *is* the indexer call.

    The representation hooks do nothing (the indexer writes its own keys during its forward).
    ``retrieve_topk`` returns ``(selection, None)`` as SGLang does, where ``selection`` is the
    indexer's int32 ``[num_tokens, index_topk]`` logical positions, ascending, -1 padded. Rows
    of requests whose ``sparse_mask`` is False are all -1 (length 0: attend densely), which
    SGLang's DSA does not do; the contract of this package says a length-0 row stays dense.
    ``queries`` is unused: the indexer builds its own queries from ``q_lora``. Feed the
    selection to ``sparse_ref.adaptor.to_attention_metadata`` with ``page_size=1``.
    """

    name = "deepseek_dsa"

    def retrieve_topk(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                      sparse_mask: torch.Tensor, attn_metadata=None, **kwargs):
        missing = [name for name in DSA_REQUIRED if kwargs.get(name) is None]
        if missing:
            raise RetrievalError(missing_dsa_kwargs_message(missing))
        indexer, forward_batch = kwargs["indexer"], kwargs["forward_batch"]
        if not callable(indexer):
            raise RetrievalError(f"indexer: expected the model's LightningIndexer (a callable module), got "
                                 f"{describe(indexer)}.")
        if not isinstance(forward_batch, ForwardBatch):
            raise RetrievalError(f"forward_batch: expected a sparse_ref.ForwardBatch, got {describe(forward_batch)}.")
        if self.req_to_token_pool is not None:
            self.check_layer(layer_id)
        bs = forward_batch.batch_size
        check_tensor("req_pool_indices", req_pool_indices, dtype=(torch.int32, torch.int64), dims=1,
                     fix="pass forward_batch.req_pool_indices.")
        if not torch.equal(req_pool_indices.long().cpu(), forward_batch.req_pool_indices.cpu()):
            raise BatchError("req_pool_indices: differ from forward_batch.req_pool_indices. "
                             "Fix: pass forward_batch.req_pool_indices.")
        check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, dims=1,
                     fix="pass a bool tensor [bs], True for requests that may go sparse.")
        if sparse_mask.shape[0] != bs:
            raise ShapeError(f"sparse_mask: expected {bs} entries (one per request), got {sparse_mask.shape[0]}.")
        selection = indexer(x=kwargs["x"], q_lora=kwargs["q_lora"], positions=kwargs["positions"],
                            forward_batch=forward_batch, layer_id=layer_id)
        if forward_batch.forward_mode is ForwardMode.DECODE:
            counts = torch.ones(bs, dtype=torch.int64)
        else:
            counts = forward_batch.extend_seq_lens.cpu()
        dense_tokens = torch.repeat_interleave(~sparse_mask.cpu(), counts).to(selection.device)
        selection = torch.where(dense_tokens[:, None], torch.full_like(selection, -1), selection)
        return selection, None

    def retrieve_topk_loop(self, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                           sparse_mask: torch.Tensor, attn_metadata=None, **kwargs):
        """The same as ``retrieve_topk``: the indexer already scores request by request."""
        return self.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, attn_metadata, **kwargs)
