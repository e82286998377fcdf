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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparse_ref.batch import ForwardBatch, build_decode_batch, build_extend_batch
from sparse_ref.config import SparseConfig
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
                            selection_backend: str = "auto", scoring_backend: str = "auto") -> QuestDecodeSetup:
    """A Quest decode step at ``bs`` requests of ``ctx`` tokens (the benchmark recipe).

    Example (H200): ``s = make_quest_decode_setup(64, 32768, 16, device="cuda")``, then time
    ``s.retrieve()`` against ``s.retrieve(loop=True)``. ``selection_backend`` and ``scoring_backend``
    go to ``QuestAlgorithm`` ("auto": Triton on CUDA, torch otherwise).
    """
    from sparse_ref.algorithms.quest import QuestAlgorithm  # workloads must not need algorithms to import

    pages = ceil_div(ctx, page_size)
    workload = make_planted_workload([ctx] * bs, page_size=page_size, num_q_heads=num_q_heads,
                                     num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     interleave_pages=max(1, pages // 32), dtype=dtype, device=device, seed=seed)
    algorithm = QuestAlgorithm(config, device, selection_backend=selection_backend,
                               scoring_backend=scoring_backend)
    workload.attach(algorithm)
    fb = workload.forward_batch
    sparse_mask = torch.ones(bs, dtype=torch.bool, device=fb.seq_lens.device)
    return QuestDecodeSetup(algorithm, workload.queries, fb, fb.req_pool_indices, sparse_mask, 0, workload)
