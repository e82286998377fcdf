"""Synthetic long-context decode workloads with planted structure, deterministic from a seed.

Random keys alone give attention with no structure, so any page selection looks as good as any
other. Real attention has three patterns, which we plant along one direction ``u`` per KV head
(the unit vector of the request's group-mean query, so every query head of the group sees them):

* **needles**: one token in each of a few random history pages whose key is strongly aligned with
  the query: the pages a good selector must find;
* **sinks**: the first tokens get a moderate alignment (attention sinks);
* **locality**: the last tokens get an alignment that fades with distance.

``make_planted_workload`` builds the pools (pages of different requests interleaved, so logical
and physical ids differ), writes K/V, and returns a DECODE batch whose last token per request is
the one being decoded. ``make_quest_decode_setup`` adds an initialized, constructed
``QuestAlgorithm``: the recipe the benchmark uses at bs=64, 32K context, page 16.

``make_distribution`` makes the score rows that top-k benchmarks and notebook 05 use.

``PlantedEngineWorkload`` feeds ``sparse_ref.engine.DecodeEngine``: the same planted structure for
several layers, the prompt's K/V and each decode step's query and new K/V, plus the hidden states
the DSA indexer reads, all a function of ``(seed, request, layer, position)`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparse_ref.batch import ForwardBatch, build_decode_batch, build_extend_batch
from sparse_ref.checks import check_float, check_int
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.errors import SparseRefError
from sparse_ref.memory import KVCacheManager, Request
from sparse_ref.selection import ceil_div


@dataclass
class DecodeWorkload:
    """Pools filled with planted K/V, the requests, their DECODE batch and one query per request."""

    manager: KVCacheManager
    requests: list[Request]
    forward_batch: ForwardBatch
    queries: torch.Tensor  # [bs, H_q, D], fp32
    needle_pages: list[list[int]] = field(default_factory=list)  # logical pages holding a needle, per request
    layer: int = 0

    @property
    def page_size(self) -> int:
        return self.manager.page_size

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.manager.req_to_token_pool.req_to_token

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.manager.token_to_kv_pool.get_key_buffer(self.layer)

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.manager.token_to_kv_pool.get_value_buffer(self.layer)

    def prefill_batch(self) -> ForwardBatch:
        """An EXTEND batch over every token, for ``construct_representations``."""
        return build_extend_batch(self.manager, self.requests)

    def attach(self, algorithm) -> None:
        """Initialize ``algorithm`` on these pools (layer 0 .. num_layers) and construct it for every layer."""
        pool = self.manager.token_to_kv_pool
        kwargs = {"page_allocator": self.manager.allocator} if hasattr(algorithm, "invalidate_pages") else {}
        algorithm.initialize_representation_pool(0, pool.num_layers, pool, self.manager.req_to_token_pool, **kwargs)
        prefill = self.prefill_batch()
        for layer in range(pool.num_layers):
            algorithm.construct_representations(layer, prefill, pool.get_key_buffer(layer))


def make_planted_workload(seq_lens: Sequence[int], *, page_size: int = 16, num_q_heads: int = 8,
                          num_kv_heads: int = 2, head_dim: int = 64, num_needles: int = 4,
                          needle_strength: float = 3.0, num_sink_tokens: int = 4, sink_strength: float = 1.0,
                          local_window: int = 64, local_strength: float = 1.0, interleave_pages: int = 1,
                          extra_pages: int = 4, dtype=torch.float32, device="cpu", seed: int = 0) -> DecodeWorkload:
    """Build pools and a DECODE batch for requests of ``seq_lens`` tokens, with planted structure.

    Strengths are in units of the typical logit spread (a random key gives logits ~ N(0, 1)):
    a needle token's logit is about ``needle_strength * sqrt(D / G)`` for the group's query heads.
    ``interleave_pages``: pages handed to each request in turn, so requests' pages interleave.
    """
    seq_lens = [int(s) for s in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise SparseRefError(f"seq_lens: expected at least one request, each of >= 1 token, got {seq_lens}.")
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("page_size", page_size)):
        check_int(name, value, low=1, error=SparseRefError)
    if num_q_heads % num_kv_heads:
        raise SparseRefError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}.")
    device = torch.device(device)
    bs, P = len(seq_lens), page_size
    pages_needed = sum(ceil_div(s, P) for s in seq_lens)
    manager = KVCacheManager.create(max_requests=bs, max_context_len=max(seq_lens),
                                    num_pages=pages_needed + 1 + extra_pages,
                                    page_size=P, num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    dtype=dtype, device=device)
    requests = [manager.admit(0) for _ in seq_lens]
    chunk = max(1, interleave_pages) * P
    while any(r.seq_len < s for r, s in zip(requests, seq_lens, strict=True)):
        for r, s in zip(requests, seq_lens, strict=True):
            if r.seq_len < s:
                manager.grow(r, min(chunk, s - r.seq_len))

    gen = torch.Generator(device=device).manual_seed(seed)
    group = num_q_heads // num_kv_heads
    queries = torch.randn(bs, num_q_heads, head_dim, generator=gen, device=device)
    needles = []
    for i, (req, L) in enumerate(zip(requests, seq_lens, strict=True)):
        keys = torch.randn(L, num_kv_heads, head_dim, generator=gen, device=device)
        values = torch.randn(L, num_kv_heads, head_dim, generator=gen, device=device)
        qbar = queries[i].reshape(num_kv_heads, group, head_dim).mean(1)
        u = qbar / qbar.norm(dim=-1, keepdim=True).clamp(min=1e-6)  # [H_kv, D]
        boost = torch.zeros(L, device=device)
        boost[: min(num_sink_tokens, L)] = sink_strength
        dist = torch.arange(L - 1, -1, -1, device=device, dtype=torch.float32)
        boost += local_strength * torch.exp(-dist / max(local_window, 1)) * (dist < 4 * local_window)
        n = ceil_div(L, P)
        history = list(range(1, n - 1))  # neither the first (sink) page nor the last (current) page
        order = torch.randperm(len(history), generator=gen, device=device).tolist() if history else []
        chosen = sorted(history[j] for j in order[:num_needles])
        for page in chosen:
            offset = int(torch.randint(0, P, (1,), generator=gen, device=device))
            boost[page * P + offset] += needle_strength * math.sqrt(head_dim)
        needles.append(chosen)
        keys = keys + boost[:, None, None] * u[None]
        slots = manager.req_to_token_pool.req_to_token[req.req_pool_idx, :L].long()
        manager.token_to_kv_pool.set_kv(0, slots, keys, values)
    batch = build_decode_batch(manager, requests)
    return DecodeWorkload(manager, requests, batch, queries, needles)


@dataclass
class QuestDecodeSetup:
    """Everything ``retrieve_topk`` needs for one decode step of a Quest layer."""

    algorithm: object  # QuestAlgorithm, initialized and constructed
    queries: torch.Tensor  # [bs, H_q, D]
    forward_batch: ForwardBatch
    req_pool_indices: torch.Tensor
    sparse_mask: torch.Tensor
    layer_id: int
    workload: DecodeWorkload

    def retrieve(self, loop: bool = False):
        """One call of the batched ``retrieve_topk`` (or ``retrieve_topk_loop`` with ``loop=True``)."""
        fn = self.algorithm.retrieve_topk_loop if loop else self.algorithm.retrieve_topk
        return fn(self.queries, self.layer_id, self.req_pool_indices, self.sparse_mask,
                  forward_batch=self.forward_batch)


def make_quest_decode_setup(bs: int = 64, ctx: int = 32768, page_size: int = 16, num_q_heads: int = 32,
                            num_kv_heads: int = 8, head_dim: int = 128, config: SparseConfig | None = None,
                            device="cpu", dtype=torch.float32, seed: int = 0,
                            backend: str = "auto") -> QuestDecodeSetup:
    """A Quest decode step at ``bs`` requests of ``ctx`` tokens (the benchmark recipe).

    Example (H200): ``s = make_quest_decode_setup(64, 32768, 16, device="cuda")``, then time
    ``s.retrieve()`` against ``s.retrieve(loop=True)``. ``backend`` goes to ``QuestAlgorithm`` ("auto": Triton on
    CUDA, torch otherwise).
    """
    from sparse_ref.algorithms.quest import QuestAlgorithm  # workloads must not need algorithms to import

    pages = ceil_div(ctx, page_size)
    workload = make_planted_workload([ctx] * bs, page_size=page_size, num_q_heads=num_q_heads,
                                     num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     interleave_pages=max(1, pages // 32), dtype=dtype, device=device, seed=seed)
    algorithm = QuestAlgorithm(config, device, backend=backend)
    workload.attach(algorithm)
    fb = workload.forward_batch
    sparse_mask = torch.ones(bs, dtype=torch.bool, device=fb.seq_lens.device)
    return QuestDecodeSetup(algorithm, workload.queries, fb, fb.req_pool_indices, sparse_mask, 0, workload)


# ----------------------------------------------------------------------------- multi-layer, for the engine
def _mixed_seed(*parts: int) -> int:
    """One 63-bit seed from several ints, so each (seed, request, layer, position) gets its own stream."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


@dataclass
class PlantedRequest:
    """What the workload knows about one request: its seed key, prompt and planted needles (logical positions)."""

    key: int
    prompt_len: int
    needles: list[int]
    head_needles: list[tuple[int, int]]  # (position, query head): a needle only that query head looks for


@dataclass
class PlantedEngineWorkload:
    """Q/K/V of several layers for the decode engine, with planted structure, deterministic from ``seed``.

    Every number is a function of ``(seed, request key, layer, position)`` only, never of the batch a
    request runs in, so a request gives the same tensors whoever else is running (the engine tests
    rely on that). Per request and layer:

    * a base query per query head; each decode step's query is the base plus ``query_noise`` noise;
    * keys ``N(0, 1)`` plus the planted boosts of ``make_planted_workload`` (needles, sinks, locality)
      along ``u``, the unit group-mean query of each KV head;
    * ``head_needles``: extra needles aligned with one query head's *own* direction (its base query
      minus the group mean). The group mean does not see them: they are where Quest's ``mean`` GQA
      mode fails and ``per_kv_head`` does not;
    * decode tokens: fresh keys with the locality boost (a new token is recent); values are ``N(0, 1)``;
    * ``query_drift`` (radians per decode step, 0 by default): the decode query turns from the base query
      towards a second random one (and the indexer's direction towards a second one), so what a request
      attends to drifts step by step (the offload bench's drifting workload).

    **Hidden states for the DSA indexer** (``indexer_config``, small by default). DSA's indexer reads
    the hidden states ``x`` and the query latent ``q_lora``, not Q/K. We build them backwards from the
    indexer's own weights (``indexer(layer, ...)`` makes the same weights every time): ``x`` solves
    ``[wk; weights_proj] x = [z; 1]``, where ``z`` is the key before its LayerNorm, ``noise + boost * d``
    with one direction ``d`` per request and layer, and ``q_lora`` solves ``wq_b q_lora = d`` for every
    head (plus noise). ``d`` is zero on the RoPE dims, so positions do not blur it. So the indexer sees
    the same needles, sinks and locality as attention does, through its own projections.
    """

    num_layers: int = 2
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    num_needles: int = 4
    num_head_needles: int = 0
    needle_strength: float = 3.0
    num_sink_tokens: int = 4
    sink_strength: float = 1.0
    local_window: int = 32
    local_strength: float = 1.0
    query_noise: float = 0.3
    query_drift: float = 0.0
    indexer_config: object = None  # IndexerConfig; default: a small one (see __post_init__)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name), low=1, error=SparseRefError)
        check_float("query_drift", self.query_drift, low=0.0, high=math.pi, error=SparseRefError,
                    fix="radians per decode step in [0, pi]; 0 keeps each request's query steady.")
        if self.num_q_heads % self.num_kv_heads:
            raise SparseRefError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads "
                                 f"{self.num_kv_heads}.")
        if self.indexer_config is None:
            self.indexer_config = IndexerConfig(hidden_size=64, q_lora_rank=128, n_heads=4, head_dim=32,
                                                rope_dim=8, index_topk=256)
        self._indexer_solvers: dict[int, tuple] = {}
        self._prefill_memo: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ requests
    def request(self, key: int, prompt_len: int, needle_depths: Sequence[float] | None = None) -> PlantedRequest:
        """Plan request ``key`` of ``prompt_len`` tokens. ``needle_depths`` in [0, 1) place the needles by hand."""
        prompt_len = check_int("prompt_len", prompt_len, low=max(1, self.num_head_needles), error=SparseRefError,
                               fix=f"this workload plants {self.num_head_needles} head needles, one token each: give "
                               "the prompt at least that many tokens, or build it with fewer num_head_needles.")
        gen = torch.Generator().manual_seed(_mixed_seed(self.seed, key, 1))
        if needle_depths is not None:
            for d in needle_depths:
                check_float("needle_depths", d, low=0.0, high=1.0, fix="depths are fractions of the prompt in [0, 1).",
                            error=SparseRefError)
            needles = sorted({min(int(d * prompt_len), prompt_len - 1) for d in needle_depths})
        else:
            needles = sorted(torch.randperm(prompt_len, generator=gen)[: self.num_needles].tolist())
        heads = torch.randint(0, self.num_q_heads, (self.num_head_needles,), generator=gen).tolist()
        spots = torch.randperm(prompt_len, generator=gen)[: self.num_head_needles].tolist()
        return PlantedRequest(key, prompt_len, needles, sorted(zip(spots, heads, strict=True)))

    def _base_query(self, req: PlantedRequest, layer: int):
        """``(q [H_q, D], u [H_kv, D], own [H_q, D])``: base query, unit group mean, unit own direction."""
        gen = torch.Generator().manual_seed(_mixed_seed(self.seed, req.key, layer, 2))
        q = torch.randn(self.num_q_heads, self.head_dim, generator=gen)
        group = self.num_q_heads // self.num_kv_heads
        qbar = q.reshape(self.num_kv_heads, group, self.head_dim).mean(1)
        own = q - qbar.repeat_interleave(group, 0)
        unit = lambda v: v / v.norm(dim=-1, keepdim=True).clamp(min=1e-6)  # noqa: E731
        return q, unit(qbar), unit(own)

    def _boost(self, req: PlantedRequest, length: int) -> torch.Tensor:
        """Planted alignment of tokens ``0 .. length-1`` (needles, sinks, locality to the prompt end)."""
        boost = torch.zeros(length)
        boost[: min(self.num_sink_tokens, length)] = self.sink_strength
        dist = (req.prompt_len - 1 - torch.arange(length)).clamp(min=0).float()
        boost += self.local_strength * torch.exp(-dist / max(self.local_window, 1)) * (dist < 4 * self.local_window)
        for pos in req.needles:
            if pos < length:
                boost[pos] += self.needle_strength * math.sqrt(self.head_dim)
        return boost

    def _keys(self, req: PlantedRequest, layer: int, positions: torch.Tensor, boost: torch.Tensor, gen):
        _, u, own = self._base_query(req, layer)
        group = self.num_q_heads // self.num_kv_heads
        keys = torch.randn(len(positions), self.num_kv_heads, self.head_dim, generator=gen)
        keys = keys + boost[:, None, None] * u[None]
        for pos, head in req.head_needles:
            hit = (positions == pos).nonzero().flatten()
            if hit.numel():
                keys[hit, head // group] += self.needle_strength * math.sqrt(self.head_dim) * own[head]
        return keys

    def prefill(self, req: PlantedRequest, layer: int, with_hidden: bool = True):
        """``(k, v [prompt_len, H_kv, D], x [prompt_len, hidden_size] or None)`` of the prompt (CPU, fp32).

        Memoised per (request key, prompt length, layer): sweeps re-run the same prompts many times.
        """
        memo = (req.key, req.prompt_len, layer)
        if memo not in self._prefill_memo:
            gen = torch.Generator().manual_seed(_mixed_seed(self.seed, req.key, layer, 3))
            boost = self._boost(req, req.prompt_len)
            keys = self._keys(req, layer, torch.arange(req.prompt_len), boost, gen)
            values = torch.randn(req.prompt_len, self.num_kv_heads, self.head_dim, generator=gen)
            self._prefill_memo[memo] = (keys, values, boost, gen.get_state())
        keys, values, boost, state = self._prefill_memo[memo]
        if not with_hidden:
            return keys, values, None
        gen = torch.Generator()
        gen.set_state(state)
        return keys, values, self._hidden(req, layer, self._index_boost(req, boost), gen)

    def decode(self, req: PlantedRequest, layer: int, position: int, with_hidden: bool = True):
        """``(q [H_q, D], k, v [1, H_kv, D], x [1, hidden], q_lora [1, q_lora_rank])`` of decode token ``position``.

        ``with_hidden=False`` skips the indexer's inputs (``x`` and ``q_lora`` are then None).
        """
        gen = torch.Generator().manual_seed(_mixed_seed(self.seed, req.key, layer, 4, position))
        base, _, _ = self._base_query(req, layer)
        angle = self.query_drift * max(position - req.prompt_len, 0)
        if angle:  # drift: towards a second query of the same scale, as a rotation
            other = torch.randn(base.shape, generator=torch.Generator().manual_seed(
                _mixed_seed(self.seed, req.key, layer, 7)))
            base = math.cos(angle) * base + math.sin(angle) * other * base.norm(dim=-1, keepdim=True) / other.norm(
                dim=-1, keepdim=True)
        q = base + self.query_noise * torch.randn(base.shape, generator=gen)
        boost = torch.full((1,), self.local_strength)
        keys = self._keys(req, layer, torch.tensor([position]), boost, gen)
        values = torch.randn(1, self.num_kv_heads, self.head_dim, generator=gen)
        if not with_hidden:
            return q, keys, values, None, None
        return q, keys, values, self._hidden(req, layer, boost, gen), self._q_lora(req, layer, gen, angle)

    def _index_boost(self, req: PlantedRequest, boost: torch.Tensor) -> torch.Tensor:
        """What the indexer sees: attention's boosts, with the head needles as ordinary needles.

        A trained indexer predicts where *any* head attends, so a needle of one head is a needle to it.
        """
        boost = boost.clone()
        for pos, _ in req.head_needles:
            boost[pos] += self.needle_strength * math.sqrt(self.head_dim)
        return boost

    # ------------------------------------------------------------------ the DSA indexer's inputs
    def indexer(self, layer: int, index_topk: int | None = None, device="cpu", backend: str = "auto"):
        """The layer's ``LightningIndexer`` (same weights for every call), keeping ``index_topk`` tokens."""
        import dataclasses

        from sparse_ref.algorithms.dsa import LightningIndexer

        cfg = self.indexer_config
        if index_topk is not None:
            cfg = dataclasses.replace(cfg, index_topk=index_topk)
        return LightningIndexer(cfg, seed=_mixed_seed(self.seed, layer, 5) % (1 << 31), device=device, backend=backend)

    def _solvers(self, layer: int):
        """Pseudo-inverses of ``[wk; weights_proj]`` and ``wq_b`` of the layer's indexer (cached)."""
        if layer not in self._indexer_solvers:
            idx = self.indexer(layer)
            stacked = torch.cat([idx.wk.weight, idx.weights_proj.weight]).detach().double()
            self._indexer_solvers[layer] = (torch.linalg.pinv(stacked), torch.linalg.pinv(idx.wq_b.weight.detach()
                                                                                          .double()))
        return self._indexer_solvers[layer]

    def _direction(self, req: PlantedRequest, layer: int, tag: int = 6) -> torch.Tensor:
        """The request's indexer direction ``d``: unit, zero on the RoPE dims and zero-mean (LayerNorm keeps it)."""
        c = self.indexer_config
        gen = torch.Generator().manual_seed(_mixed_seed(self.seed, req.key, layer, tag))
        d = torch.zeros(c.head_dim, dtype=torch.float64)
        d[c.rope_dim:] = torch.randn(c.head_dim - c.rope_dim, generator=gen, dtype=torch.float64)
        d[c.rope_dim:] -= d[c.rope_dim:].mean()
        return d / d.norm()

    def _hidden(self, req: PlantedRequest, layer: int, boost: torch.Tensor, gen) -> torch.Tensor:
        c = self.indexer_config
        z = torch.randn(len(boost), c.head_dim, generator=gen, dtype=torch.float64)
        z += (boost.double() / math.sqrt(self.head_dim) * math.sqrt(c.head_dim))[:, None] * self._direction(req, layer)
        target = torch.cat([z, torch.ones(len(boost), c.n_heads, dtype=torch.float64)], dim=1)
        return (target @ self._solvers(layer)[0].T).float()

    def _q_lora(self, req: PlantedRequest, layer: int, gen, angle: float = 0.0) -> torch.Tensor:
        c = self.indexer_config
        d = self._direction(req, layer)
        if angle:  # drift: the direction turns towards a second one
            d = math.cos(angle) * d + math.sin(angle) * self._direction(req, layer, tag=8)
            d = d / d.norm()
        q = d[None, :] * math.sqrt(c.head_dim) * 2.0
        q = q + 0.5 * torch.randn(c.n_heads, c.head_dim, generator=gen, dtype=torch.float64)
        return (q.reshape(1, -1) @ self._solvers(layer)[1].T).float()


# ----------------------------------------------------------------------------- score rows for top-k
# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------
DISTRIBUTIONS = ("randn", "indexer", "sorted", "plateau", "clustered", "integers")


def make_distribution(name: str, R: int, N: int, device, seed: int = 0) -> torch.Tensor:
    """fp32 scores [R, N] of the named distribution: the score rows that make top-k easy or hard (benchmarks,
    notebook 05). ``randn``; ``indexer`` (ReLU-weighted sums like indexer logits, through bf16: many ties);
    ``sorted`` (ascending: every winner at the end); ``plateau`` (a third of each row tied at the top value);
    ``clustered`` (a few values plus tiny noise); ``integers`` (whole numbers 0..63: every value a long run of
    ties)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if name == "randn":
        x = torch.randn(R, N, generator=g)
    elif name == "indexer":
        heads, dim = 8, 16
        q = torch.randn(R, heads, dim, generator=g)
        w = torch.rand(R, heads, generator=g)
        x = torch.zeros(R, N)
        for start in range(0, N, 16384):  # ReLU-weighted sum over heads of q.k, blockwise to bound memory
            k = torch.randn(min(16384, N - start), dim, generator=g)
            logits = torch.relu(torch.einsum("rhd,nd->rhn", q, k))
            x[:, start:start + k.shape[0]] = torch.einsum("rh,rhn->rn", w, logits)
        x = x.bfloat16().float()  # indexer logits are low precision: many exact and near ties
    elif name == "sorted":  # ascending rows: every winner sits at the end (defeats block-wise filters)
        x = torch.sort(torch.randn(R, N, generator=g), dim=1).values
    elif name == "plateau":  # a third of each row ties at the top value (defeats thresholds: long tie runs)
        x = torch.randn(R, N, generator=g).clamp(max=1.0)
        x[:, ::3] = 1.5
    elif name == "clustered":
        centers = torch.randn(8, generator=g) * 4
        x = centers[torch.randint(0, 8, (R, N), generator=g)] + 1e-4 * torch.randn(R, N, generator=g)
        x = x.bfloat16().float()
    elif name == "integers":  # 64 distinct values: the k-th sits inside a run of ~N/64 ties
        x = torch.randint(0, 64, (R, N), generator=g).float()
    else:
        raise ValueError(f"unknown distribution {name!r}; known: {DISTRIBUTIONS}")
    return x.to(device)

