"""``ForwardMode`` and ``ForwardBatch``: what one forward pass knows about its requests.

``req_pool_indices`` int64 ``[bs]`` (each request's req_to_token row); ``seq_lens`` int64 ``[bs]`` (tokens
*including* the new ones: in DECODE, the token being decoded); ``positions`` and ``out_cache_loc`` int64
``[T]`` (logical position and physical slot of every new token); ``extend_prefix_lens`` and
``extend_seq_lens`` (EXTEND only: tokens cached before this pass, tokens new in it).
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparse_ref.checks import (
    INT64_MAX,
    check_int,
    check_new_token_slots,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
    skip_value_checks,
    values_checked,
)
from sparse_ref.errors import BatchError
from sparse_ref.memory import KVCacheManager, Request, check_fits, check_page_alloc


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
    # Set by the builders: the manager, its generation, the requests the batch was built from and its tensors'
    # identities and versions. While none of them moved, the batch holds exactly those requests' values, so a
    # caller can trust them without reading them back from the device (the engine's decode step does).
    built_from: tuple | None = field(default=None, repr=False, compare=False)

    def stamp(self, manager: KVCacheManager, requests: Sequence[Request]) -> ForwardBatch:
        """Record that this batch holds ``requests`` of ``manager`` as they are now (the builders call it)."""
        self.built_from = (manager, manager.generation, tuple(requests), self._fingerprint())
        return self

    def _fingerprint(self) -> tuple:
        """Each field's tensor and its in-place version counter: a swapped field or an in-place edit changes it."""
        return tuple((id(t), t._version) for t in (self.req_pool_indices, self.seq_lens, self.positions,
                                                    self.out_cache_loc))

    def is_current(self, manager: KVCacheManager, requests: Sequence[Request]) -> bool:
        """Built by ``build_*_batch`` / ``decode_step`` from ``manager`` for exactly ``requests``, no request
        admitted, grown or released since, and no field replaced or edited in place (host-side: reads no device
        value)."""
        if self.built_from is None:
            return False
        by, generation, built, fingerprint = self.built_from
        return by is manager and generation == manager.generation and len(built) == len(requests) and all(
            a is b for a, b in zip(built, requests, strict=True)) and fingerprint == self._fingerprint()

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    def __post_init__(self) -> None:
        check_forward_batch(self)  # every field once: types, one device, shapes, ranges, the mode's rules


def build_extend_batch(manager: KVCacheManager, requests: Sequence[Request],
                       prefix_lens: Sequence[int] | None = None) -> ForwardBatch:
    """EXTEND batch over tokens ``[prefix_len, seq_len)`` of each admitted request.

    ``prefix_lens`` (default all 0) are tokens already in the cache, e.g. from an
    earlier chunk of a chunked prefill.
    """
    prefix_lens = check_extend_batch(manager, requests, prefix_lens)
    positions, locs = [], []
    for r, p in zip(requests, prefix_lens, strict=True):
        pos = torch.arange(p, r.seq_len, dtype=torch.int64)
        positions.append(pos)
        row = manager.req_to_token_pool.req_to_token[r.req_pool_idx]
        locs.append(row[pos.to(row.device)].to(torch.int64))
    device = manager.req_to_token_pool.device
    seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int64, device=device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    with values_checked():  # built from checked host values: the batch check reads nothing back
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in requests], dtype=torch.int64, device=device),
            seq_lens=seq_lens,
            positions=torch.cat(positions).to(device),
            out_cache_loc=torch.cat(locs).to(device),
            extend_prefix_lens=prefix,
            extend_seq_lens=seq_lens - prefix,
        ).stamp(manager, requests)


def build_decode_batch(manager: KVCacheManager, requests: Sequence[Request]) -> ForwardBatch:
    """DECODE batch: the last token of each request is the one being decoded.

    Call ``manager.grow(req, 1)`` first (or use ``decode_step``), so that the new
    token has a slot and ``seq_len`` counts it.
    """
    check_decode_batch(manager, requests)
    device = manager.req_to_token_pool.device
    seq_lens = torch.tensor([r.seq_len for r in requests], dtype=torch.int64, device=device)
    idx = torch.tensor([r.req_pool_idx for r in requests], dtype=torch.int64, device=device)
    positions = seq_lens - 1
    out_cache_loc = manager.req_to_token_pool.req_to_token[idx, positions].to(torch.int64)
    with values_checked():  # built from checked host values: the batch check reads nothing back
        return ForwardBatch(ForwardMode.DECODE, idx, seq_lens, positions, out_cache_loc).stamp(manager, requests)


def decode_step(manager: KVCacheManager, requests: Sequence[Request]) -> ForwardBatch:
    """Grow every request by one token, then build the DECODE batch for it.

    All or nothing: if the requests together need more pages than are free, PoolError is
    raised before any request grows.
    """
    check_decode_step(manager, requests)  # (also: room for every request, so no request grows alone)
    for r in requests:
        manager.grow(r, 1)
    return build_decode_batch(manager, requests)


# ------------------------------ argument checks (each entry point above calls one first)
EXTEND_FIELDS = ("extend_prefix_lens", "extend_seq_lens")
_FIX_BUILD = "build the batch with build_extend_batch / build_decode_batch."


def check_forward_batch(fb) -> None:
    """Every field of a ``ForwardBatch`` once: types, one device, shapes, ranges, the mode's rules."""
    mode = fb.forward_mode
    if not isinstance(mode, ForwardMode):
        fail("ForwardBatch.forward_mode", "ForwardMode.EXTEND or ForwardMode.DECODE", repr(mode), error=BatchError)
    extend = mode is ForwardMode.EXTEND
    names = ("req_pool_indices", "seq_lens", "positions", "out_cache_loc")
    fields = {f"ForwardBatch.{n}": getattr(fb, n) for n in names + EXTEND_FIELDS * extend}
    for name, t in fields.items():
        check_tensor(name, t, dtype=torch.int64, dims=1, error=BatchError, fix=_FIX_BUILD)
    check_same_device("ForwardBatch", "ForwardBatch.req_pool_indices", fields, BatchError)
    bs, new_tokens = fb.batch_size, fb.positions.shape[0]
    for name, t in fields.items():
        per_token = name.endswith(("positions", "out_cache_loc"))
        if extend or not per_token:
            check_rows(name, t, new_tokens if per_token else bs, "one per new token" if per_token else
                       "one per request", BatchError)
        else:
            check_rows(name, t, bs, "DECODE: one new token per request", BatchError)
        check_range(name, t, 0, INT64_MAX, "ids, lengths and slots are >= 0.", BatchError)
    if skip_value_checks():
        return
    if not extend and not torch.equal(fb.positions, fb.seq_lens - 1):
        fail("ForwardBatch.positions", f"seq_lens - 1 = {(fb.seq_lens - 1).tolist()} (DECODE: the token being "
             "decoded is the last one of its request)", str(fb.positions.tolist()), _FIX_BUILD, BatchError)
    if extend and not torch.equal(fb.extend_prefix_lens + fb.extend_seq_lens, fb.seq_lens):
        fail("ForwardBatch.extend_seq_lens", f"seq_lens {fb.seq_lens.tolist()} - extend_prefix_lens "
             f"{fb.extend_prefix_lens.tolist()}", str(fb.extend_seq_lens.tolist()), _FIX_BUILD, BatchError)
    if extend and int(fb.extend_seq_lens.sum()) != new_tokens:
        fail("ForwardBatch.extend_seq_lens", f"a sum of {new_tokens} (the new tokens of positions)",
             f"a sum of {int(fb.extend_seq_lens.sum())}", _FIX_BUILD, BatchError)
    if bs and fb.req_pool_indices.unique().numel() != bs:
        fail("ForwardBatch.req_pool_indices", "each request's row once", str(fb.req_pool_indices.tolist()),
             "batch each request once.", BatchError)
    if extend and new_tokens:  # each request's new tokens are positions prefix .. seq_len - 1, in order
        starts = torch.repeat_interleave(fb.extend_prefix_lens, fb.extend_seq_lens, output_size=new_tokens)
        firsts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
        offsets = torch.arange(new_tokens, device=fb.positions.device) - torch.repeat_interleave(
            firsts, fb.extend_seq_lens, output_size=new_tokens)
        if not torch.equal(fb.positions, starts + offsets):
            fail("ForwardBatch.positions", "each request's positions extend_prefix_len .. seq_len - 1, in order",
                 str(fb.positions.tolist()[:16]), _FIX_BUILD, BatchError)


def check_requests(manager, requests) -> None:
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


def check_extend_batch(manager, requests, prefix_lens) -> list[int]:
    """The requests of an EXTEND batch, and each one's prefix as an int in ``[0, seq_len]`` (default 0)."""
    check_requests(manager, requests)
    if prefix_lens is not None and not isinstance(prefix_lens, (list, tuple, torch.Tensor)) or \
            isinstance(prefix_lens, torch.Tensor) and prefix_lens.dim() != 1:
        fail("prefix_lens", "a sequence of ints, one per request", describe(prefix_lens), error=BatchError)
    prefix_lens = [0] * len(requests) if prefix_lens is None else list(prefix_lens)
    if len(prefix_lens) != len(requests):
        raise BatchError(f"prefix_lens has {len(prefix_lens)} entries for {len(requests)} requests.")
    return [check_int(f"prefix_lens[{i}]", given, low=0, high=r.seq_len, error=BatchError,
                      fix=f"a prefix within request {r.rid}'s seq_len={r.seq_len}.")
            for i, (r, given) in enumerate(zip(requests, prefix_lens, strict=True))]


def check_decode_batch(manager, requests) -> None:
    check_requests(manager, requests)
    for r in requests:
        if r.seq_len < 1:
            raise BatchError(f"request {r.rid} has seq_len 0; grow it by one token before decoding.")


def check_decode_step(manager, requests) -> None:
    """The requests, and room for each to grow by one token: else PoolError before any request grows."""
    check_requests(manager, requests)
    need = sum(manager.pages_needed(r, 1) for r in requests)
    for r in requests:
        check_fits(manager, r.seq_len + 1)
    check_page_alloc(manager.allocator, need)


def check_batch_slots(req_to_token, fb, batch: str = "forward_batch.", error=BatchError) -> None:
    """Eager: every new token's ``out_cache_loc`` is the slot req_to_token keeps for it (its request reads it)."""
    if skip_value_checks() or fb.positions.numel() == 0:
        return
    counts = fb.extend_seq_lens if fb.forward_mode is ForwardMode.EXTEND else torch.ones_like(fb.seq_lens)
    rows = torch.repeat_interleave(fb.req_pool_indices.to(req_to_token.device), counts.to(req_to_token.device))
    check_new_token_slots(req_to_token, rows, fb.positions, fb.out_cache_loc, batch, error)
