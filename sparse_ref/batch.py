"""``ForwardMode`` and ``ForwardBatch``: what one forward pass knows about its requests.

Shapes (``bs`` requests, ``T`` new tokens in the batch):

* ``req_pool_indices`` int64 ``[bs]``: each request's row in req_to_token;
* ``seq_lens`` int64 ``[bs]``: tokens per request *including* the new ones (in
  DECODE, including the token being decoded);
* ``positions``, ``out_cache_loc`` int64 ``[T]``: logical position and physical KV
  slot of every new token, request after request;
* ``extend_prefix_lens``, ``extend_seq_lens`` int64 ``[bs]`` (EXTEND only): tokens
  already cached before this pass, and tokens new in it.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparse_ref.checks import INT64_MAX, capturing, check_range, describe, fail
from sparse_ref.errors import BatchError
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
        if not isinstance(self.forward_mode, ForwardMode):
            raise BatchError(
                f"ForwardBatch.forward_mode: expected ForwardMode.EXTEND or ForwardMode.DECODE, got "
                f"{self.forward_mode!r}."
            )
        names = ["req_pool_indices", "seq_lens", "positions", "out_cache_loc"]
        names += [n for n in ("extend_prefix_lens", "extend_seq_lens") if getattr(self, n) is not None]
        for name in names:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                raise BatchError(f"ForwardBatch.{name}: expected a 1-D int64 tensor, got {got}.")
            if t.device != self.req_pool_indices.device:
                raise BatchError(
                    f"ForwardBatch.{name}: on {t.device}, but req_pool_indices is on "
                    f"{self.req_pool_indices.device}; every field must live on one device."
                )
            if t.device.type == "meta":
                fail(f"ForwardBatch.{name}", "a tensor with data (cpu or cuda)", "a meta tensor", error=BatchError)
        bs = self.req_pool_indices.shape[0]
        if self.seq_lens.shape[0] != bs:
            raise BatchError(f"ForwardBatch: seq_lens has {self.seq_lens.shape[0]} entries, req_pool_indices {bs}.")
        if self.positions.shape != self.out_cache_loc.shape:
            raise BatchError(
                f"ForwardBatch: positions {tuple(self.positions.shape)} and out_cache_loc "
                f"{tuple(self.out_cache_loc.shape)} must have one entry per new token each."
            )
        if self.forward_mode is ForwardMode.DECODE and self.positions.shape[0] != bs:
            raise BatchError(f"ForwardBatch (DECODE): expected one new token per request ({bs}), "
                             f"got {self.positions.shape[0]}.")
        for name in ("req_pool_indices", "seq_lens", "positions", "extend_prefix_lens", "extend_seq_lens"):
            if getattr(self, name) is not None:
                check_range(f"ForwardBatch.{name}", getattr(self, name), 0, INT64_MAX, "ids and lengths are >= 0.",
                            BatchError)
        if self.forward_mode is ForwardMode.DECODE and not capturing() and \
                not torch.equal(self.positions, self.seq_lens - 1):
            fail("ForwardBatch.positions", f"seq_lens - 1 = {(self.seq_lens - 1).tolist()} (DECODE: the token being "
                 "decoded is the last one of its request)", str(self.positions.tolist()),
                 "build the batch with build_decode_batch or decode_step.", BatchError)
        if self.forward_mode is ForwardMode.EXTEND:
            if self.extend_prefix_lens is None or self.extend_seq_lens is None:
                raise BatchError("ForwardBatch (EXTEND): extend_prefix_lens and extend_seq_lens are required.")
            for name in ("extend_prefix_lens", "extend_seq_lens"):
                if getattr(self, name).shape[0] != bs:
                    raise BatchError(
                        f"ForwardBatch (EXTEND): {name} has {getattr(self, name).shape[0]} entries, "
                        f"expected one per request ({bs})."
                    )
            if not torch.equal(self.extend_prefix_lens + self.extend_seq_lens, self.seq_lens):
                raise BatchError(
                    f"ForwardBatch (EXTEND): extend_prefix_lens {self.extend_prefix_lens.tolist()} + "
                    f"extend_seq_lens {self.extend_seq_lens.tolist()} must equal seq_lens {self.seq_lens.tolist()}."
                )
            if int(self.extend_seq_lens.sum()) != self.positions.shape[0]:
                raise BatchError(
                    f"ForwardBatch (EXTEND): extend_seq_lens sums to {int(self.extend_seq_lens.sum())} "
                    f"but there are {self.positions.shape[0]} new tokens."
                )


def _int_or_none(value) -> int | None:
    """``value`` as an int (numpy/torch integer scalars too), or None for floats, bools and the rest."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _requests_checked(manager: KVCacheManager, requests: Sequence[Request]) -> None:
    if not isinstance(manager, KVCacheManager):
        fail("manager", "a KVCacheManager", describe(manager), error=BatchError)
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__") or \
            not all(isinstance(r, Request) for r in requests):
        fail("requests", "a sequence of Request objects from manager.admit", describe(requests), error=BatchError)
    if len(requests) == 0:
        raise BatchError("a batch needs at least one request, got none.")
    seen = set()
    for r in requests:
        if r.released:
            raise BatchError(f"request {r.rid} was released and cannot be batched.")
        if manager.requests.get(r.rid) is not r:
            raise BatchError(f"request {r.rid} was not admitted by this KVCacheManager; batch it with its own.")
        if r.rid in seen:
            raise BatchError(f"request {r.rid} appears twice in the batch; each request may appear once.")
        seen.add(r.rid)


def build_extend_batch(manager: KVCacheManager, requests: Sequence[Request],
                       prefix_lens: Sequence[int] | None = None) -> ForwardBatch:
    """EXTEND batch over tokens ``[prefix_len, seq_len)`` of each admitted request.

    ``prefix_lens`` (default all 0) are tokens already in the cache, e.g. from an
    earlier chunk of a chunked prefill.
    """
    _requests_checked(manager, requests)
    prefix_lens = [0] * len(requests) if prefix_lens is None else list(prefix_lens)
    if len(prefix_lens) != len(requests):
        raise BatchError(f"prefix_lens has {len(prefix_lens)} entries for {len(requests)} requests.")
    positions, locs = [], []
    for i, (r, given) in enumerate(zip(requests, prefix_lens, strict=True)):
        p = _int_or_none(given)
        if p is None or not 0 <= p <= r.seq_len:
            raise BatchError(
                f"prefix_lens[{i}]: expected an int in [0, seq_len={r.seq_len}] for request {r.rid}, "
                f"got {given!r}."
            )
        prefix_lens[i] = p
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
    _requests_checked(manager, requests)
    for r in requests:
        if r.seq_len < 1:
            raise BatchError(f"request {r.rid} has seq_len 0; grow it by one token before decoding.")
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
    _requests_checked(manager, requests)
    need = sum(manager.pages_needed(r, 1) for r in requests)
    for r in requests:
        manager._check_fits(r.seq_len + 1)
    if need > manager.allocator.available_pages():
        manager.allocator.alloc(need)  # raises the allocator's exhaustion error, taking nothing
    for r in requests:
        manager.grow(r, 1)
    return build_decode_batch(manager, requests)
