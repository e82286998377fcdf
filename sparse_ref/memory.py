"""The memory pools of a serving engine, and the bookkeeping that ties them together.

``ReqToTokenPool`` (request row -> logical position -> physical slot), ``PageAllocator`` (whole pages, page 0
reserved), ``TokenToKVPool`` (paged K/V per layer), ``KVCacheManager`` (admit, grow, release) and
``IndexerKeyCache`` (the DSA indexer's FP8 keys). Token ``t`` lives at slot ``pages[t // P] * P + t % P``. A
failed check changes nothing. The contract: ``docs/design.md`` section 3.1.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparse_ref.checks import (
    INDEX_DTYPES,
    INT32_MAX,
    check_device,
    check_fits_memory,
    check_index_list,
    check_int,
    check_kv_dtype,
    check_range,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.config import IndexerConfig
from sparse_ref.errors import BatchError, ConfigError, PoolError
from sparse_ref.fp8 import FP8_DTYPE


class _FreeList:
    """Ids ``[first, size)`` handed out lowest first; an id taken for an ``owner`` is freed only by naming it."""

    def __init__(self, what: str, first: int, size: int):
        self._what, self._first, self._size = what, first, size
        self._free = list(range(size - 1, first - 1, -1))  # pop() hands out first, first + 1, ...
        self._is_free = [i >= first for i in range(size)]
        self._owner: dict[int, object] = {}

    def _take(self, n: int, owner=None) -> list[int]:
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
            if owner is not None:
                self._owner[i] = owner
        return ids

    def _give_back(self, ids: list[int]) -> None:
        for i in ids:
            self._is_free[i] = True
            self._owner.pop(i, None)
            self._free.append(i)


class ReqToTokenPool(_FreeList):
    """``req_to_token``: int32 ``[size, max_context_len]``, one row per request slot."""

    def __init__(self, size: int, max_context_len: int, device="cpu"):
        size, max_context_len, self.device = check_req_to_token_pool(size, max_context_len, device)
        super().__init__("slot", 0, size)
        self.size, self.max_context_len = size, max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=self.device)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1, owner=None) -> list[int]:
        """Take ``n`` request slots (for ``owner``, if given); raises PoolError when fewer are free."""
        return self._take(check_slot_alloc(self, n), owner)

    def free(self, slots, owner=None) -> None:
        """Give request slots back; their rows are zeroed. A double free, or a slot taken for another owner (a
        live request's row), raises PoolError."""
        slots = check_free(self, "ReqToTokenPool.free(slots)", slots, owner)
        self._give_back(slots)
        for s in slots:
            self.req_to_token[s].zero_()


class PageAllocator(_FreeList):
    """Whole pages of the KV cache. Page 0 is reserved padding and is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = check_page_allocator(num_pages, page_size)
        super().__init__("page", 1, self.num_pages)
        self._free_listeners: list[Callable[[torch.Tensor], None]] = []

    def available_pages(self) -> int:
        return len(self._free)

    def add_free_listener(self, callback: Callable[[torch.Tensor], None]) -> None:
        """Call ``callback(pages)`` whenever pages are freed (Quest drops their bounds). Added once."""
        check_free_listener(callback)
        if callback not in self._free_listeners:
            self._free_listeners.append(callback)

    def alloc(self, n: int, owner=None) -> list[int]:
        """Take ``n`` whole pages (never page 0), for ``owner`` if given; raises PoolError when fewer are free."""
        return self._take(check_page_alloc(self, n), owner)

    def free(self, pages, owner=None) -> None:
        """Give whole pages back, all or nothing: checked, then every listener told, then freed (a listener that
        raises frees nothing, and must bear the retry). A page taken for an owner is freed only by naming it."""
        pages = check_free(self, "PageAllocator.free(pages)", pages, owner)
        freed = torch.tensor(pages, dtype=torch.int64)
        for callback in self._free_listeners:
            call_free_listener(callback, freed, pages)
        self._give_back(pages)


class TokenToKVPool:
    """Paged K/V per layer, ``[num_pages * page_size, H_kv, D]`` (slots ``0..P-1``: padding), and ``allocator``,
    its pages. ``host_layers``: layers kept in (pinned) host memory, as KV offload keeps them."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu", host_layers=()):
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages, self.page_size = num_pages, page_size
        self.num_layers, self.num_kv_heads, self.head_dim, self.device = check_kv_pool(
            num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device)
        self.dtype, self.host_layers = dtype, frozenset(host_layers)
        shape, pin = (num_pages * page_size, num_kv_heads, head_dim), torch.cuda.is_available()

        def buffer(layer):
            if layer in self.host_layers:
                return torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.k_buffer = [buffer(layer) for layer in range(num_layers)]
        self.v_buffer = [buffer(layer) for layer in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[check_pool_layer(self, layer)]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[check_pool_layer(self, layer)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, H_kv, D]`` into physical slots ``loc`` ``[n]``."""
        layer = check_set_kv(self, layer, loc, k, v)
        on = self.k_buffer[layer].device  # a host layer: through the host (a sync on a GPU)
        self.k_buffer[layer][loc.to(on).long()] = k.to(on, self.dtype)
        self.v_buffer[layer][loc.to(on).long()] = v.to(on, self.dtype)


@dataclass(eq=False)
class Request:
    """A live request: its req_to_token row, length and pages (logical order); compared by identity."""

    rid: int
    req_pool_idx: int
    seq_len: int
    pages: list[int] = field(default_factory=list)
    released: bool = False


class KVCacheManager:
    """Admit, grow and release requests across ``ReqToTokenPool`` and the page allocator."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        check_manager_pools(req_to_token_pool, token_to_kv_pool, ReqToTokenPool, TokenToKVPool)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.page_size = token_to_kv_pool.page_size
        self.allocator = token_to_kv_pool.allocator  # shared: listeners on the pool hear the manager's frees
        self.requests: dict[int, Request] = {}
        self._next_rid = 0
        self.generation = 0  # +1 whenever a request is admitted, grows or is released: a batch's tensors go stale

    @classmethod
    def create(cls, *, max_requests: int, max_context_len: int, num_pages: int, page_size: int,
               num_layers: int = 1, num_kv_heads: int = 1, head_dim: int = 8, dtype=torch.float32,
               device="cpu", host_layers=()) -> KVCacheManager:
        """Build both pools and the manager in one call."""
        return cls(
            ReqToTokenPool(max_requests, max_context_len, device),
            TokenToKVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device, host_layers),
        )

    def slot_of(self, req: Request, t: int) -> int:
        """Physical slot of logical token ``t`` of ``req``."""
        t = check_slot_of(req, t)
        return req.pages[t // self.page_size] * self.page_size + t % self.page_size

    @property
    def next_rid(self) -> int:
        """The rid the next ``admit`` gives its request."""
        return self._next_rid

    def admit(self, num_tokens: int) -> Request:
        """Take a request slot and enough pages for ``num_tokens`` tokens; fill its req_to_token row."""
        num_tokens = check_admit(self, num_tokens)  # (also: enough pages, so nothing is left behind)
        req = Request(rid=self._next_rid, req_pool_idx=-1, seq_len=0)
        (req.req_pool_idx,) = self.req_to_token_pool.alloc(1, owner=req)  # its row: freed only by release
        self.generation += 1
        self._next_rid += 1
        self.requests[req.rid] = req
        self.grow(req, num_tokens)
        return req

    def grow(self, req: Request, num_tokens: int = 1) -> torch.Tensor:
        """Append ``num_tokens`` tokens to ``req``; returns their physical slots (int64)."""
        num_tokens = check_grow(self, req, num_tokens)
        new_len = req.seq_len + num_tokens
        need = -(-new_len // self.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need, owner=req))  # its pages: freed only by release
        t = torch.arange(req.seq_len, new_len)
        pages = torch.tensor(req.pages, dtype=torch.int64) if req.pages else torch.zeros(0, dtype=torch.int64)
        slots = pages[t // self.page_size] * self.page_size + t % self.page_size
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[req.seq_len:new_len] = slots.to(row.device, torch.int32)
        req.seq_len = new_len
        self.generation += 1
        return slots.to(self.req_to_token_pool.device)

    def release(self, req: Request) -> None:
        """Free the request's pages and row, all or nothing: if the page free fails, it stays live (retry)."""
        check_release(self, req)
        assert not self.req_to_token_pool._is_free[req.req_pool_idx], "a live request owns its row"
        self.allocator.free(req.pages, owner=req)
        self.req_to_token_pool.free([req.req_pool_idx], owner=req)
        req.released = True
        req.pages = []
        del self.requests[req.rid]
        self.generation += 1

    def pages_needed(self, req: Request, num_tokens: int = 1) -> int:
        """How many new pages growing ``req`` by ``num_tokens`` tokens takes (0 while its last page has room)."""
        num_tokens = check_pages_needed(req, num_tokens)
        return max(0, -(-(req.seq_len + num_tokens) // self.page_size) - len(req.pages))


class IndexerKeyCache:
    """The DSA indexer's keys, per layer, in pages of the KV pool's ``page_size``, addressed like it (slot
    ``req_to_token[r, t]``; page 0 is padding). FP8 (as SGLang and DeepGEMM keep it): one uint8 buffer per
    layer ``[num_pages, P * (D + 4)]``, per page all its keys then all its fp32 scales (132 bytes per token
    at D=128); ``key_pages`` / ``scale_pages`` are views ``[num_pages, P, D]`` / ``[num_pages, P]``. Full
    precision: fp32 keys, scales of 1. ``written[layer]`` marks slots holding a key, so reading a history
    never indexed raises instead of scoring zeros or a previous owner's keys."""

    def __init__(self, num_pages: int, num_layers: int, config: IndexerConfig, req_to_token_pool, *,
                 page_size: int = 64, device=None):
        num_pages, num_layers, page_size = check_indexer_cache(num_pages, num_layers, config,
                                                                      req_to_token_pool, page_size)
        self.config = config
        self.num_pages, self.num_layers, self.page_size = num_pages, num_layers, page_size
        self.num_slots = num_pages * page_size
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(device) if device is not None else req_to_token_pool.req_to_token.device
        P, D = page_size, config.head_dim
        if config.use_fp8:
            self.buffers = [torch.zeros(num_pages, P * (D + 4), dtype=torch.uint8, device=self.device)
                            for _ in range(num_layers)]
            self._keys = [b[:, : P * D].view(FP8_DTYPE).view(num_pages, P, D) for b in self.buffers]
            self._scales = [b.view(torch.float32)[:, P * D // 4:] for b in self.buffers]
        else:
            self.buffers = None
            self._keys = [torch.zeros(num_pages, P, D, device=self.device) for _ in range(num_layers)]
            self._scales = [torch.zeros(num_pages, P, device=self.device) for _ in range(num_layers)]
        self.written = [torch.zeros(self.num_slots, dtype=torch.bool, device=self.device) for _ in range(num_layers)]

    @classmethod
    def from_pools(cls, token_to_kv_pool, req_to_token_pool, config: IndexerConfig, num_layers: int | None = None,
                   *, page_allocator=None) -> IndexerKeyCache:
        """A cache with the KV pool's pages, page size and layers, listening to the allocator's frees (a freed
        page's keys never pass for the next owner's); without an allocator it refuses (PoolError)."""
        allocator = check_cache_allocator(token_to_kv_pool, page_allocator)
        cache = cls(token_to_kv_pool.num_pages, num_layers or token_to_kv_pool.num_layers, config, req_to_token_pool,
                    page_size=token_to_kv_pool.page_size, device=token_to_kv_pool.device)
        allocator.add_free_listener(cache.invalidate_pages)
        return cache

    @classmethod
    def for_manager(cls, manager, config: IndexerConfig, num_layers: int | None = None) -> IndexerKeyCache:
        """``from_pools`` for a ``KVCacheManager`` (listening to its allocator's frees)."""
        return cls.from_pools(manager.token_to_kv_pool, manager.req_to_token_pool, config, num_layers,
                              page_allocator=manager.allocator)

    def invalidate_pages(self, pages: torch.Tensor) -> None:
        """Forget the keys of freed physical pages (every layer): reading them again raises until rewritten."""
        pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).to(self.device)
        pages = pages[(pages >= 0) & (pages < self.num_pages)]
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)
        for written in self.written:
            written.index_fill_(0, slots, False)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer: 132 at head_dim 128 in FP8 (128 key bytes + a 4-byte scale)."""
        return self.config.key_bytes_per_token

    def check_layer(self, layer_id) -> int:
        return check_cache_layer(self, layer_id)

    def key_pages(self, layer_id: int) -> torch.Tensor:
        """Keys of one layer as ``[num_pages, page_size, head_dim]`` (FP8: a view of the page buffer)."""
        return self._keys[self.check_layer(layer_id)]

    def scale_pages(self, layer_id: int) -> torch.Tensor:
        """Scales of one layer as fp32 ``[num_pages, page_size]`` (FP8: a view of the page buffer)."""
        return self._scales[self.check_layer(layer_id)]

    def write(self, layer_id: int, loc: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> None:
        """Store ``keys`` ``[n, head_dim]`` and ``scales`` ``[n]`` at physical slots ``loc`` ``[n]``."""
        layer_id, loc = check_cache_write(self, layer_id, loc, keys, scales)
        page, offset = loc // self.page_size, loc % self.page_size
        self._keys[layer_id][page, offset] = keys.to(self._keys[layer_id].dtype)
        self._scales[layer_id][page, offset] = scales.float()
        # index_fill_, not ``written[loc] = True``: assigning a Python scalar through a tensor index
        # copies a CPU scalar tensor to the GPU, which a CUDA graph capture refuses
        self.written[layer_id].index_fill_(0, loc, True)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (as fp32 values: FP8 values are exact in fp32) and scales at physical ``slots``."""
        layer_id, slots = check_cache_read(self, layer_id, slots)
        page, offset = slots // self.page_size, slots % self.page_size
        return self._keys[layer_id][page, offset].float(), self._scales[layer_id][page, offset]

    def check_history(self, layer_id: int, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor) -> None:
        """BatchError unless positions ``0 .. prefix_lens[i] - 1`` of every request hold keys (one host sync)."""
        check_cache_history(self, layer_id, req_pool_indices, prefix_lens)

    def block_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """int32 ``[bs, ceil(max_context_len / P)]``: ``req_to_token[rows, ::P] // P``, as SGLang builds it."""

        req_to_token = self.req_to_token_pool.req_to_token
        return (req_to_token[req_pool_indices.long(), :: self.page_size] // self.page_size).to(torch.int32)


# ------------------------------ argument checks (each entry point above calls one first)
def check_req_to_token_pool(size, max_context_len, device) -> tuple[int, int, torch.device]:
    size = check_int("ReqToTokenPool(size)", size, low=1, high=INT32_MAX, error=PoolError)
    max_context_len = check_int("ReqToTokenPool(max_context_len)", max_context_len, low=1, high=INT32_MAX,
                                error=PoolError)
    check_fits_memory("ReqToTokenPool", size * max_context_len * 4)
    return size, max_context_len, check_device("ReqToTokenPool(device)", device, PoolError)


def check_slot_alloc(pool, n) -> int:
    n = check_int("ReqToTokenPool.alloc(n)", n, low=0, error=PoolError)
    if n > len(pool._free):
        raise PoolError(f"ReqToTokenPool exhausted: asked for {n} request slots, {len(pool._free)} of {pool.size} "
                        "free. Fix: release finished requests, or build the pool with a larger size.")
    return n


def check_free(free_list, name: str, ids, owner=None) -> list[int]:
    """``ids`` as a list, each allocated now (to ``owner``, if taken for one) and named once; else PoolError."""
    ids = check_index_list(name, ids)
    first, size, what = free_list._first, free_list._size, free_list._what
    for i in ids:
        if i == 0 < first:
            raise PoolError(f"{name}: page 0 is the reserved padding page and is never allocated.")
        if not first <= i < size:
            raise PoolError(f"{name}: {what} {i} is out of range [{first}, {size}).")
        if free_list._is_free[i]:
            raise PoolError(f"{name}: {what} {i} is already free (double free).")
        held_by = free_list._owner.get(i)
        if held_by is not None and held_by is not owner:
            who = f"request {held_by.rid} (req_pool_idx {held_by.req_pool_idx})" if isinstance(held_by, Request) \
                else describe(held_by)
            raise PoolError(f"{name}: {what} {i} belongs to {who}, which is live: freeing it would hand its KV "
                            "to the next request. Fix: release the request (KVCacheManager.release(req)).")
    if len(set(ids)) != len(ids):
        raise PoolError(f"{name}: the same {what} appears twice in {ids} (double free).")
    return ids


def check_page_allocator(num_pages, page_size) -> tuple[int, int]:
    num_pages = check_int("PageAllocator(num_pages)", num_pages, low=2, high=INT32_MAX, error=PoolError,
                          fix="page 0 is reserved, so at least 2 pages.")
    page_size = check_int("PageAllocator(page_size)", page_size, low=1, high=INT32_MAX // num_pages,
                          error=PoolError, fix="slot ids (num_pages * page_size) must fit in int32.")
    return num_pages, page_size


def check_free_listener(callback) -> None:
    if not callable(callback):
        fail("add_free_listener(callback)", "a callable taking an int64 tensor of pages", describe(callback),
             error=PoolError)


def check_page_alloc(allocator, n) -> int:
    n = check_int("PageAllocator.alloc(n)", n, low=0, error=PoolError)
    if n > len(allocator._free):
        raise PoolError(f"KV cache exhausted: asked for {n} pages, {len(allocator._free)} of {allocator.num_pages - 1} "
                        f"usable pages free (page size {allocator.page_size}). Fix: release requests, or build the "
                        "pool with more pages.")
    return n


def call_free_listener(callback, freed: torch.Tensor, pages: list[int]) -> None:
    """``callback(freed)``; if it raises, a PoolError that says no page was freed (the free is all or nothing)."""
    try:
        callback(freed)
    except Exception as e:
        raise PoolError(f"PageAllocator.free: the free listener {callback!r} raised {type(e).__name__}: {e}. No page "
                        f"was freed; pages {pages} are still allocated. Fix: fix the listener, then free again.") from e


def check_kv_pool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device):
    """``(num_layers, num_kv_heads, head_dim, device)`` of a ``TokenToKVPool`` (its allocator checked the pages)."""
    num_layers = check_int("TokenToKVPool(num_layers)", num_layers, low=1, error=PoolError)
    num_kv_heads = check_int("TokenToKVPool(num_kv_heads)", num_kv_heads, low=1, error=PoolError)
    head_dim = check_int("TokenToKVPool(head_dim)", head_dim, low=1, error=PoolError)
    check_kv_dtype("TokenToKVPool(dtype)", dtype, PoolError)
    check_fits_memory("TokenToKVPool", 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim
                      * torch.empty(0, dtype=dtype).element_size())
    return num_layers, num_kv_heads, head_dim, check_device("TokenToKVPool(device)", device, PoolError)


def check_pool_layer(pool, layer) -> int:
    return check_int("layer", layer, low=0, high=pool.num_layers - 1, error=PoolError)


def check_set_kv(pool, layer, loc, k, v) -> int:
    layer = check_pool_layer(pool, layer)
    check_tensor("loc", loc, dtype=(torch.int32, torch.int64), dims=1, device=pool.device)
    want = (loc.shape[0], pool.num_kv_heads, pool.head_dim)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, shape=want, device=pool.device, error=PoolError,
                     fix=f"one [H_kv, D] row per slot, on the pool's device {pool.device}.")
        if not t.is_floating_point():  # (complex and integer K/V would be cast, silently)
            fail(name, "a real floating tensor", f"dtype {t.dtype}", "pass real K/V (e.g. float32 or bfloat16).",
                 PoolError)
    check_range("loc", loc, pool.page_size, pool.num_slots - 1, "page 0 is padding: write real slots only.",
                PoolError)
    return layer


def check_manager_pools(req_to_token_pool, token_to_kv_pool, req_cls, kv_cls) -> None:
    for name, value, cls in (("req_to_token_pool", req_to_token_pool, req_cls),
                             ("token_to_kv_pool", token_to_kv_pool, kv_cls)):
        if not isinstance(value, cls):
            fail(f"KVCacheManager({name})", f"a {cls.__name__}", describe(value), error=PoolError)


def check_request(name: str, req) -> None:
    if not isinstance(req, Request):
        fail(name, "a Request returned by KVCacheManager.admit", describe(req), error=PoolError)


def check_owned(manager, what: str, req) -> None:
    if manager.requests.get(req.rid) is not req:
        raise PoolError(f"{what}: request {req.rid} (req_pool_idx {req.req_pool_idx}) was not admitted by this "
                        "KVCacheManager. Fix: use the manager whose admit() returned it.")


def check_fits(manager, num_tokens: int) -> None:
    if num_tokens > (most := manager.req_to_token_pool.max_context_len):
        raise PoolError(f"request of {num_tokens} tokens exceeds max_context_len {most} of the ReqToTokenPool. "
                        "Fix: build the pool with a larger max_context_len.")


def check_slot_of(req, t) -> int:
    check_request("slot_of(req)", req)
    return check_int("slot_of(t)", t, low=0, high=req.seq_len - 1, error=PoolError)


def check_admit(manager, num_tokens) -> int:
    """The token count; and enough free pages, checked before the request slot is taken (nothing left behind)."""
    num_tokens = check_int("admit(num_tokens)", num_tokens, low=0, error=PoolError)
    check_fits(manager, num_tokens)
    check_page_alloc(manager.allocator, -(-num_tokens // manager.page_size))
    return num_tokens


def check_grow(manager, req, num_tokens) -> int:
    check_request("grow(req)", req)
    if req.released:
        raise PoolError(f"grow: request {req.rid} was released; admit a new request instead.")
    check_owned(manager, "grow", req)
    num_tokens = check_int("grow(num_tokens)", num_tokens, low=0, error=PoolError)
    check_fits(manager, req.seq_len + num_tokens)
    return num_tokens


def check_release(manager, req) -> None:
    check_request("release(req)", req)
    if req.released:
        raise PoolError(f"release: request {req.rid} was already released (double free).")
    check_owned(manager, "release", req)


def check_pages_needed(req, num_tokens) -> int:
    check_request("pages_needed(req)", req)
    return check_int("pages_needed(num_tokens)", num_tokens, low=0, error=PoolError)


def check_indexer_cache(num_pages, num_layers, config, req_to_token_pool, page_size) -> tuple[int, int, int]:
    if not isinstance(config, IndexerConfig):
        fail("IndexerKeyCache: config", "an IndexerConfig", describe(config), error=ConfigError)
    num_pages = check_int("IndexerKeyCache: num_pages", num_pages, low=2, error=PoolError,
                          fix="page 0 is padding, so at least 2 pages.")
    num_layers = check_int("IndexerKeyCache: num_layers", num_layers, low=1, error=PoolError)
    page_size = check_int("IndexerKeyCache: page_size", page_size, low=1, error=PoolError)
    if config.use_fp8 and (page_size * config.head_dim) % 4:
        fail("IndexerKeyCache: page_size", f"page_size * head_dim ({config.head_dim}) a multiple of 4 (the "
             "scales that follow the keys are fp32)", repr(page_size), error=PoolError)
    if not hasattr(req_to_token_pool, "req_to_token"):
        fail("IndexerKeyCache: req_to_token_pool", "a ReqToTokenPool", describe(req_to_token_pool),
             error=PoolError)
    return num_pages, num_layers, page_size


def check_cache_allocator(token_to_kv_pool, page_allocator):
    """The allocator whose frees an ``IndexerKeyCache`` must hear (``page_allocator``, or the pool's own)."""
    allocator = page_allocator if page_allocator is not None else getattr(token_to_kv_pool, "allocator", None)
    if not callable(getattr(allocator, "add_free_listener", None)):
        fail("IndexerKeyCache.from_pools: page_allocator", "the pool's page allocator (something with "
             "add_free_listener), so freed pages' keys are forgotten", describe(allocator),
             "IndexerKeyCache.for_manager(manager, config), or pass page_allocator=manager.allocator.",
             PoolError)
    return allocator


def check_cache_layer(cache, layer_id) -> int:
    return check_int("layer_id", layer_id, low=0, high=cache.num_layers - 1, error=PoolError,
                     fix=f"the indexer cache has layers [0, {cache.num_layers}).")


def _cache_slots(cache, name: str, slots, low: int) -> torch.Tensor:
    check_tensor(name, slots, dtype=INDEX_DTYPES, dims=1, device=cache.device.type, error=PoolError,
                 fix="pass int32/int64 physical slots (req_to_token entries).")
    check_range(name, slots, low, cache.num_slots - 1, error=PoolError,
                fix=f"slots index the cache's {cache.num_slots} slots" + (" (page 0 is padding)" if low else ""))
    return slots.long()


def check_cache_write(cache, layer_id, loc, keys, scales) -> tuple[int, torch.Tensor]:
    layer_id = check_cache_layer(cache, layer_id)
    loc = _cache_slots(cache, "loc", loc, cache.page_size)
    n = loc.shape[0]
    check_tensor("keys", keys, shape=(n, cache.config.head_dim), fix="one key per slot of loc.")
    check_tensor("scales", scales, shape=(n,), fix="one scale per slot of loc.")
    return layer_id, loc


def check_cache_read(cache, layer_id, slots) -> tuple[int, torch.Tensor]:
    return check_cache_layer(cache, layer_id), _cache_slots(cache, "slots", slots, 0)


def check_cache_history(cache, layer_id: int, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor) -> None:
    """BatchError unless positions ``0 .. prefix_lens[i] - 1`` of every request hold keys (one host sync)."""
    table = cache.req_to_token_pool.req_to_token[req_pool_indices.long()].long()
    in_prefix = torch.arange(table.shape[1], device=table.device)[None, :] < prefix_lens[:, None]
    missing = in_prefix & ~cache.written[layer_id][table]
    if bool(missing.any()):
        i = int(missing.any(1).nonzero()[0, 0])
        where = missing[i].nonzero().squeeze(1)
        more = "..." if where.numel() > 8 else ""
        raise BatchError(f"request {i} (req_to_token row {int(req_pool_indices[i])}): the indexer cache of layer "
                         f"{layer_id} holds no key for positions {where[:8].tolist()}{more} of its history. Fix: run "
                         "the indexer over every earlier chunk (prefix) of the request first.")
