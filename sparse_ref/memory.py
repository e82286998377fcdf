"""The memory pools of a serving engine, and the bookkeeping that ties them together.

``ReqToTokenPool`` (request row -> logical position -> physical slot), ``PageAllocator`` (whole pages,
page 0 reserved as padding, free listeners), ``TokenToKVPool`` (paged K/V per layer and the allocator of
its pages), ``KVCacheManager`` (admit, grow, release, keeping rows and pages in step) and
``IndexerKeyCache`` (the DSA indexer's FP8 keys, paged like the KV pool). Logical token ``t`` lives at
slot ``pages[t // P] * P + t % P``. Every public method checks its arguments first (``sparse_ref.checks``);
a failed check changes nothing. ``docs/design.md`` section 3.1 states the contract.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparse_ref import checks
from sparse_ref.config import IndexerConfig
from sparse_ref.fp8 import FP8_DTYPE


class _FreeList:
    """Ids ``[first, size)`` handed out and taken back, lowest first; double and foreign frees raise."""

    def __init__(self, what: str, first: int, size: int):
        self._what, self._first, self._size = what, first, size
        self._free = list(range(size - 1, first - 1, -1))  # pop() hands out first, first + 1, ...
        self._is_free = [i >= first for i in range(size)]

    def _take(self, n: int) -> list[int]:
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def _give_back(self, ids: list[int]) -> None:
        for i in ids:
            self._is_free[i] = True
            self._free.append(i)


class ReqToTokenPool(_FreeList):
    """``req_to_token``: int32 ``[size, max_context_len]``, one row per request slot."""

    def __init__(self, size: int, max_context_len: int, device="cpu"):
        size, max_context_len, self.device = checks.check_req_to_token_pool(size, max_context_len, device)
        super().__init__("slot", 0, size)
        self.size, self.max_context_len = size, max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=self.device)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        """Take ``n`` request slots; raises PoolError when fewer are free."""
        return self._take(checks.check_slot_alloc(self, n))

    def free(self, slots) -> None:
        """Give request slots back; their rows are zeroed. Double free raises PoolError."""
        slots = checks.check_free(self, "ReqToTokenPool.free(slots)", slots)
        self._give_back(slots)
        for s in slots:
            self.req_to_token[s].zero_()


class PageAllocator(_FreeList):
    """Whole pages of the KV cache. Page 0 is reserved padding and is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = checks.check_page_allocator(num_pages, page_size)
        super().__init__("page", 1, self.num_pages)
        self._free_listeners: list[Callable[[torch.Tensor], None]] = []

    def available_pages(self) -> int:
        return len(self._free)

    def add_free_listener(self, callback: Callable[[torch.Tensor], None]) -> None:
        """Call ``callback(pages)`` whenever pages are freed (Quest drops their bounds). Added once."""
        checks.check_free_listener(callback)
        if callback not in self._free_listeners:
            self._free_listeners.append(callback)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` whole pages (never page 0); raises PoolError when fewer are free."""
        return self._take(checks.check_page_alloc(self, n))

    def free(self, pages) -> None:
        """Give whole pages back, after telling the free listeners. Page 0, double free, out of range raise.

        All or nothing: the pages are checked first, then every listener is called, and only then
        are the pages marked free. If a listener raises, no page is freed (a listener must
        tolerate being called again for the same pages when the free is retried).
        """
        pages = checks.check_free(self, "PageAllocator.free(pages)", pages)
        freed = torch.tensor(pages, dtype=torch.int64)
        for callback in self._free_listeners:
            checks.call_free_listener(callback, freed, pages)
        self._give_back(pages)


class TokenToKVPool:
    """Paged K/V buffers: per layer, ``[num_pages * page_size, H_kv, D]``. Slot 0..P-1 is padding.

    ``allocator``: the ``PageAllocator`` of these pages; subscribe to it to hear about frees.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages, self.page_size = num_pages, page_size
        self.num_layers, self.num_kv_heads, self.head_dim, self.device = checks.check_kv_pool(
            num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device)
        self.dtype = dtype
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[checks.check_pool_layer(self, layer)]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[checks.check_pool_layer(self, layer)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, H_kv, D]`` into physical slots ``loc`` ``[n]``."""
        layer = checks.check_set_kv(self, layer, loc, k, v)
        self.k_buffer[layer][loc.long()] = k.to(self.dtype)
        self.v_buffer[layer][loc.long()] = v.to(self.dtype)


@dataclass(eq=False)
class Request:
    """A live request: its row in req_to_token, its length and the pages it owns (logical order).

    Requests compare by identity: two requests with equal fields (of two managers, say) are two requests."""

    rid: int
    req_pool_idx: int
    seq_len: int
    pages: list[int] = field(default_factory=list)
    released: bool = False


class KVCacheManager:
    """Admit, grow and release requests across ``ReqToTokenPool`` and the page allocator."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        checks.check_manager_pools(req_to_token_pool, token_to_kv_pool, ReqToTokenPool, TokenToKVPool)
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
               device="cpu") -> KVCacheManager:
        """Build both pools and the manager in one call."""
        return cls(
            ReqToTokenPool(max_requests, max_context_len, device),
            TokenToKVPool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device),
        )

    def slot_of(self, req: Request, t: int) -> int:
        """Physical slot of logical token ``t`` of ``req``."""
        t = checks.check_slot_of(req, t)
        return req.pages[t // self.page_size] * self.page_size + t % self.page_size

    def admit(self, num_tokens: int) -> Request:
        """Take a request slot and enough pages for ``num_tokens`` tokens; fill its req_to_token row."""
        num_tokens = checks.check_admit(self, num_tokens)  # (also: enough pages, so nothing is left behind)
        (slot,) = self.req_to_token_pool.alloc(1)
        self.generation += 1
        req = Request(rid=self._next_rid, req_pool_idx=slot, seq_len=0)
        self._next_rid += 1
        self.requests[req.rid] = req
        self.grow(req, num_tokens)
        return req

    def grow(self, req: Request, num_tokens: int = 1) -> torch.Tensor:
        """Append ``num_tokens`` tokens to ``req``; returns their physical slots (int64)."""
        num_tokens = checks.check_grow(self, req, num_tokens)
        new_len = req.seq_len + num_tokens
        need = -(-new_len // self.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need))
        t = torch.arange(req.seq_len, new_len)
        pages = torch.tensor(req.pages, dtype=torch.int64) if req.pages else torch.zeros(0, dtype=torch.int64)
        slots = pages[t // self.page_size] * self.page_size + t % self.page_size
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[req.seq_len:new_len] = slots.to(row.device, torch.int32)
        req.seq_len = new_len
        self.generation += 1
        return slots.to(self.req_to_token_pool.device)

    def release(self, req: Request) -> None:
        """Free the request's pages and its req_to_token row; both become reusable.

        All or nothing: if the page free fails (e.g. a free listener raised), the request stays
        live and unchanged, and ``release`` may be retried.
        """
        checks.check_release(self, req)
        assert not self.req_to_token_pool._is_free[req.req_pool_idx], "a live request owns its row"
        self.allocator.free(req.pages)
        self.req_to_token_pool.free([req.req_pool_idx])
        req.released = True
        req.pages = []
        del self.requests[req.rid]
        self.generation += 1

    def pages_needed(self, req: Request, num_tokens: int = 1) -> int:
        """How many new pages growing ``req`` by ``num_tokens`` tokens takes (0 while its last page has room)."""
        num_tokens = checks.check_pages_needed(req, num_tokens)
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
        num_pages, num_layers, page_size = checks.check_indexer_cache(num_pages, num_layers, config,
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
        """A cache with the KV pool's pages, page size and layer count (unless ``num_layers`` is given).

        It subscribes to the page allocator's frees (``page_allocator``, or the pool's own
        ``token_to_kv_pool.allocator``), so a freed page's keys are forgotten and never pass for the
        next owner's history; without a reachable allocator it refuses (PoolError).
        """
        allocator = checks.check_cache_allocator(token_to_kv_pool, page_allocator)
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
        return checks.check_cache_layer(self, layer_id)

    def key_pages(self, layer_id: int) -> torch.Tensor:
        """Keys of one layer as ``[num_pages, page_size, head_dim]`` (FP8: a view of the page buffer)."""
        return self._keys[self.check_layer(layer_id)]

    def scale_pages(self, layer_id: int) -> torch.Tensor:
        """Scales of one layer as fp32 ``[num_pages, page_size]`` (FP8: a view of the page buffer)."""
        return self._scales[self.check_layer(layer_id)]

    def write(self, layer_id: int, loc: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> None:
        """Store ``keys`` ``[n, head_dim]`` and ``scales`` ``[n]`` at physical slots ``loc`` ``[n]``."""
        layer_id, loc = checks.check_cache_write(self, layer_id, loc, keys, scales)
        page, offset = loc // self.page_size, loc % self.page_size
        self._keys[layer_id][page, offset] = keys.to(self._keys[layer_id].dtype)
        self._scales[layer_id][page, offset] = scales.float()
        # index_fill_, not ``written[loc] = True``: assigning a Python scalar through a tensor index
        # copies a CPU scalar tensor to the GPU, which a CUDA graph capture refuses
        self.written[layer_id].index_fill_(0, loc, True)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (as fp32 values: FP8 values are exact in fp32) and scales at physical ``slots``."""
        layer_id, slots = checks.check_cache_read(self, layer_id, slots)
        page, offset = slots // self.page_size, slots % self.page_size
        return self._keys[layer_id][page, offset].float(), self._scales[layer_id][page, offset]

    def check_history(self, layer_id: int, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor) -> None:
        """BatchError unless positions ``0 .. prefix_lens[i] - 1`` of every request hold keys (one host sync)."""
        checks.check_cache_history(self, layer_id, req_pool_indices, prefix_lens)

    def block_table(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """int32 ``[bs, ceil(max_context_len / P)]``: the physical page of each logical page of each request.

        ``req_to_token[rows, ::P] // P``, as SGLang builds its page table (unused entries are page 0).
        """
        req_to_token = self.req_to_token_pool.req_to_token
        return (req_to_token[req_pool_indices.long(), :: self.page_size] // self.page_size).to(torch.int32)
