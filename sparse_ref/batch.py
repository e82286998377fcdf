"""``ForwardMode`` and ``ForwardBatch``: what one forward pass knows about its requests.

``req_pool_indices`` int64 ``[bs]`` (each request's req_to_token row); ``seq_lens`` int64 ``[bs]`` (tokens
*including* the new ones: in DECODE, the token being decoded); ``positions`` and ``out_cache_loc`` int64
``[T]`` (logical position and physical slot of every new token); ``extend_prefix_lens`` and
``extend_seq_lens`` (EXTEND only: tokens cached before this pass, tokens new in it).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparse_ref import checks
from sparse_ref.memory import KVCacheManager, Request


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly a chunk after a cached prefix
    DECODE = "decode"  # one new token per request

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    def __post_init__(self) -> None:
        checks.check_forward_batch(self)  # every field once: types, one device, shapes, ranges, the mode's rules


def build_extend_batch(manager: KVCacheManager, requests: Sequence[Request],
                       prefix_lens: Sequence[int] | None = None) -> ForwardBatch:
    """EXTEND batch over tokens ``[prefix_len, seq_len)`` of each admitted request.

    ``prefix_lens`` (default all 0) are tokens already in the cache, e.g. from an
    earlier chunk of a chunked prefill.
    """
    prefix_lens = checks.check_extend_batch(manager, requests, prefix_lens)
    positions, locs = [], []
    for r, p in zip(requests, prefix_lens, strict=True):
        pos = torch.arange(p, r.seq_len, dtype=torch.int64)
        positions.append(pos)
        row = manager.req_to_token_pool.req_to_token[r.req_pool_idx]
        locs.append(row[pos.to(row.device)].to(torch.int64))
    device = manager.req_to_token_pool.device
    seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int64, device=device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        req_pool_indices=torch.tensor([r.req_pool_idx for r in requests], dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        positions=torch.cat(positions).to(device),
        out_cache_loc=torch.cat(locs).to(device),
        extend_prefix_lens=prefix,
        extend_seq_lens=seq_lens - prefix,
    )


def build_decode_batch(manager: KVCacheManager, requests: Sequence[Request]) -> ForwardBatch:
    """DECODE batch: the last token of each request is the one being decoded.

    Call ``manager.grow(req, 1)`` first (or use ``decode_step``), so that the new
    token has a slot and ``seq_len`` counts it.
    """
    checks.check_decode_batch(manager, requests)
    device = manager.req_to_token_pool.device
    seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int64, device=device)
    idx = torch.tensor([r.req_pool_idx for r in requests], dtype=torch.int64, device=device)
    positions = seq_lens - 1
    out_cache_loc = manager.req_to_token_pool.req_to_token[idx, positions].to(torch.int64)
    return ForwardBatch(ForwardMode.DECODE, idx, seq_lens, positions, out_cache_loc)


def decode_step(manager: KVCacheManager, requests: Sequence[Request]) -> ForwardBatch:
    """Grow every request by one token, then build the DECODE batch for it.

    All or nothing: if the requests together need more pages than are free, PoolError is
    raised before any request grows.
    """
    checks.check_decode_step(manager, requests)  # (also: room for every request, so no request grows alone)
    for r in requests:
        manager.grow(r, 1)
    return build_decode_batch(manager, requests)
