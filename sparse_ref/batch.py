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

from sparse_ref.checks import (
    INT64_MAX,
    capturing,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.errors import BatchError
from sparse_ref.memory import KVCacheManager, Request

EXTEND_FIELDS = ("extend_prefix_lens", "extend_seq_lens")
_FIX_BUILD = "build the batch with build_extend_batch / build_decode_batch."


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
        """Every field checked once, at construction: types, one device, shapes, ranges, the mode's rules."""
        mode = self.forward_mode
        if not isinstance(mode, ForwardMode):
            fail("ForwardBatch.forward_mode", "ForwardMode.EXTEND or ForwardMode.DECODE", repr(mode), error=BatchError)
        extend = mode is ForwardMode.EXTEND
        names = ("req_pool_indices", "seq_lens", "positions", "out_cache_loc")
        fields = {f"ForwardBatch.{n}": getattr(self, n) for n in names + EXTEND_FIELDS * extend}
        for name, t in fields.items():
            check_tensor(name, t, dtype=torch.int64, dims=1, error=BatchError, fix=_FIX_BUILD)
        check_same_device("ForwardBatch", "ForwardBatch.req_pool_indices", fields, BatchError)
        bs, new_tokens = self.batch_size, self.positions.shape[0]
        for name, t in fields.items():
            per_token = name.endswith(("positions", "out_cache_loc"))
            if extend or not per_token:
                check_rows(name, t, new_tokens if per_token else bs, "one per new token" if per_token else
                           "one per request", BatchError)
            else:
                check_rows(name, t, bs, "DECODE: one new token per request", BatchError)
            check_range(name, t, 0, INT64_MAX, "ids, lengths and slots are >= 0.", BatchError)
        if capturing():
            return
        if not extend and not torch.equal(self.positions, self.seq_lens - 1):
            fail("ForwardBatch.positions", f"seq_lens - 1 = {(self.seq_lens - 1).tolist()} (DECODE: the token being "
                 "decoded is the last one of its request)", str(self.positions.tolist()), _FIX_BUILD, BatchError)
        if extend and not torch.equal(self.extend_prefix_lens + self.extend_seq_lens, self.seq_lens):
            fail("ForwardBatch.extend_seq_lens", f"seq_lens {self.seq_lens.tolist()} - extend_prefix_lens "
                 f"{self.extend_prefix_lens.tolist()}", str(self.extend_seq_lens.tolist()), _FIX_BUILD, BatchError)
        if extend and int(self.extend_seq_lens.sum()) != new_tokens:
            fail("ForwardBatch.extend_seq_lens", f"a sum of {new_tokens} (the new tokens of positions)",
                 f"a sum of {int(self.extend_seq_lens.sum())}", _FIX_BUILD, BatchError)


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
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
        fail("requests", "a list or tuple of Request objects from manager.admit", describe(requests), error=BatchError)
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
    if prefix_lens is not None and not isinstance(prefix_lens, (list, tuple, torch.Tensor)) or \
            isinstance(prefix_lens, torch.Tensor) and prefix_lens.dim() != 1:
        fail("prefix_lens", "a sequence of ints, one per request", describe(prefix_lens), error=BatchError)
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
