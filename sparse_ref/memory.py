"""The two memory pools of a serving engine, and the bookkeeping that ties them together.

* ``ReqToTokenPool``: one row per live request; row ``r`` maps a logical token
  position ``t`` to the physical KV slot that holds token ``t``.
* ``PageAllocator``: hands out and takes back whole pages. Page 0 is reserved as
  padding, so a physical slot of 0 never holds real data.
* ``TokenToKVPool``: the paged K and V buffers, ``[num_pages * page_size, H_kv, D]``
  per layer, and the ``PageAllocator`` of its pages (``token_to_kv_pool.allocator``). Whatever
  is built on the pool (Quest bounds, DSA indexer keys) subscribes to its frees through it, so
  a freed and reused page can never keep its previous owner's state.
* ``KVCacheManager``: admits a request of n tokens, grows it one token at a time and
  releases it, keeping the req_to_token row and the page list in step.

A request's logical token ``t`` lives at physical slot ``pages[t // P] * P + t % P``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparse_ref.checks import INT32_MAX, check_device, check_int, check_range, check_tensor, describe, fail
from sparse_ref.errors import PoolError


def as_index_list(name: str, indices) -> list[int]:
    """Ints from an int, a sequence of ints or an integer tensor; anything else (floats too) raises."""
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            fail(name, "an integer tensor", f"dtype {indices.dtype}", error=PoolError)
        return indices.reshape(-1).tolist()
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        indices = [indices]
    return [check_int(name, i, error=PoolError) for i in indices]


def _check_fits_memory(what: str, nbytes: int) -> None:
    if nbytes > 2**45:
        fail(what, "buffers that fit in a machine's memory (at most 32 TiB)", f"a request for {nbytes} bytes",
             "check the sizes: a typo in one of them multiplies the whole allocation.", PoolError)


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

    def _checked(self, name: str, ids) -> list[int]:
        """``ids`` as a list, each allocated now and named once; else PoolError (nothing changes)."""
        ids = as_index_list(name, ids)
        for i in ids:
            if i == 0 < self._first:
                raise PoolError(f"{name}: page 0 is the reserved padding page and is never allocated.")
            if not self._first <= i < self._size:
                raise PoolError(f"{name}: {self._what} {i} is out of range [{self._first}, {self._size}).")
            if self._is_free[i]:
                raise PoolError(f"{name}: {self._what} {i} is already free (double free).")
        if len(set(ids)) != len(ids):
            raise PoolError(f"{name}: the same {self._what} appears twice in {ids} (double free).")
        return ids

    def _give_back(self, ids: list[int]) -> None:
        for i in ids:
            self._is_free[i] = True
            self._free.append(i)


class ReqToTokenPool(_FreeList):
    """``req_to_token``: int32 ``[size, max_context_len]``, one row per request slot."""

    def __init__(self, size: int, max_context_len: int, device="cpu"):
        size = check_int("ReqToTokenPool(size)", size, low=1, high=INT32_MAX, error=PoolError)
        max_context_len = check_int("ReqToTokenPool(max_context_len)", max_context_len, low=1, high=INT32_MAX,
                                    error=PoolError)
        _check_fits_memory("ReqToTokenPool", size * max_context_len * 4)
        super().__init__("slot", 0, size)
        self.size, self.max_context_len = size, max_context_len
        self.device = check_device("ReqToTokenPool(device)", device, PoolError)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=self.device)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        """Take ``n`` request slots; raises PoolError when fewer are free."""
        n = check_int("ReqToTokenPool.alloc(n)", n, low=0, error=PoolError)
        if n > len(self._free):
            raise PoolError(f"ReqToTokenPool exhausted: asked for {n} request slots, {len(self._free)} of {self.size} "
                            "free. Fix: release finished requests, or build the pool with a larger size.")
        return self._take(n)

    def free(self, slots) -> None:
        """Give request slots back; their rows are zeroed. Double free raises PoolError."""
        slots = self._checked("ReqToTokenPool.free(slots)", slots)
        self._give_back(slots)
        for s in slots:
            self.req_to_token[s].zero_()


class PageAllocator(_FreeList):
    """Whole pages of the KV cache. Page 0 is reserved padding and is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = check_int("PageAllocator(num_pages)", num_pages, low=2, high=INT32_MAX, error=PoolError,
                                   fix="page 0 is reserved, so at least 2 pages.")
        self.page_size = check_int("PageAllocator(page_size)", page_size, low=1, high=INT32_MAX // self.num_pages,
                                   error=PoolError, fix="slot ids (num_pages * page_size) must fit in int32.")
        super().__init__("page", 1, self.num_pages)
        self._free_listeners: list[Callable[[torch.Tensor], None]] = []

    def available_pages(self) -> int:
        return len(self._free)

    def add_free_listener(self, callback: Callable[[torch.Tensor], None]) -> None:
        """Call ``callback(pages)`` whenever pages are freed (Quest drops their bounds). Added once."""
        if not callable(callback):
            fail("add_free_listener(callback)", "a callable taking an int64 tensor of pages", describe(callback),
                 error=PoolError)
        if callback not in self._free_listeners:
            self._free_listeners.append(callback)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` whole pages (never page 0); raises PoolError when fewer are free."""
        n = check_int("PageAllocator.alloc(n)", n, low=0, error=PoolError)
        if n > len(self._free):
            raise PoolError(f"KV cache exhausted: asked for {n} pages, {len(self._free)} of {self.num_pages - 1} "
                            f"usable pages free (page size {self.page_size}). Fix: release requests, or build the "
                            "pool with more pages.")
        return self._take(n)

    def free(self, pages) -> None:
        """Give whole pages back, after telling the free listeners. Page 0, double free, out of range raise.

        All or nothing: the pages are checked first, then every listener is called, and only then
        are the pages marked free. If a listener raises, no page is freed (a listener must
        tolerate being called again for the same pages when the free is retried).
        """
        pages = self._checked("PageAllocator.free(pages)", pages)
        freed = torch.tensor(pages, dtype=torch.int64)
        for callback in self._free_listeners:
            try:
                callback(freed)
            except Exception as e:
                raise PoolError(
                    f"PageAllocator.free: the free listener {callback!r} raised {type(e).__name__}: {e}. No page was "
                    f"freed; pages {pages} are still allocated. Fix: fix the listener, then free again."
                ) from e
        self._give_back(pages)


class TokenToKVPool:
    """Paged K/V buffers: per layer, ``[num_pages * page_size, H_kv, D]``. Slot 0..P-1 is padding.

    ``allocator``: the ``PageAllocator`` of these pages; subscribe to it to hear about frees.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages, self.page_size = num_pages, page_size
        self.num_layers = check_int("TokenToKVPool(num_layers)", num_layers, low=1, error=PoolError)
        self.num_kv_heads = check_int("TokenToKVPool(num_kv_heads)", num_kv_heads, low=1, error=PoolError)
        self.head_dim = check_int("TokenToKVPool(head_dim)", head_dim, low=1, error=PoolError)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            fail("TokenToKVPool(dtype)", "a floating torch.dtype such as torch.float16", describe(dtype),
                 "pass the dtype object, e.g. dtype=torch.bfloat16, not a string.", PoolError)
        _check_fits_memory("TokenToKVPool", 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim
                           * torch.empty(0, dtype=dtype).element_size())
        self.dtype = dtype
        self.device = check_device("TokenToKVPool(device)", device, PoolError)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def _layer(self, layer: int) -> int:
        return check_int("layer", layer, low=0, high=self.num_layers - 1, error=PoolError)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[self._layer(layer)]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[self._layer(layer)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, H_kv, D]`` into physical slots ``loc`` ``[n]``."""
        layer = self._layer(layer)
        check_tensor("loc", loc, dtype=(torch.int32, torch.int64), dims=1, device=self.device)
        want = (loc.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, shape=want, device=self.device, error=PoolError,
                         fix=f"one [H_kv, D] row per slot, on the pool's device {self.device}.")
        check_range("loc", loc, self.page_size, self.num_slots - 1, "page 0 is padding: write real slots only.",
                    PoolError)
        self.k_buffer[layer][loc.long()] = k.to(self.dtype)
        self.v_buffer[layer][loc.long()] = v.to(self.dtype)


@dataclass
class Request:
    """A live request: its row in req_to_token, its length and the pages it owns (logical order)."""

    rid: int
    req_pool_idx: int
    seq_len: int
    pages: list[int] = field(default_factory=list)
    released: bool = False


def _check_request(name: str, req) -> None:
    if not isinstance(req, Request):
        fail(name, "a Request returned by KVCacheManager.admit", describe(req), error=PoolError)


class KVCacheManager:
    """Admit, grow and release requests across ``ReqToTokenPool`` and the page allocator."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        for name, value, cls in (("req_to_token_pool", req_to_token_pool, ReqToTokenPool),
                                 ("token_to_kv_pool", token_to_kv_pool, TokenToKVPool)):
            if not isinstance(value, cls):
                fail(f"KVCacheManager({name})", f"a {cls.__name__}", describe(value), error=PoolError)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.page_size = token_to_kv_pool.page_size
        self.allocator = token_to_kv_pool.allocator  # shared: listeners on the pool hear the manager's frees
        self.requests: dict[int, Request] = {}
        self._next_rid = 0

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
        _check_request("slot_of(req)", req)
        t = check_int("slot_of(t)", t, low=0, high=req.seq_len - 1, error=PoolError)
        return req.pages[t // self.page_size] * self.page_size + t % self.page_size

    def admit(self, num_tokens: int) -> Request:
        """Take a request slot and enough pages for ``num_tokens`` tokens; fill its req_to_token row."""
        num_tokens = check_int("admit(num_tokens)", num_tokens, low=0, error=PoolError)
        self._check_fits(num_tokens)
        need = -(-num_tokens // self.page_size)
        if need > self.allocator.available_pages():
            # Check before taking the request slot so a failed admit leaves nothing behind.
            self.allocator.alloc(need)
        (slot,) = self.req_to_token_pool.alloc(1)
        req = Request(rid=self._next_rid, req_pool_idx=slot, seq_len=0)
        self._next_rid += 1
        self.requests[req.rid] = req
        self.grow(req, num_tokens)
        return req

    def grow(self, req: Request, num_tokens: int = 1) -> torch.Tensor:
        """Append ``num_tokens`` tokens to ``req``; returns their physical slots (int64)."""
        _check_request("grow(req)", req)
        if req.released:
            raise PoolError(f"grow: request {req.rid} was released; admit a new request instead.")
        self._check_owned("grow", req)
        num_tokens = check_int("grow(num_tokens)", num_tokens, low=0, error=PoolError)
        new_len = req.seq_len + num_tokens
        self._check_fits(new_len)
        need = -(-new_len // self.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need))
        t = torch.arange(req.seq_len, new_len)
        pages = torch.tensor(req.pages, dtype=torch.int64) if req.pages else torch.zeros(0, dtype=torch.int64)
        slots = pages[t // self.page_size] * self.page_size + t % self.page_size
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[req.seq_len:new_len] = slots.to(row.device, torch.int32)
        req.seq_len = new_len
        return slots.to(self.req_to_token_pool.device)

    def release(self, req: Request) -> None:
        """Free the request's pages and its req_to_token row; both become reusable.

        All or nothing: if the page free fails (e.g. a free listener raised), the request stays
        live and unchanged, and ``release`` may be retried.
        """
        _check_request("release(req)", req)
        if req.released:
            raise PoolError(f"release: request {req.rid} was already released (double free).")
        self._check_owned("release", req)
        assert not self.req_to_token_pool._is_free[req.req_pool_idx], "a live request owns its row"
        self.allocator.free(req.pages)
        self.req_to_token_pool.free([req.req_pool_idx])
        req.released = True
        req.pages = []
        del self.requests[req.rid]

    def _check_owned(self, what: str, req: Request) -> None:
        if self.requests.get(req.rid) is not req:
            raise PoolError(
                f"{what}: request {req.rid} (req_pool_idx {req.req_pool_idx}) was not admitted by this "
                "KVCacheManager. Fix: use the manager whose admit() returned it."
            )

    def pages_needed(self, req: Request, num_tokens: int = 1) -> int:
        """How many new pages growing ``req`` by ``num_tokens`` tokens takes (0 while its last page has room)."""
        _check_request("pages_needed(req)", req)
        num_tokens = check_int("pages_needed(num_tokens)", num_tokens, low=0, error=PoolError)
        return max(0, -(-(req.seq_len + num_tokens) // self.page_size) - len(req.pages))

    def _check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.req_to_token_pool.max_context_len:
            raise PoolError(
                f"request of {num_tokens} tokens exceeds max_context_len "
                f"{self.req_to_token_pool.max_context_len} of the ReqToTokenPool. "
                "Fix: build the pool with a larger max_context_len."
            )
