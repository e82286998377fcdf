"""Argument checks for the public entry points, in one place.

Every public function of ``sparse_ref`` and every kernel launcher in ``sparse_ref.kernels``
checks its arguments with these helpers at the entry point, before any kernel launch. A failed
check raises a ``SparseRefError`` subclass whose message says:

    <argument>: expected <what>, got <what arrived>. Fix: <how to fix it>

Internal invariants (things no caller can break) are plain ``assert`` statements instead, so
the reading path of the algorithms stays short.

Checks that read tensor *values* (ranges of ids and lengths) need a host sync; they are
skipped while a CUDA graph captures (``capturing()``), where the launchers' own clamps keep
every access in bounds.

This module is a leaf (it imports only torch and ``sparse_ref.errors``), so kernel files may
import it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import NoReturn

import torch

from sparse_ref.errors import (
    SEED_DSA_REQUIRED,
    BatchError,
    ConfigError,
    PoolError,
    RetrievalError,
    ShapeError,
    SparseRefError,
)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def capturing() -> bool:
    """True while a CUDA graph is being captured: then no check may read device data."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def describe(x) -> str:
    """A short description of a value for error messages (tensors by shape, dtype and device)."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__} {x!r}"[:200]


def fail(name: str, expected: str, got: str, fix: str = "", error: type[SparseRefError] = ShapeError) -> NoReturn:
    """Raise ``error`` with the standard message: argument, what was expected, what arrived, the fix."""
    tail = f" Fix: {fix}" if fix else ""
    raise error(f"{name}: expected {expected}, got {got}.{tail}")


def check_int(name: str, value, *, low: int | None = None, high: int | None = None, fix: str = "",
              error: type[SparseRefError] = ConfigError) -> int:
    """``value`` as a Python int, refusing bools, floats, strings and anything outside ``[low, high]``.

    Integer-valued 0-d tensors and numpy integers are accepted (and converted).
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, "an int", describe(value), fix, error)
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        fail(name, f"an int in [{lo}, {hi}]", repr(value), fix, error)
    return value


def check_float(name: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, fix: str = "", error: type[SparseRefError] = ConfigError) -> float:
    """``value`` as a finite Python float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    lo, hi = "-inf" if low is None else low, "inf" if high is None else high
    want = f"a finite number in {'(' if low_open else '['}{lo}, {hi}]"
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    try:  # (an int too large for a float overflows: refuse it like infinity)
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        fail(name, want, describe(value), fix, error)
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        fail(name, want, repr(value), fix, error)
    return value


def check_choice(name: str, value, choices, fix: str = "", error: type[SparseRefError] = ConfigError):
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, (str, int)) or value not in choices:
        fail(name, f"one of {tuple(choices)}", repr(value), fix, error)
    return value


def check_device(name: str, device, error: type[SparseRefError] = ConfigError) -> torch.device:
    """``device`` as a ``torch.device`` that holds data (cpu or cuda; not meta, not a typo)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        fail(name, "a device such as 'cpu' or 'cuda'", describe(device), error=error)
    if dev.type == "meta":
        fail(name, "a device with data (cpu or cuda)", "meta", error=error)
    return dev


def check_tensor(name: str, t, *, dtype=None, dims=None, shape=None, device=None, contiguous: bool = False,
                 fix: str = "", error: type[SparseRefError] = ShapeError) -> torch.Tensor:
    """``t`` if it is a tensor with the given dtype(s), rank(s), shape, device type and layout.

    * ``dtype``: one dtype or a tuple of them;
    * ``dims``: an int rank or a tuple of ranks;
    * ``shape``: a tuple whose ``None`` entries match any size (implies the rank);
    * ``device``: a device or device type the tensor must live on (the type is compared).
    """
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", describe(t), fix, error)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            fail(name, "dtype " + " or ".join(str(d) for d in allowed), str(t.dtype), fix, error)
    if dims is not None:
        ranks = dims if isinstance(dims, tuple) else (dims,)
        if t.dim() not in ranks:
            fail(name, "a " + " or ".join(f"{d}-D" for d in ranks) + " tensor", f"shape {tuple(t.shape)}",
                 fix, error)
    if shape is not None:
        ok = t.dim() == len(shape) and all(w is None or w == g for w, g in zip(shape, t.shape, strict=False))
        if not ok:
            want = "[" + ", ".join("any" if w is None else str(w) for w in shape) + "]"
            fail(name, f"shape {want}", f"shape {tuple(t.shape)}", fix, error)
    if device is not None and t.device.type != torch.device(device).type:
        fail(name, f"a tensor on {torch.device(device).type}", f"one on {t.device}", fix, error)
    if t.device.type == "meta":
        fail(name, "a tensor with data (cpu or cuda)", "a meta tensor", fix, error)
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}", f"pass {name}.contiguous().", error)
    return t


def check_same_device(fn: str, reference: str, tensors: dict, error: type[SparseRefError] = ShapeError) -> None:
    """Every tensor in ``tensors`` (name -> tensor or None) lives on the device of ``tensors[reference]``."""
    device = tensors[reference].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            fail(f"{fn}: {name}", f"a tensor on {device} (the device of {reference})", f"one on {t.device}",
                 f"move it with {name}.to({str(device)!r}).", error)


def check_rows(name: str, t: torch.Tensor, rows: int, what: str = "one per request",
               error: type[SparseRefError] = ShapeError) -> None:
    """``t`` has ``rows`` entries along its first dimension."""
    if t.dim() == 0 or t.shape[0] != rows:
        fail(name, f"{rows} rows ({what})", f"shape {tuple(t.shape)}", error=error)


def check_range(name: str, t: torch.Tensor, low: int, high: int, fix: str = "",
                error: type[SparseRefError] = ShapeError) -> None:
    """Every value of integer tensor ``t`` lies in ``[low, high]`` (one host sync; skipped while capturing)."""
    if t.numel() == 0 or capturing():
        return
    lo, hi = (int(x) for x in t.aminmax()) if t.dtype != torch.bool else (0, 1)
    if lo < low or hi > high:
        fail(name, f"values in [{low}, {high}]", f"min {lo}, max {hi}", fix, error)


# =============================================================================================
# Entry-point checks, one function per public entry point, grouped by the module that calls them.
# Each returns the values it normalised (ints as Python ints, devices as torch.device), so the
# caller uses exactly what was checked. Classes of the package are imported inside the functions:
# this module stays a leaf that every other module may import.
# =============================================================================================

# --------------------------------------------------------------------------------------------- memory.py
def check_index_list(name: str, indices, error: type[SparseRefError] = PoolError) -> list[int]:
    """Ints from an int, a sequence of ints or an integer tensor; anything else (floats too) raises."""
    if isinstance(indices, torch.Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            fail(name, "an integer tensor", f"dtype {indices.dtype}", error=error)
        return indices.reshape(-1).tolist()
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        indices = [indices]
    return [check_int(name, i, error=error) for i in indices]


def check_fits_memory(what: str, nbytes: int) -> None:
    if nbytes > 2**45:
        fail(what, "buffers that fit in a machine's memory (at most 32 TiB)", f"a request for {nbytes} bytes",
             "check the sizes: a typo in one of them multiplies the whole allocation.", PoolError)


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


def check_free(free_list, name: str, ids) -> list[int]:
    """``ids`` as a list, each allocated now and named once; else PoolError (nothing changes)."""
    ids = check_index_list(name, ids)
    first, size, what = free_list._first, free_list._size, free_list._what
    for i in ids:
        if i == 0 < first:
            raise PoolError(f"{name}: page 0 is the reserved padding page and is never allocated.")
        if not first <= i < size:
            raise PoolError(f"{name}: {what} {i} is out of range [{first}, {size}).")
        if free_list._is_free[i]:
            raise PoolError(f"{name}: {what} {i} is already free (double free).")
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
        raise PoolError(
            f"PageAllocator.free: the free listener {callback!r} raised {type(e).__name__}: {e}. No page was "
            f"freed; pages {pages} are still allocated. Fix: fix the listener, then free again."
        ) from e


def check_kv_pool(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype, device):
    """``(num_layers, num_kv_heads, head_dim, device)`` of a ``TokenToKVPool`` (its allocator checked the pages)."""
    num_layers = check_int("TokenToKVPool(num_layers)", num_layers, low=1, error=PoolError)
    num_kv_heads = check_int("TokenToKVPool(num_kv_heads)", num_kv_heads, low=1, error=PoolError)
    head_dim = check_int("TokenToKVPool(head_dim)", head_dim, low=1, error=PoolError)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail("TokenToKVPool(dtype)", "a floating torch.dtype such as torch.float16", describe(dtype),
             "pass the dtype object, e.g. dtype=torch.bfloat16, not a string.", PoolError)
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
    from sparse_ref.memory import Request

    if not isinstance(req, Request):
        fail(name, "a Request returned by KVCacheManager.admit", describe(req), error=PoolError)


def check_owned(manager, what: str, req) -> None:
    if manager.requests.get(req.rid) is not req:
        raise PoolError(
            f"{what}: request {req.rid} (req_pool_idx {req.req_pool_idx}) was not admitted by this "
            "KVCacheManager. Fix: use the manager whose admit() returned it."
        )


def check_fits(manager, num_tokens: int) -> None:
    if num_tokens > manager.req_to_token_pool.max_context_len:
        raise PoolError(
            f"request of {num_tokens} tokens exceeds max_context_len "
            f"{manager.req_to_token_pool.max_context_len} of the ReqToTokenPool. "
            "Fix: build the pool with a larger max_context_len."
        )


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
    from sparse_ref.config import IndexerConfig

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
        raise BatchError(
            f"request {i} (req_to_token row {int(req_pool_indices[i])}): the indexer cache of layer {layer_id} "
            f"holds no key for positions {where[:8].tolist()}{'...' if where.numel() > 8 else ''} of its "
            "history. Fix: run the indexer over every earlier chunk (prefix) of the request first."
        )


# --------------------------------------------------------------------------------------------- config.py
def check_sparse_config(config) -> dict:
    """The checked, normalised fields of a ``SparseConfig`` (plain ints and floats: never a tensor or numpy scalar)."""
    from sparse_ref.config import GQA_MODES

    if config.keep_ratio is not None and config.page_budget is not None:
        fail("SparseConfig", "exactly one of keep_ratio and page_budget",
             f"keep_ratio={config.keep_ratio} and page_budget={config.page_budget} were both given",
             "pass keep_ratio=None or page_budget=None.", ConfigError)
    ratio = 0.25 if config.keep_ratio is None and config.page_budget is None else config.keep_ratio
    fields = {"keep_ratio": None if ratio is None else
              check_float("SparseConfig.keep_ratio", ratio, low=0, high=1, low_open=True),
              "page_budget": None if config.page_budget is None else
              check_int("SparseConfig.page_budget", config.page_budget, low=1, high=INT32_MAX)}
    fields["num_recent_pages"] = check_int(
        "SparseConfig.num_recent_pages", config.num_recent_pages, low=1, high=INT32_MAX,
        fix="The last page holds the token being decoded, so at least 1 recent page is always kept.")
    fields["num_sink_pages"] = check_int("SparseConfig.num_sink_pages", config.num_sink_pages, low=0, high=INT32_MAX)
    fields["min_sparse_seq_len"] = check_int("SparseConfig.min_sparse_seq_len", config.min_sparse_seq_len, low=0,
                                             high=INT32_MAX)
    fields["gqa_mode"] = check_choice("SparseConfig.gqa_mode", config.gqa_mode, GQA_MODES)
    return fields


def check_indexer_config(c) -> None:
    for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "index_topk", "block_size"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"IndexerConfig.{name}: expected a positive int, got {value!r}.")
    for name in ("use_fp8", "ue8m0", "rope_interleaved"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"IndexerConfig.{name}: expected True or False, got {getattr(c, name)!r}.")
    if c.head_dim & (c.head_dim - 1):
        raise ConfigError(
            f"IndexerConfig.head_dim: expected a power of two (the fast Hadamard transform needs one), "
            f"got {c.head_dim}. Fix: use 32, 64, 128, ..."
        )
    r = c.rope_dim
    if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r % 2 or r > c.head_dim:
        raise ConfigError(
            f"IndexerConfig.rope_dim: expected an even int in [0, head_dim={c.head_dim}] (RoPE rotates "
            f"pairs of dims), got {r!r}."
        )
    if c.block_size < c.head_dim:
        raise ConfigError(
            f"IndexerConfig.block_size: expected >= head_dim={c.head_dim}, got {c.block_size}. The score "
            "folds one q scale per (token, head) into the head weights and multiplies one k scale per token, "
            "so each head_dim vector must be a single FP8 block. Fix: block_size=128 with head_dim <= 128."
        )
    theta = c.rope_theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1.0 < theta < math.inf:
        raise ConfigError(f"IndexerConfig.rope_theta: expected a finite number > 1, got {theta!r}.")
    eps = c.layer_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ConfigError(f"IndexerConfig.layer_norm_eps: expected a finite number > 0, got {eps!r}.")


# --------------------------------------------------------------------------------------------- batch.py
EXTEND_FIELDS = ("extend_prefix_lens", "extend_seq_lens")
_FIX_BUILD = "build the batch with build_extend_batch / build_decode_batch."


def check_forward_batch(fb) -> None:
    """Every field of a ``ForwardBatch`` once: types, one device, shapes, ranges, the mode's rules."""
    from sparse_ref.batch import ForwardMode

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
    if capturing():
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


def _int_or_none(value) -> int | None:
    """``value`` as an int (numpy/torch integer scalars too), or None for floats, bools and the rest."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_requests(manager, requests) -> None:
    from sparse_ref.memory import KVCacheManager, Request

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
    for i, (r, given) in enumerate(zip(requests, prefix_lens, strict=True)):
        p = _int_or_none(given)
        if p is None or not 0 <= p <= r.seq_len:
            raise BatchError(
                f"prefix_lens[{i}]: expected an int in [0, seq_len={r.seq_len}] for request {r.rid}, "
                f"got {given!r}."
            )
        prefix_lens[i] = p
    return prefix_lens


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


# --------------------------------------------------------------------------------------------- selection.py
def check_config(config):
    """``config`` if it is a ``SparseConfig`` (validated and frozen at construction)."""
    from sparse_ref.config import SparseConfig

    if not isinstance(config, SparseConfig):
        fail("config", "a SparseConfig", describe(config), "build one with SparseConfig(...).", ConfigError)
    return config


def check_topk_reference(scores, k, lengths, order, width):
    """``(lengths int64 [R], k_row int64 [R], width)`` of a ``topk_reference`` call."""
    check_tensor("scores", scores, dtype=FLOAT_DTYPES, dims=2)
    check_choice("order", order, ("score", "index"))
    R, N = scores.shape
    device = scores.device
    if lengths is None:
        lengths = torch.full((R,), N, dtype=torch.int64, device=device)
    check_tensor("lengths", lengths, dtype=INDEX_DTYPES, dims=1)
    check_rows("lengths", lengths, R, "one per row of scores")
    check_range("lengths", lengths, 0, N, f"a row has at most {N} entries (scores.shape[1]).")
    if isinstance(k, torch.Tensor) and k.dim() > 0:
        check_tensor("k", k, dtype=INDEX_DTYPES, dims=1, fix="pass an int, or one k per row.")
        check_rows("k", k, R, "one per row of scores")
        check_range("k", k, 0, INT64_MAX)
        k_row = k.to(torch.int64)
        default_width = int(k_row.max()) if R else 0
    else:
        default_width = check_int("k", k, low=0, high=INT64_MAX, error=ShapeError)
        k_row = torch.full((R,), default_width, dtype=torch.int64, device=device)
    check_same_device("topk_reference", "scores", {"scores": scores, "lengths": lengths, "k": k_row})
    if width is None:  # the output is k wide (-1 padded): a k beyond int32 needs an explicit width
        width = check_int("k", default_width, high=INT32_MAX, error=ShapeError,
                          fix="the output width defaults to k; pass width= (at most 2**31 - 1) for a larger k.")
    width = check_int("width", width, low=0, high=INT32_MAX, error=ShapeError)
    return lengths.to(device, torch.int64), k_row, width


def check_selection_width(max_pages, config) -> int:
    check_config(config)
    return check_int("max_pages", max_pages, low=0, high=INT32_MAX, error=ShapeError)


def check_selection_inputs(scores, seq_lens, sparse_mask, page_size, config) -> int:
    """Type, shape, dtype, device and range checks shared by every page-selection implementation; the page size."""
    check_tensor("scores", scores, dtype=FLOAT_DTYPES, dims=2,
                 fix="pass one score per logical page, shape [bs, max_pages].")
    bs, max_pages = scores.shape
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1)
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, dims=1)
    check_rows("seq_lens", seq_lens, bs, "one per row of scores")
    check_rows("sparse_mask", sparse_mask, bs, "one per row of scores")
    check_same_device("page selection", "scores", {"scores": scores, "seq_lens": seq_lens, "sparse_mask": sparse_mask})
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    check_config(config)
    check_range("seq_lens", seq_lens, 0, max_pages * page_size,
                f"scores cover {max_pages} pages of {page_size} tokens: score every page of the longest request.")
    return page_size


def check_select_pages(scores, seq_lens, sparse_mask, page_size, config, width) -> tuple[int, int | None]:
    """``(page_size, width)`` of a ``select_pages`` call, as ints."""
    page_size = check_selection_inputs(scores, seq_lens, sparse_mask, page_size, config)
    if width is not None:
        W = config.selection_width(scores.shape[1])
        width = check_int("width", width, low=W, error=ShapeError,
                          fix=f"leave width=None: selection_width is {W} here, and a narrower output would cut rows "
                          "off.")
    return page_size, width


def check_select_pages_row(scores_row, seq_len, page_size, config) -> tuple[int, int]:
    check_tensor("scores_row", scores_row, dtype=FLOAT_DTYPES, dims=1)
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    check_config(config)
    seq_len = check_int("seq_len", seq_len, low=0, high=scores_row.shape[0] * page_size, error=ShapeError,
                        fix=f"{scores_row.shape[0]} scored pages of {page_size} tokens: score the whole request.")
    return page_size, seq_len


# --------------------------------------------------------------------------------------------- adaptor.py
def check_attention_metadata(selected, lengths, sparse_mask, forward_batch, req_to_token, page_size, out,
                             backend) -> int:
    """The adaptor's inputs: types, shapes, devices, then every value (``check_selection_values``); the page size."""
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2,
                 fix="pass the selection returned by retrieve_topk, int32 [bs, W].")
    bs, width = selected.shape
    seq_lens = getattr(forward_batch, "seq_lens", None)
    rows = getattr(forward_batch, "req_pool_indices", None)
    tensors = {"selected": selected, "lengths": lengths, "sparse_mask": sparse_mask, "forward_batch.seq_lens": seq_lens,
               "forward_batch.req_pool_indices": rows}
    for name, t in list(tensors.items())[1:]:
        check_tensor(name, t, dtype=torch.bool if name == "sparse_mask" else INDEX_DTYPES, dims=1,
                     fix="pass the ForwardBatch of this step." if "." in name else "")
        check_rows(name, t, bs, "one per row of selected")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2)
    check_same_device("to_attention_metadata", "selected", {**tensors, "req_to_token": req_to_token})
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    w_out = max(width, -(-req_to_token.shape[1] // page_size))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail("out", "a tuple (page_table, kv_lens, cu_kv_lens) of preallocated buffers", describe(out))
        for name, t, shape in (("page_table", out[0], (bs, w_out)), ("kv_lens", out[1], (bs,)),
                               ("cu_kv_lens", out[2], (bs + 1,))):
            check_tensor(f"out {name}", t, dtype=torch.int32, shape=shape, device=selected.device)
    check_choice("backend", backend, ("auto", "torch", "triton"), "leave backend='auto'.", SparseRefError)
    check_selection_values(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size, "forward_batch.")
    return page_size


def check_tokens_on_real_pages(seq_lens, rows, req_to_token, page_size: int, name: str = "seq_lens") -> None:
    """Eager: every token ``[0, seq_len)`` of each row lies on a real page (req_to_token never names page 0)."""
    if seq_lens.numel() == 0 or capturing():
        return
    t = torch.arange(req_to_token.shape[1], device=req_to_token.device)
    padding = (t[None, :] < seq_lens.to(t.device)[:, None]) & (req_to_token[rows.to(t.device).long()] < page_size)
    if bool(padding.any()):
        r, tok = (int(x) for x in padding.nonzero()[0])
        fail(name, "lengths within each request's tokens", f"row {r} has seq_len {int(seq_lens[r])} but token {tok} "
             "maps to padding page 0", "pass the batch built for these requests.")


def check_selection_values(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size: int,
                           batch: str = "") -> None:
    """Eager value checks of a selection against its batch (host syncs; skipped while a graph captures): lengths
    and rows in range, every token of a request on a real page, each sparse row naming only its own pages, in
    order, once, its last page last. ``batch``: the prefix of the batch fields' names in messages."""
    bs, width = selected.shape
    if bs == 0 or capturing():
        return
    check_range(f"{batch}seq_lens", seq_lens, 0, req_to_token.shape[1])
    check_range(f"{batch}req_pool_indices", rows, 0, req_to_token.shape[0] - 1)
    check_range("lengths", lengths, 0, width, "(the width of selected).")
    check_tokens_on_real_pages(seq_lens, rows, req_to_token, page_size, f"{batch}seq_lens")
    n = -(-seq_lens.long() // page_size)  # pages per request
    cols = torch.arange(width, device=selected.device)
    live = cols[None, :] < lengths[:, None]
    sparse = sparse_mask & (lengths > 0)
    bad = sparse[:, None] & live & ((selected < 0) | (selected >= n[:, None]))
    bad |= sparse[:, None] & ~live & (selected != -1)
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(
            f"selected: row {r} entry {j} is {int(selected[r, j])}; expected its first lengths[r]={int(lengths[r])} "
            f"entries in [0, {int(n[r])}) (ceil(seq_len / page_size) pages of that request) and -1 after. "
            "A request may only name its own pages. Fix: pass the (selected, lengths) of retrieve_topk unchanged."
        )
    ids = torch.where(live & sparse[:, None], selected.long(), torch.full_like(selected, -1, dtype=torch.long))
    ids = torch.sort(ids, dim=1).values
    if bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any()):
        raise ShapeError("selected: a row names the same page twice; each kept page must appear once.")
    if page_size > 1 and width > 0:  # (width 0: every length is 0, every row dense)
        last = selected.long().gather(1, (lengths.long() - 1).clamp(min=0)[:, None]).squeeze(1)
        wrong = sparse & (last != n - 1)
        if bool(wrong.any()):
            r = int(wrong.nonzero()[0, 0])
            raise ShapeError(
                f"selected: row {r} ends with page {int(last[r])}, not its last page {int(n[r] - 1)}. The KV length "
                "(len - 1) * P + last_page_len needs the last (partial) page kept last. Fix: keep num_recent_pages "
                ">= 1 and pass the ascending selection of retrieve_topk."
            )




# --------------------------------------------------------------------------------------------- algorithms/base.py
_FIX_SEQ_LENS = (
    "Fix: pass the batch through, retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, "
    "forward_batch=forward_batch), where forward_batch.seq_lens (int64 [bs]) holds each request's current "
    "length, including the token being decoded."
)


def check_forward_batch_kwarg(kwargs: dict):
    """The ``forward_batch`` keyword, checked to carry ``seq_lens``; else the seed error, then what arrived."""
    from sparse_ref.errors import SEED_TOPK_NEEDS_SEQ_LENS

    if "forward_batch" not in kwargs:
        got = f"got kwargs {sorted(kwargs)} and no forward_batch"
    elif kwargs["forward_batch"] is None:
        got = "got forward_batch=None"
    elif not hasattr(kwargs["forward_batch"], "seq_lens"):
        got = f"forward_batch of type {type(kwargs['forward_batch']).__name__} has no seq_lens"
    elif kwargs["forward_batch"].seq_lens is None:
        got = f"forward_batch of type {type(kwargs['forward_batch']).__name__} has seq_lens=None"
    else:
        return kwargs["forward_batch"]
    raise RetrievalError(f"{SEED_TOPK_NEEDS_SEQ_LENS}: {got}. {_FIX_SEQ_LENS}")


def check_algorithm(config, device, selection_backend, backends) -> torch.device:
    from sparse_ref.config import SparseConfig

    if config is not None and not isinstance(config, SparseConfig):
        fail("config", "a SparseConfig or None", describe(config), error=ConfigError)
    check_choice("selection_backend", selection_backend, backends)
    return check_device("device", device)


def check_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool) -> tuple[int, int, int]:
    """``(start_layer, end_layer, page_size)`` of ``initialize_representation_pool``."""
    page_size = check_int("token_to_kv_pool.page_size", getattr(token_to_kv_pool, "page_size", None), low=1,
                          error=PoolError, fix="pass the engine's TokenToKVPool.")
    check_tensor("req_to_token_pool.req_to_token", getattr(req_to_token_pool, "req_to_token", None),
                 dtype=torch.int32, dims=2, fix="pass the engine's ReqToTokenPool.", error=PoolError)
    fix = "end_layer is exclusive: to serve layers 0..L-1, pass start_layer=0, end_layer=L."
    start_layer = check_int("start_layer", start_layer, low=0, error=PoolError, fix=fix)
    end_layer = check_int("end_layer", end_layer, low=start_layer + 1, error=PoolError, fix=fix,
                          high=getattr(token_to_kv_pool, "num_layers", None))
    return start_layer, end_layer, page_size


def check_algorithm_layer(algo, layer_id) -> None:
    """PoolError unless the pools are set up and ``start_layer <= layer_id < end_layer``."""
    if algo.req_to_token_pool is None:
        raise PoolError(
            f"{type(algo).__name__}: the representation pool is not initialized. Fix: call "
            "initialize_representation_pool(start_layer, end_layer, token_to_kv_pool, req_to_token_pool) first."
        )
    if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not (
            algo.start_layer <= layer_id < algo.end_layer):
        raise PoolError(
            f"layer_id: expected an int in [{algo.start_layer}, {algo.end_layer}) (end_layer is exclusive), "
            f"got {layer_id!r}. Fix: call the algorithm only for the layers it was initialized with."
        )


def check_algorithm_batch(algo, fn: str, forward_batch) -> None:
    """``forward_batch`` is a ``ForwardBatch`` whose rows and lengths fit the algorithm's req_to_token."""
    from sparse_ref.batch import ForwardBatch

    if not isinstance(forward_batch, ForwardBatch):
        fail(f"{fn}: forward_batch", "a sparse_ref.ForwardBatch", describe(forward_batch),
             "build it with build_extend_batch / build_decode_batch.", BatchError)
    size, max_len = algo.req_to_token_pool.req_to_token.shape
    check_range("forward_batch.req_pool_indices", forward_batch.req_pool_indices, 0, size - 1,
                "pass rows of this algorithm's req_to_token.", BatchError)
    check_range("forward_batch.seq_lens", forward_batch.seq_lens, 0, max_len,
                f"lengths are at most max_context_len={max_len} of req_to_token.", BatchError)
    check_batch_slots(algo.req_to_token_pool.req_to_token, forward_batch)


def check_retrieve(algo, queries, layer_id, req_pool_indices, sparse_mask, kwargs: dict):
    """The inputs of a page algorithm's ``retrieve_topk``; returns the checked ``forward_batch``.

    Shape and dtype checks cost no sync; value checks are skipped while a graph captures.
    """
    forward_batch = check_forward_batch_kwarg(kwargs)
    check_algorithm_layer(algo, layer_id)
    seq_lens, batch_rows = forward_batch.seq_lens, getattr(forward_batch, "req_pool_indices", None)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, dims=1,
                 fix="pass forward_batch.req_pool_indices.")
    bs = req_pool_indices.shape[0]
    check_tensor("queries", queries, dtype=FLOAT_DTYPES, dims=(2, 3),
                 fix="pass one query per request, [bs, H_q*D] or [bs, H_q, D].")
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, dims=1,
                 fix="pass a bool tensor [bs], True for rows that may go sparse.")
    check_tensor("forward_batch.seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1)
    check_tensor("forward_batch.req_pool_indices", batch_rows, dtype=INDEX_DTYPES, dims=1)
    for name, t in (("queries", queries), ("sparse_mask", sparse_mask), ("forward_batch.seq_lens", seq_lens),
                    ("forward_batch.req_pool_indices", batch_rows)):
        check_rows(name, t, bs, "one per entry of req_pool_indices")
    check_same_device("retrieve_topk", "req_pool_indices", {
        "req_pool_indices": req_pool_indices, "queries": queries, "sparse_mask": sparse_mask,
        "forward_batch.seq_lens": seq_lens, "forward_batch.req_pool_indices": batch_rows})
    if bs == 0 or capturing():
        return forward_batch
    size, max_len = algo.req_to_token_pool.req_to_token.shape
    check_range("req_pool_indices", req_pool_indices, 0, size - 1, "pass rows of req_to_token.")
    check_range("forward_batch.seq_lens", seq_lens, 0, max_len,
                f"lengths are at most max_context_len={max_len} of req_to_token.")
    if not torch.equal(req_pool_indices.long(), batch_rows.long()):
        fail("req_pool_indices", f"forward_batch.req_pool_indices {batch_rows.tolist()} (the same requests, in "
             "the same order: seq_lens bound each row)", str(req_pool_indices.tolist()),
             "pass forward_batch.req_pool_indices, or build the batch for these requests.", RetrievalError)
    from sparse_ref.batch import ForwardBatch

    if isinstance(forward_batch, ForwardBatch):
        check_batch_slots(algo.req_to_token_pool.req_to_token, forward_batch)
    return forward_batch


def check_retrieve_metadata(algo, queries, layer_id, forward_batch, algorithm_cls):
    """What ``retrieve_attention_metadata`` needs before it picks a path (the path checks the rest)."""
    if not isinstance(algo, algorithm_cls):
        fail("algo", "a sparse algorithm (sparse_ref.create_sparse_algorithm)", describe(algo),
             "pass the layer's algorithm.")
    forward_batch = check_forward_batch_kwarg({"forward_batch": forward_batch})
    check_tensor("queries", queries, dtype=FLOAT_DTYPES, dims=(2, 3),
                 fix="pass one query per request, [bs, H_q*D] or [bs, H_q, D].")
    if type(algo).retrieve_topk is algorithm_cls.retrieve_topk:  # a page algorithm: initialised for this layer
        algo.check_layer(layer_id)
    return forward_batch


# --------------------------------------------------------------------------------------------- algorithms/quest.py
def check_quest_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages) -> None:
    """The inputs of ``quest_page_scores_reference``: shapes that agree, and every page id in ``[0, num_pages)``."""
    check_tensor("page_min", page_min, dtype=FLOAT_DTYPES, dims=3, fix="pass the bounds [num_pages, H_kv, D].")
    num_pages, h_kv, d = page_min.shape
    check_tensor("page_max", page_max, dtype=FLOAT_DTYPES, shape=(num_pages, h_kv, d), device=page_min.device.type)
    check_tensor("page_valid", page_valid, dtype=torch.bool, shape=(num_pages,), device=page_min.device.type)
    check_tensor("pages", pages, dtype=INDEX_DTYPES, dims=2, device=page_min.device.type,
                 fix="pass physical pages [bs, max_pages] (req_to_token at each page's first token // page_size).")
    for name, q in (("q_pos", q_pos), ("q_neg", q_neg)):
        check_tensor(name, q, dtype=FLOAT_DTYPES, shape=(pages.shape[0], h_kv, d), device=page_min.device.type,
                     fix="pass split_query_sign(queries) [bs, H_kv, D].")
    check_range("pages", pages, 0, num_pages - 1, f"physical page ids lie in [0, {num_pages}) (page 0 is padding).")


def check_quest_queries(queries, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Decode queries as ``[bs, H_q, D]``; SGLang's Quest messages (verbatim, then the fix) for shapes it refuses."""
    bs = queries.shape[0]
    if queries.dim() == 2:
        hidden = queries.shape[1]
        if hidden % head_dim != 0:
            raise ShapeError(
                f"Quest query hidden size {hidden} not divisible by head_dim {head_dim}. Fix: pass queries as "
                f"[bs, H_q * {head_dim}] (all query heads of the layer, flattened) or as [bs, H_q, {head_dim}]."
            )
        queries = queries.reshape(bs, hidden // head_dim, head_dim)
    elif queries.dim() != 3 or queries.shape[2] != head_dim:
        raise ShapeError(
            f"Unsupported query shape for Quest: {tuple(queries.shape)}. Fix: pass one decode query per request, "
            f"[bs, H_q * {head_dim}] or [bs, H_q, {head_dim}] (head_dim of the KV pool is {head_dim})."
        )
    num_q_heads = queries.shape[1]
    if num_q_heads % num_kv_heads != 0 or num_q_heads == 0:
        raise ShapeError(
            f"Query heads {num_q_heads} not divisible by KV heads {num_kv_heads}. Fix: pass all H_q query heads of "
            f"the layer; with grouped-query attention H_q must be a multiple of the pool's {num_kv_heads} KV heads."
        )
    return queries


def check_quest(bounds_dtype, scoring_backend, bounds_dtypes, scoring_backends) -> None:
    if bounds_dtype not in bounds_dtypes:
        raise ConfigError(
            f"bounds_dtype: expected one of {bounds_dtypes}, got {bounds_dtype!r}. Fix: torch.float32 (exact "
            f"bounds), or torch.bfloat16 / torch.float16 (half the bytes to score; min rounded down, max up)."
        )
    if not isinstance(scoring_backend, str) or scoring_backend not in scoring_backends:
        raise ConfigError(
            f"scoring_backend: expected one of {scoring_backends}, got {scoring_backend!r}. Fix: \"auto\" (Triton "
            f"kernel on CUDA, torch otherwise), \"torch\" (the reference) or \"triton\" (the kernel; on CPU it "
            f"needs TRITON_INTERPRET=1)."
        )


def check_quest_allocators(token_to_kv_pool, page_allocator) -> list:
    """The allocators whose frees Quest must hear: the pool's own (required) and an extra one (optional)."""
    allocators = [a for a in (getattr(token_to_kv_pool, "allocator", None), page_allocator) if a is not None]
    if not allocators or not all(callable(getattr(a, "add_free_listener", None)) for a in allocators):
        fail("token_to_kv_pool.allocator", "a PageAllocator (with add_free_listener) that frees its pages",
             describe(getattr(token_to_kv_pool, "allocator", None)),
             "pass a sparse_ref.TokenToKVPool (it carries its allocator), or set pool.allocator.", PoolError)
    return allocators


def check_quest_hook(algo, fn: str, layer_id, forward_batch, k_buffer) -> torch.Tensor:
    """The inputs of ``construct_representations`` (EXTEND) / ``update_representations`` (DECODE); returns
    ``k_buffer`` ``[num_pages * P, H_kv, D]`` seen as ``[num_pages, P, H_kv, D]``."""
    from sparse_ref.batch import ForwardMode

    check_algorithm_layer(algo, layer_id)
    check_algorithm_batch(algo, fn, forward_batch)
    want_mode, other = ((ForwardMode.EXTEND, "after a decode step call update_representations") if
                        fn == "construct_representations" else
                        (ForwardMode.DECODE, "after a prefill call construct_representations"))
    if forward_batch.forward_mode is not want_mode:
        article = "an" if want_mode is ForwardMode.EXTEND else "a"
        raise BatchError(f"{fn}: expected {article} {want_mode.name} batch, got {forward_batch.forward_mode}. "
                         f"Fix: {other} instead.")
    want = (algo.num_pages * algo.page_size, algo.num_kv_heads, algo.head_dim)
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, shape=want, device=algo.device.type,
                 fix="pass token_to_kv_pool.get_key_buffer(layer_id).")
    return k_buffer.view(algo.num_pages, algo.page_size, algo.num_kv_heads, algo.head_dim)


def check_real_pages(algo, pages: torch.Tensor, write: torch.Tensor | None = None) -> None:
    """Pages whose bounds are about to be built (where ``write``) hold real tokens: never padding page 0."""
    if not capturing() and bool(((pages < 1) & (True if write is None else write)).any()):
        fail("forward_batch.seq_lens", "lengths within each request's tokens (every page to summarize mapped to "
             f"a page in [1, {algo.num_pages}) by req_to_token)", "a length that reaches padding page 0",
             "pass the batch built for these requests (build_extend_batch / build_decode_batch).", BatchError)


def check_invalidate_pages(algo, pages) -> torch.Tensor:
    pages = torch.tensor(check_index_list("invalidate_pages(pages)", pages), dtype=torch.int64)
    check_range("invalidate_pages(pages)", pages, 0, algo.num_pages - 1,
                "pass physical pages of this pool (a negative id does not wrap to the last page).", PoolError)
    return pages


def check_score_pages(algo, queries, layer_id, forward_batch) -> None:
    """The layer, the query shape (Quest's messages) and, eagerly, every real token's page in [1, num_pages)."""
    check_algorithm_layer(algo, layer_id)
    check_quest_queries(queries, algo.num_kv_heads, algo.head_dim)
    if capturing() or forward_batch.batch_size == 0:
        return
    req_to_token = algo.req_to_token_pool.req_to_token
    rows = forward_batch.req_pool_indices.to(req_to_token.device).long()
    n = -(-forward_batch.seq_lens.to(req_to_token.device) // algo.page_size)
    cols = torch.arange(algo.max_pages, device=req_to_token.device)
    raw = req_to_token[rows[:, None], cols[None, :] * algo.page_size].long() // algo.page_size
    bad = (cols[None, :] < n[:, None]) & ((raw < 1) | (raw >= algo.num_pages))
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(
            f"req_to_token: request {r} (row {int(rows[r])}) maps logical page {j} to physical page "
            f"{int(raw[r, j])}, outside the KV pool's usable pages [1, {algo.num_pages}). Fix: fill req_to_token "
            "through KVCacheManager (admit/grow), and pass forward_batch for the same requests."
        )


# --------------------------------------------------------------------------------------------- algorithms/dsa.py
_INDEXER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_indexer(config, scoring_backend, backends) -> str:
    from sparse_ref.config import IndexerConfig

    if not isinstance(config, IndexerConfig):
        raise ConfigError(f"LightningIndexer: config must be an IndexerConfig, got {type(config).__name__}.")
    return check_choice(
        "scoring_backend", scoring_backend, backends,
        "\"auto\" (Triton kernel on CUDA, torch otherwise), \"torch\" or \"triton\" (on CPU: TRITON_INTERPRET=1).")


def check_attach_cache(indexer, cache) -> None:
    from sparse_ref.memory import IndexerKeyCache

    if not isinstance(cache, IndexerKeyCache):
        raise ConfigError(f"attach_cache: expected an IndexerKeyCache, got {type(cache).__name__}.")
    if cache.config.head_dim != indexer.config.head_dim or cache.config.use_fp8 != indexer.config.use_fp8:
        raise ConfigError(
            f"attach_cache: the cache holds head_dim={cache.config.head_dim}, use_fp8={cache.config.use_fp8} "
            f"keys but the indexer makes head_dim={indexer.config.head_dim}, use_fp8={indexer.config.use_fp8}. "
            "Fix: build the cache with the indexer's config."
        )
    if cache.device.type != indexer.device.type:
        raise ConfigError(f"attach_cache: the cache is on {cache.device} but the indexer on {indexer.device}.")


def check_indexer_call(indexer, x, q_lora, positions, forward_batch, layer_id) -> None:
    """Every check of an indexer call before any work (value checks need a host sync; skipped while capturing)."""
    from sparse_ref.batch import ForwardBatch, ForwardMode

    c, dev = indexer.config, indexer.device.type
    if indexer.cache is None:
        raise ConfigError(
            "LightningIndexer: no key cache attached. Fix: indexer.attach_cache(IndexerKeyCache.for_manager("
            "manager, indexer.config)), or IndexerKeyCache.from_pools(token_to_kv_pool, req_to_token_pool, "
            "indexer.config)."
        )
    if not isinstance(forward_batch, ForwardBatch):
        fail("forward_batch", "a sparse_ref.ForwardBatch", describe(forward_batch),
             "build it with build_extend_batch / build_decode_batch.", BatchError)
    indexer.cache.check_layer(layer_id)
    fb = forward_batch
    T = fb.positions.shape[0]
    check_tensor("x", x, dtype=_INDEXER_DTYPES, shape=(T, c.hidden_size), device=dev,
                 fix=f"pass the hidden states of the batch's {T} new tokens, [T, hidden_size].")
    check_tensor("q_lora", q_lora, dtype=_INDEXER_DTYPES, shape=(T, c.q_lora_rank), device=dev,
                 fix=f"pass the low-rank query latents of the batch's {T} new tokens, [T, q_lora_rank].")
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(T,), device=dev,
                 fix="pass forward_batch.positions.")
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        check_tensor(f"forward_batch.{name}", getattr(fb, name), device=dev,
                     fix="build the batch on the indexer's device.")
    bs = fb.batch_size
    counts = fb.extend_seq_lens if fb.forward_mode is ForwardMode.EXTEND else None
    if counts is not None:
        check_rows("forward_batch.extend_seq_lens", counts, bs, error=BatchError)
    if capturing() or bs == 0:
        return
    req_to_token = indexer.cache.req_to_token_pool.req_to_token
    rows, max_len = req_to_token.shape
    check_range("forward_batch.req_pool_indices", fb.req_pool_indices, 0, rows - 1, error=BatchError)
    check_range("forward_batch.seq_lens", fb.seq_lens, 0, max_len, error=BatchError,
                fix="seq_lens may not exceed max_context_len.")
    if not torch.equal(positions.long(), fb.positions):
        raise BatchError("positions: differ from forward_batch.positions; RoPE and the causal mask would use "
                         "other positions than the cache. Fix: pass positions=forward_batch.positions.")
    counts = torch.ones_like(fb.seq_lens) if counts is None else counts
    if int(counts.min()) < 0 or int(counts.sum()) != T:
        raise BatchError(f"forward_batch: new tokens per request {counts.tolist()} do not add up to the {T} "
                         "tokens of positions. Fix: build the batch with build_extend_batch / build_decode_batch.")
    token_req = torch.repeat_interleave(torch.arange(bs, device=positions.device), counts)
    own_len = fb.seq_lens[token_req]
    bad = (positions < 0) | (positions >= own_len)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        fail(f"positions[{t}]", f"a position in [0, seq_len={int(own_len[t])}) of request {int(token_req[t])}",
             str(int(positions[t])), "seq_lens must count the new tokens.", BatchError)
    expected = req_to_token[fb.req_pool_indices[token_req], positions.long()].long()
    if not torch.equal(expected, fb.out_cache_loc):
        t = int((expected != fb.out_cache_loc).nonzero()[0, 0])
        fail(f"forward_batch.out_cache_loc[{t}]", f"slot {int(expected[t])}, where req_to_token keeps that "
             "token (its key would be written where its request never reads it)", str(int(fb.out_cache_loc[t])),
             "build the batch from the pool.", BatchError)
    indexer.cache.check_history(layer_id, fb.req_pool_indices, fb.seq_lens - counts)


def check_index_width(indexer, forward_batch, width) -> int:
    """The width of ``index_scores``: ``max(seq_lens)`` by default (one host sync), at most ``max_context_len``."""
    if width is None:
        width = int(forward_batch.seq_lens.max()) if forward_batch.batch_size else 0
    return check_int("width", width, low=0, high=indexer.cache.req_to_token_pool.req_to_token.shape[1],
                     error=ShapeError)


def missing_dsa_kwargs_message(missing) -> str:
    """The seed message, then exactly which of the five kwargs are missing, why they matter and the fix."""
    return (
        f"{SEED_DSA_REQUIRED}. Missing: {', '.join(missing)} (not passed, or None). DSA retrieval runs the model's "
        "lightning indexer, which scores every cached token of a request from the hidden states (x), the low-rank "
        "query latent (q_lora) and the token positions, and needs the batch (forward_batch) to find each request's "
        "keys. Fix: algo.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, indexer=indexer, "
        "forward_batch=forward_batch, x=hidden_states, q_lora=q_lora, positions=forward_batch.positions)"
    )


def check_dsa_retrieve(algo, layer_id, req_pool_indices, sparse_mask, kwargs: dict):
    """``(indexer, forward_batch)`` of ``DSAAlgorithm.retrieve_topk``: the seed error names the kwargs missing."""
    from sparse_ref.algorithms.dsa import DSA_REQUIRED
    from sparse_ref.batch import ForwardBatch
    missing = [name for name in DSA_REQUIRED if kwargs.get(name) is None]
    if missing:
        raise RetrievalError(missing_dsa_kwargs_message(missing))
    indexer, fb = kwargs["indexer"], kwargs["forward_batch"]
    if not callable(indexer):
        fail("indexer", "the model's LightningIndexer (a callable module)", describe(indexer), error=RetrievalError)
    if not isinstance(fb, ForwardBatch):
        fail("forward_batch", "a sparse_ref.ForwardBatch", describe(fb), error=RetrievalError)
    if algo.req_to_token_pool is not None:
        algo.check_layer(layer_id)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, shape=(fb.batch_size,),
                 fix="pass forward_batch.req_pool_indices.")
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, shape=(fb.batch_size,),
                 fix="pass a bool tensor [bs], True for requests that may go sparse.")
    check_same_device("retrieve_topk", "req_pool_indices", {"req_pool_indices": req_pool_indices,
                      "sparse_mask": sparse_mask, "forward_batch.req_pool_indices": fb.req_pool_indices})
    if not capturing() and not torch.equal(req_pool_indices.long(), fb.req_pool_indices):
        raise BatchError("req_pool_indices: differ from forward_batch.req_pool_indices (another request's "
                         "row would be scored). Fix: pass forward_batch.req_pool_indices.")
    return indexer, fb


# --------------------------------------------------------------------------------------------- engine.py
def check_engine(workload, algorithms, config, attention_backend, page_size, max_requests, max_context_len,
                 num_pages, compare_dense, dsa_topk, device, known_algorithms, backends):
    """``(algorithms, configs, num_pages, device)`` of a ``DecodeEngine``: one algorithm and config per workload
    layer; ``num_pages`` None is enough pages for every request at ``max_context_len``."""
    from sparse_ref.config import SparseConfig
    from sparse_ref.workloads import PlantedEngineWorkload

    needs = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "request", "prefill", "decode", "indexer")
    if not isinstance(workload, PlantedEngineWorkload) and not all(hasattr(workload, n) for n in needs):
        fail("workload", "a PlantedEngineWorkload (or an object with its attributes, as "
             "tensor_parallel.RankWorkload)", describe(workload), error=ConfigError)

    algorithms = list(algorithms)
    if len(algorithms) != workload.num_layers or any(name not in known_algorithms for name in algorithms):
        raise ConfigError(f"algorithms: expected one entry per workload layer ({workload.num_layers}), each entry "
                          f"must be one of {known_algorithms}; got {algorithms}. Fix: e.g. ['quest', None, ...].")
    check_choice("attention_backend", attention_backend, backends)
    configs = list(config) if isinstance(config, (list, tuple)) else [config or SparseConfig()] * len(algorithms)
    if len(configs) != len(algorithms):
        raise ConfigError(f"config: expected one SparseConfig, or one per layer ({len(algorithms)}), got "
                          f"{len(configs)}.")
    for name, value, low in (("page_size", page_size, 1), ("max_requests", max_requests, 1),
                             ("max_context_len", max_context_len, 1), ("dsa_topk", dsa_topk, 1)):
        check_int(name, value, low=low)
    if num_pages is None:
        num_pages = max_requests * -(-max_context_len // page_size) + 1
    num_pages = check_int("num_pages", num_pages, low=2, fix="leave num_pages=None: enough pages for every request "
                          "at max_context_len (page 0 is padding).")
    if not isinstance(compare_dense, bool):
        fail("compare_dense", "True or False", describe(compare_dense), error=ConfigError)
    return algorithms, configs, num_pages, check_device("device", device)


def check_finish(engine, req) -> None:
    """``req`` is one of the engine's live requests, by identity (an equal request of another engine is not)."""
    if not any(r is req for r in engine.live) or engine.manager.requests.get(getattr(req, "rid", None)) is not req:
        raise PoolError(f"finish: expected a live request of this engine, got {req!r} (finished already, never "
                        "added, or another engine's). Fix: call finish once per request its add_request returned.")


def check_request_begin(coordinator, req, prompt_len) -> None:
    check_request("on_request_begin(req)", req)
    check_int("on_request_begin(prompt_len)", prompt_len, low=0, error=PoolError)
    if req.req_pool_idx in coordinator.prompt_lens:
        raise PoolError(f"on_request_begin: the request in req_to_token row {req.req_pool_idx} has begun already "
                        "(each request begins once). Fix: call on_request_end first, once it finishes.")


def check_request_end(coordinator, req) -> None:
    check_request("on_request_end(req)", req)
    if req.req_pool_idx not in coordinator.prompt_lens:
        raise PoolError(f"on_request_end: no request in req_to_token row {req.req_pool_idx} has begun (ended "
                        "already, or never begun). Fix: call on_request_begin and on_request_end once each.")


def check_coordinator_layer(coordinator, layer) -> int:
    """A layer of the engine, ``[0, num_layers)`` (``-1`` is refused: it would wrap to the last layer)."""
    return check_int("layer", layer, low=0, high=len(coordinator.algorithms) - 1, error=PoolError,
                     fix=f"the engine has layers [0, {len(coordinator.algorithms)}).")


def check_batch_slots(req_to_token, fb, batch: str = "forward_batch.", error=BatchError) -> None:
    """Eager: every new token's ``out_cache_loc`` is the slot req_to_token keeps for it (``req_pool_indices``,
    ``positions``), so a K/V or key write lands where its own request reads it (skipped while capturing)."""
    if capturing() or fb.positions.numel() == 0:
        return
    from sparse_ref.batch import ForwardMode

    counts = fb.extend_seq_lens if fb.forward_mode is ForwardMode.EXTEND else torch.ones_like(fb.seq_lens)
    rows = torch.repeat_interleave(fb.req_pool_indices.to(req_to_token.device), counts.to(req_to_token.device))
    positions = fb.positions.to(req_to_token.device)
    if int(rows.max()) >= req_to_token.shape[0] or int(positions.max()) >= req_to_token.shape[1]:
        fail(f"{batch}positions", f"rows and positions inside req_to_token {tuple(req_to_token.shape)}",
             f"row {int(rows.max())}, position {int(positions.max())}", "build the batch from these pools.", error)
    want = req_to_token[rows, positions].long().to(fb.out_cache_loc.device)
    if bool((want == 0).any()):  # slot 0 lies in padding page 0: no request's token is ever kept there
        t = int((want == 0).nonzero()[0, 0])
        fail(f"{batch}seq_lens", "lengths within each request's tokens (every new token has a slot in "
             "req_to_token)", f"new token {t} at position {int(positions[t])} of row {int(rows[t])}, which holds "
             "no token", "build the batch for these requests after allocating their tokens (build_decode_batch "
             "/ decode_step).", error)
    if not torch.equal(want, fb.out_cache_loc):
        t = int((want != fb.out_cache_loc).nonzero()[0, 0])
        fail(f"{batch}out_cache_loc[{t}]", f"slot {int(want[t])}, where req_to_token keeps that token (a write to "
             "another slot lands where its request never reads it, or in another request's KV)",
             str(int(fb.out_cache_loc[t])), "build the batch from the pool (build_decode_batch / decode_step).", error)


def check_engine_forward(engine, batch, inputs) -> None:
    """Eager: ``batch`` is the DECODE batch of the engine's live requests as they are now (a batch built before a
    request left, joined or grew is refused), and ``inputs`` has one entry per layer."""
    from sparse_ref.batch import ForwardBatch, ForwardMode

    if not isinstance(batch, ForwardBatch) or batch.forward_mode is not ForwardMode.DECODE:
        fail("batch", "a DECODE ForwardBatch (decode_step)", describe(batch), error=BatchError)
    layers = engine.manager.token_to_kv_pool.num_layers
    if not isinstance(inputs, (list, tuple)) or len(inputs) != layers:
        fail("inputs", f"one (q, k, v, x, q_lora) per layer ({layers})", describe(inputs), error=BatchError)
    if capturing():
        return
    live = engine.live
    rows = torch.tensor([r.req_pool_idx for r in live], dtype=torch.int64)
    seq_lens = torch.tensor([r.seq_len for r in live], dtype=torch.int64)
    if batch.batch_size != len(live) or not torch.equal(batch.req_pool_indices.cpu(), rows) or \
            not torch.equal(batch.seq_lens.cpu(), seq_lens):
        fail("batch", f"the batch of the live requests now (rows {rows.tolist()}, seq_lens {seq_lens.tolist()})",
             f"rows {batch.req_pool_indices.tolist()}, seq_lens {batch.seq_lens.tolist()}",
             "build it after the last add_request / finish / grow (decode_step), or call engine.step().", BatchError)
    check_batch_slots(engine.manager.req_to_token_pool.req_to_token, batch, "batch.")


def check_graphed_engine(engine) -> None:
    from sparse_ref.engine import DecodeEngine

    if not isinstance(engine, DecodeEngine):
        fail("engine", "a sparse_ref.engine.DecodeEngine", describe(engine), error=ConfigError)


def check_tensor_parallel(workload, quest_mode, dsa_mode, group, device, quest_modes, dsa_modes) -> torch.device:
    """What a ``TensorParallelEngine`` needs before its first exchange (rank-local, so every rank refuses)."""
    import torch.distributed as dist

    from sparse_ref.workloads import PlantedEngineWorkload

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("tensor parallel: torch.distributed is not initialised. Fix: launch with torchrun "
                          "(torchrun --nproc-per-node 2 ...) and call torch.distributed.init_process_group first.")
    if not isinstance(workload, PlantedEngineWorkload):
        fail("workload", "a PlantedEngineWorkload", describe(workload), error=ConfigError)
    check_choice("quest_mode", quest_mode, quest_modes)
    check_choice("dsa_mode", dsa_mode, dsa_modes)
    world = dist.get_world_size(group)
    if workload.num_kv_heads % world:
        fail("workload.num_kv_heads", f"a multiple of the world size {world} (each rank holds whole KV heads)",
             str(workload.num_kv_heads), "choose a world size that divides the KV heads.", ConfigError)
    dev = check_device("device", device)
    check_tp_backend(dist.get_backend(group), dev)
    return dev


def check_tp_backend(backend: str, device: torch.device) -> None:
    """NCCL moves CUDA tensors, gloo CPU tensors: the process group's backend must fit the engine's device."""
    want = "nccl" if device.type == "cuda" else "gloo"
    if backend != want:
        fail("backend", f"'{want}' for an engine on {device.type}", repr(backend),
             f"init_process_group('{want}'), or put the engine on "
             f"{'cpu' if backend == 'gloo' else 'cuda (one GPU per rank)'}.", ConfigError)


def check_graph_current(step) -> None:
    """The static tensors of a ``GraphedDecodeStep`` still describe the engine's requests: loaded by ``step()``,
    and no request admitted, grown or released since (the manager's generation). Host-side only."""
    generation = step.engine.manager.generation
    if step.generation is None:
        raise BatchError("GraphedDecodeStep: nothing to replay yet. Fix: call step(), which loads the batch.")
    if generation != step.generation:
        raise BatchError(
            f"GraphedDecodeStep: the engine changed since step() loaded the batch (a request joined, left or grew: "
            f"generation {step.generation} -> {generation}); a replay would write K/V into slots and read pages "
            "that no longer belong to these requests. Fix: call step() (the host half, then the replay), or "
            "capture a new GraphedDecodeStep(engine) after requests join or leave."
        )


# --------------------------------------------------------------------------------------------- attention.py
def _check_q_kv(q, k_buffer, v_buffer) -> int:
    """Shape checks shared by both attention references; returns the GQA group size ``H_q / H_kv``."""
    check_tensor("q", q, dtype=FLOAT_DTYPES, dims=3, fix="pass one query token per request, [bs, H_q, D].")
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, dims=3, device=q.device)
    check_tensor("v_buffer", v_buffer, dtype=FLOAT_DTYPES, shape=tuple(k_buffer.shape), device=q.device)
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_buffer.shape[1]
    if k_buffer.shape[2] != d:
        raise ShapeError(f"q: head dim {d} differs from the KV buffers' head dim {k_buffer.shape[2]}.")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ShapeError(f"q: {h_q} query heads are not a multiple of the {h_kv} KV heads (GQA needs H_q % H_kv == 0).")
    return h_q // h_kv


def _check_scale(scale):
    return None if scale is None else check_float("scale", scale, error=ShapeError)


def check_dense_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale):
    """``(group, scale)``; every token read is a real slot (not padding slot 0, inside the KV buffers)."""
    group = _check_q_kv(q, k_buffer, v_buffer)
    bs = q.shape[0]
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, device=q.device)
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_rows("seq_lens", seq_lens, bs, "one per query")
    check_rows("req_pool_indices", req_pool_indices, bs, "one per query")
    check_range("seq_lens", seq_lens, 0, req_to_token.shape[1])
    check_range("req_pool_indices", req_pool_indices, 0, req_to_token.shape[0] - 1, "negative rows do not wrap.")
    longest = int(seq_lens.max()) if bs else 0
    t = torch.arange(longest, device=q.device)
    slots = req_to_token[req_pool_indices.long()[:, None], t[None, :]]
    valid = t[None, :] < seq_lens[:, None]
    real = (slots > 0) & (slots < k_buffer.shape[0])
    if bool((valid & ~real).any()):
        r, tok = (int(x) for x in (valid & ~real).nonzero()[0])
        fail("seq_lens", "lengths within each request's tokens (slots in [1, num_slots))",
             f"row {r} token {tok} at slot {int(slots[r, tok])}", "pass the seq_lens of these requests.")
    return group, _check_scale(scale)


def check_sparse_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size, scale):
    """``(group, page_size, scale)`` of the sparse attention reference."""
    group = _check_q_kv(q, k_buffer, v_buffer)
    bs = q.shape[0]
    check_tensor("page_table", page_table, dtype=INDEX_DTYPES, dims=2, device=q.device)
    check_tensor("kv_lens", kv_lens, dtype=INDEX_DTYPES, dims=1, device=q.device)
    check_rows("page_table", page_table, bs, "one per query")
    check_rows("kv_lens", kv_lens, bs, "one per query")
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    width = page_table.shape[1]
    check_range("kv_lens", kv_lens, 0, width * page_size, "at most the table's width x page size.")
    check_range("page_table", page_table, 0, k_buffer.shape[0] // page_size - 1, "physical pages of the KV buffers.")
    return group, page_size, _check_scale(scale)


# --------------------------------------------------------------------------------------------- the kernels' launchers
def check_kernel_device(name: str, t: torch.Tensor, fix: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors through the interpreter; refuse anything else."""
    from sparse_ref.device import triton_interpreted

    if t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreted()):
        return
    fail(name, "a tensor on a CUDA device (or on CPU with TRITON_INTERPRET=1)", f"one on {t.device}", fix)


def check_scores(fn: str, name: str, scores) -> None:
    """dtype, rank, stride, device and size checks for a [rows, N] score matrix."""
    check_tensor(f"{fn}: {name}", scores, dtype=FLOAT_DTYPES, dims=2, fix="pass a 2-D float tensor [rows, N].")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        fail(f"{fn}: {name}", "unit stride along the last dim", f"strides {scores.stride()}",
             f"pass {name}.contiguous().")
    check_kernel_device(f"{fn}: {name}", scores, "move it with .cuda().")
    if scores.shape[1] >= 2**31 - 1:
        fail(f"{fn}: {name}", "rows shorter than 2**31 - 1", f"N={scores.shape[1]}", "split the rows.")


def check_topk(scores, k, lengths, order, width, out, orders, max_sort_width):
    """``(k_scalar, k_tensor, lengths, width, out)`` of a ``topk`` call (``k`` an int, or a clamped int32 tensor)."""
    fn = "topk"
    check_scores(fn, "scores", scores)
    check_choice(f"{fn}: order", order, orders, "order='score' or order='index'.", error=SparseRefError)
    R, N = scores.shape
    k_tensor = None
    if isinstance(k, torch.Tensor):
        check_tensor(f"{fn}: k", k, dtype=INDEX_DTYPES, shape=(R,), fix="pass an int, or one int k per row.")
        check_same_device(fn, "scores", {"scores": scores, "k": k})
        check_range(f"{fn}: k", k, 0, 2**63 - 1, "clamp k at 0.", error=SparseRefError)
        if width is None:
            if capturing():
                fail(f"{fn}: width", "an int while a CUDA graph captures (reading k.max() would sync)", "None",
                     "pass width=<max k>.", SparseRefError)
            width = int(k.max()) if R else 0
        k_tensor = k.clamp(0, N).to(torch.int32).contiguous()  # k >= 2**31 must not wrap around
        k_scalar = 0
    else:
        k_scalar = check_int(f"{fn}: k", k, low=0, fix="pass a non-negative int (or an int tensor [R]).",
                             error=SparseRefError)
        width = k_scalar if width is None else width
    width = check_int(f"{fn}: width", width, low=0, fix="pass width=k.", error=SparseRefError)
    if order == "score" and width > max_sort_width:
        fail(f"{fn}: width", f"at most {max_sort_width} with order='score' (the winners are sorted in one tile)",
             str(width), f"use order='index', or k <= {max_sort_width}.", SparseRefError)
    if lengths is not None:
        check_tensor(f"{fn}: lengths", lengths, dtype=INDEX_DTYPES, shape=(R,), fix="one length per row, or None.")
        check_same_device(fn, "scores", {"scores": scores, "lengths": lengths})
        check_range(f"{fn}: lengths", lengths, 0, N, "clamp lengths to [0, scores.shape[1]].")
        lengths = lengths.contiguous()
    if out is None:
        out = torch.empty((R, width), dtype=torch.int32, device=scores.device)
    else:
        check_tensor(f"{fn}: out", out, dtype=torch.int32, shape=(R, width), contiguous=True, fix="pass out=None.")
        check_same_device(fn, "scores", {"scores": scores, "out": out})
    return k_scalar, k_tensor, lengths, width, out


def check_page_table(selected, lengths, sparse_mask, seq_lens, req_pool_indices, req_to_token, page_size, out,
                     check_values: bool):
    """``(out_width, shapes)`` of ``page_table_from_selection``: the contract of ``to_attention_metadata``."""
    fn = "page_table_from_selection"
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2,
                 fix="pass the selection returned by retrieve_topk, int32 [bs, W].")
    bs, width = selected.shape
    for name, t, dtype in (("lengths", lengths, INDEX_DTYPES), ("sparse_mask", sparse_mask, torch.bool),
                           ("seq_lens", seq_lens, INDEX_DTYPES), ("req_pool_indices", req_pool_indices, INDEX_DTYPES)):
        check_tensor(name, t, dtype=dtype, shape=(bs,), fix=f"pass one {name} entry per row of selected.")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    page_size = check_int("page_size", page_size, low=1, fix="pass the KV pool's page size.")
    r2t_rows, r2t_width = req_to_token.shape
    if r2t_rows == 0:
        fail("req_to_token", "at least one row", f"shape {tuple(req_to_token.shape)}")
    out_width = max(width, -(-r2t_width // page_size))
    shapes = ((bs, out_width), (bs,), (bs + 1,))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail("out", "a tuple (page_table, kv_lens, cu_kv_lens) of int32 buffers", repr(type(out)))
        for name, t, shape in zip(("page_table", "kv_lens", "cu_kv_lens"), out, shapes, strict=True):
            check_tensor(f"out {name}", t, dtype=torch.int32, shape=shape, contiguous=True,
                         fix=f"preallocate torch.zeros({shape}, dtype=torch.int32) on the device of selected.")
    check_same_device(fn, "selected", {"selected": selected, "lengths": lengths, "sparse_mask": sparse_mask,
                                       "seq_lens": seq_lens, "req_pool_indices": req_pool_indices,
                                       "req_to_token": req_to_token,
                                       **({} if out is None else {"out page_table": out[0], "out kv_lens": out[1],
                                                                  "out cu_kv_lens": out[2]})})
    check_kernel_device(f"{fn}: selected", selected,
                        "use sparse_ref.adaptor.to_attention_metadata(backend='torch') on CPU.")
    if check_values:
        check_selection_values(selected, lengths, sparse_mask, seq_lens, req_pool_indices, req_to_token, page_size)
    if bs >= 65535:
        fail("selected", "fewer than 65535 rows (one launch)", f"{bs} rows", "build the table in chunks of rows.")
    return out_width, shapes


def check_page_select(fn, scores, seq_lens, sparse_mask, page_size, config, width, check_values, max_pages_limit):
    """The fused selection's input checks; returns ``(page_size, W)``."""
    from sparse_ref.config import SparseConfig

    check_scores(fn, "scores", scores)
    bs, max_pages = scores.shape
    check_tensor(f"{fn}: seq_lens", seq_lens, dtype=INDEX_DTYPES, shape=(bs,), fix="pass forward_batch.seq_lens.")
    check_tensor(f"{fn}: sparse_mask", sparse_mask, dtype=torch.bool, shape=(bs,), fix="one bool per request.")
    check_same_device(fn, "scores", {"scores": scores, "seq_lens": seq_lens, "sparse_mask": sparse_mask})
    page_size = check_int(f"{fn}: page_size", page_size, low=1, fix="pass the KV pool's page size.")
    if not isinstance(config, SparseConfig):
        fail(f"{fn}: config", "a sparse_ref.SparseConfig", type(config).__name__, "pass SparseConfig(...).",
             SparseRefError)
    if check_values:  # retrieve_topk checked the lengths already
        check_range(f"{fn}: seq_lens", seq_lens, 0, max_pages * page_size,
                    "score every page of the longest request (scores cover max_pages * page_size tokens).")
    W = config.selection_width(max_pages)
    if width is not None:  # wider is allowed (extra -1 padding); narrower would cut rows off
        width = check_int(f"{fn}: width", width, low=W, fix="leave width=None (a narrower output would cut rows "
                          "off).", error=SparseRefError)
        W = min(width, max_pages)  # as select_pages: a row never keeps more pages than it has
    if max_pages > max_pages_limit:
        fail(f"{fn}: scores", f"at most {max_pages_limit} pages per row (one program holds a row in registers)",
             f"{max_pages} pages", "use sparse_ref.selection.select_pages for longer rows (retrieve_topk does).",
             SparseRefError)
    return page_size, W


def check_select_to_table(scores, seq_lens, sparse_mask, page_size, config, req_pool_indices, req_to_token, out,
                          check_values, max_pages_limit):
    """``(page_size, W, out_width, shapes)`` of ``select_pages_to_table``."""
    fn = "select_pages_to_table"
    page_size, W = check_page_select(fn, scores, seq_lens, sparse_mask, page_size, config, None, check_values,
                                     max_pages_limit)
    bs, max_pages = scores.shape
    check_tensor(f"{fn}: req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, shape=(bs,),
                 fix="pass forward_batch.req_pool_indices.")
    check_tensor(f"{fn}: req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    r2t_rows, r2t_width = req_to_token.shape
    if r2t_rows == 0 or r2t_width == 0:
        fail(f"{fn}: req_to_token", "at least one row and one column", f"shape {tuple(req_to_token.shape)}",
             "pass the req_to_token table of the ReqToTokenPool.")
    out_width = max(W, -(-r2t_width // page_size))
    shapes = ((bs, out_width), (bs,), (bs + 1,))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail(f"{fn}: out", "a tuple (page_table, kv_lens, cu_kv_lens) of int32 buffers", repr(type(out)))
        for name, t, shape in zip(("page_table", "kv_lens", "cu_kv_lens"), out, shapes, strict=True):
            check_tensor(f"{fn}: out {name}", t, dtype=torch.int32, shape=shape, contiguous=True,
                         fix=f"preallocate torch.zeros({shape}, dtype=torch.int32) on the device of scores.")
    check_same_device(fn, "scores", {"scores": scores, "req_pool_indices": req_pool_indices,
                                     "req_to_token": req_to_token,
                                     **({} if out is None else {"out page_table": out[0], "out kv_lens": out[1],
                                                                "out cu_kv_lens": out[2]})})
    check_kernel_device(f"{fn}: scores", scores, "use select_pages and adaptor.to_attention_metadata on CPU.")
    if check_values:
        check_range(f"{fn}: req_pool_indices", req_pool_indices, 0, r2t_rows - 1, "pass rows of req_to_token.")
        check_range(f"{fn}: seq_lens", seq_lens, 0, r2t_width, "every request fits in req_to_token.")
        check_tokens_on_real_pages(seq_lens, req_pool_indices, req_to_token, page_size, f"{fn}: seq_lens")
    return page_size, W, out_width, shapes


_QUEST_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_bounds(page_min, page_max, page_valid) -> tuple[int, int, int]:
    """The Quest bounds pool of one layer, checked: ``(num_pages, H_kv, D)``."""
    check_tensor("page_min", page_min, dtype=FLOAT_DTYPES, dims=3, contiguous=True,
                 fix="pass QuestAlgorithm.page_min[layer_id], [num_pages, H_kv, D].")
    check_tensor("page_max", page_max, dtype=page_min.dtype, shape=tuple(page_min.shape), contiguous=True,
                 fix="pass QuestAlgorithm.page_max[layer_id] of the same layer as page_min.")
    check_tensor("page_valid", page_valid, dtype=torch.bool, shape=(page_min.shape[0],), contiguous=True,
                 fix="pass QuestAlgorithm.page_valid[layer_id], one bool per physical page.")
    return tuple(page_min.shape)


def check_page_bounds_update(k_buffer, page_min, page_max, page_valid, req_to_token, req_pool_indices, seq_lens,
                             page_size, prefix_lens) -> None:
    """The inputs of ``update_page_bounds`` (the Quest bounds kernel): shapes, dtypes, one device; the values are
    the caller's (``QuestAlgorithm`` checks them eagerly; the kernel clamps every index)."""
    fn = "update_page_bounds"
    num_pages, num_kv_heads, head_dim = _check_bounds(page_min, page_max, page_valid)
    page_size = check_int("page_size", page_size, low=1, fix="pass the pool's page size.", error=SparseRefError)
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, shape=(num_pages * page_size, num_kv_heads, head_dim),
                 contiguous=True, fix="pass token_to_kv_pool.get_key_buffer(layer_id) of the pool the bounds cover.")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass ReqToTokenPool.req_to_token.")
    check_tensor("req_pool_indices", req_pool_indices, dtype=(torch.int32, torch.int64), dims=1,
                 fix="pass forward_batch.req_pool_indices, one row of req_to_token per request.")
    bs = req_pool_indices.shape[0]
    lens = {"seq_lens": seq_lens} | ({} if prefix_lens is None else {"prefix_lens": prefix_lens})
    for name, t in lens.items():
        check_tensor(name, t, dtype=(torch.int32, torch.int64), shape=(bs,),
                     fix=f"pass forward_batch.{'extend_prefix_lens' if name == 'prefix_lens' else name}, one per "
                         "request.")
    check_kernel_device(f"{fn}: page_min", page_min, "move the pools to the GPU, or use the torch bounds update.")
    check_same_device(fn, "page_min", {"page_min": page_min, "page_max": page_max, "page_valid": page_valid,
                                       "k_buffer": k_buffer, "req_to_token": req_to_token,
                                       "req_pool_indices": req_pool_indices, **lens})


def check_quest_scores(q_pos, q_neg, page_min, page_max, page_valid, pages, out) -> tuple[int, int]:
    """``(num_pages, H_kv * D)`` of ``quest_page_scores``."""
    fn = "quest_page_scores"
    num_pages, num_kv_heads, head_dim = _check_bounds(page_min, page_max, page_valid)
    hd = num_kv_heads * head_dim
    check_tensor("pages", pages, dtype=(torch.int32, torch.int64), dims=2, contiguous=True,
                 fix="pass QuestAlgorithm.physical_pages(req_pool_indices), [bs, max_pages] physical page ids.")
    bs, max_pages = pages.shape
    for name, q in (("q_pos", q_pos), ("q_neg", q_neg)):
        shape = (bs, num_kv_heads, head_dim) if isinstance(q, torch.Tensor) and q.dim() == 3 else (bs, hd)
        check_tensor(name, q, dtype=torch.float32, shape=shape, contiguous=True,
                     fix=f"pass {name} from split_query_sign: fp32 [bs={bs}, H_kv={num_kv_heads}, D={head_dim}].")
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(bs, max_pages), contiguous=True,
                     fix="pass torch.empty(bs, max_pages) in fp32.")
    check_kernel_device(f"{fn}: page_min", page_min, "move the pools and queries to the GPU, or use the torch "
                        "scoring backend.")
    check_same_device(fn, "page_min", {"page_min": page_min, "q_pos": q_pos, "q_neg": q_neg, "page_max": page_max,
                                       "page_valid": page_valid, "pages": pages, "out": out})
    if pages.numel() and num_pages == 0:
        fail("page_min", "a pool with pages", f"shape {tuple(page_min.shape)} for {pages.numel()} pages to score",
             "allocate the Quest pools before scoring.")
    check_range("pages", pages, 0, num_pages - 1, "build pages with QuestAlgorithm.physical_pages (which clamps), "
                "from a req_to_token filled through KVCacheManager.")
    if bs > 65535:
        fail("pages", "at most 65535 requests (rows) per launch", f"bs={bs}", "score the batch in chunks.")
    return num_pages, hd


def check_quest_scores_from_queries(queries, page_min, page_max, page_valid, req_to_token, req_pool_indices,
                                    page_size, max_pages, gqa_mode, out, check_values):
    """``(num_pages, H_kv * D, D, GQA group, page_size, max_pages)`` of ``quest_page_scores_from_queries``."""
    fn = "quest_page_scores_from_queries"
    num_pages, num_kv_heads, head_dim = _check_bounds(page_min, page_max, page_valid)
    hd = num_kv_heads * head_dim
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, fix="pass ReqToTokenPool.req_to_token.")
    check_tensor("req_pool_indices", req_pool_indices, dtype=(torch.int32, torch.int64), dims=1,
                 fix="pass forward_batch.req_pool_indices, one row of req_to_token per request.")
    bs = req_pool_indices.shape[0]
    check_tensor("queries", queries, dtype=_QUEST_QUERY_DTYPES, dims=(2, 3), fix="pass the float decode queries.")
    if queries.dim() == 3:
        num_q_heads, head_dim_fits = queries.shape[1], queries.shape[2] == head_dim
    else:
        num_q_heads, head_dim_fits = queries.shape[1] // head_dim, queries.shape[1] % head_dim == 0
    if queries.shape[0] != bs or not head_dim_fits or num_q_heads == 0 or num_q_heads % num_kv_heads:
        fail("queries", f"[bs={bs}, H_q, {head_dim}] or [bs, H_q * {head_dim}] with H_q a multiple of the "
             f"{num_kv_heads} KV heads", f"shape {tuple(queries.shape)}",
             "pass all query heads of the layer, one decode query per request.")
    group = num_q_heads // num_kv_heads
    check_choice("gqa_mode", gqa_mode, ("mean", "per_kv_head"), "pass SparseConfig.gqa_mode.", SparseRefError)
    page_size = check_int("page_size", page_size, low=1, fix="pass the pool's page size.", error=SparseRefError)
    max_pages = check_int("max_pages", max_pages, low=0, fix="pass QuestAlgorithm.max_pages.", error=SparseRefError)
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(bs, max_pages), contiguous=True,
                     fix="pass torch.empty(bs, max_pages) in fp32.")
    check_kernel_device(f"{fn}: page_min", page_min, "move the pools and queries to the GPU, or use the torch "
                        "scoring backend.")
    check_same_device(fn, "page_min", {"page_min": page_min, "queries": queries, "page_max": page_max,
                                       "page_valid": page_valid, "req_to_token": req_to_token,
                                       "req_pool_indices": req_pool_indices, "out": out})
    r2t_rows, r2t_width = req_to_token.shape
    if bs and max_pages and (num_pages == 0 or r2t_rows == 0 or r2t_width == 0):
        fail("page_min", "allocated pools", f"page_min {tuple(page_min.shape)}, req_to_token "
             f"{tuple(req_to_token.shape)}", "allocate the pools before scoring.")
    if check_values:  # retrieve_topk checked the rows already (one host sync per call, not two)
        check_range("req_pool_indices", req_pool_indices, 0, r2t_rows - 1, "pass forward_batch.req_pool_indices.")
    if bs > 65535:
        fail("req_pool_indices", "at most 65535 requests per launch", f"bs={bs}", "score the batch in chunks.")
    return num_pages, hd, head_dim, group, page_size, max_pages


def check_indexer_logits(q, weights, keys, scales, block_table, token_req, bounds, width, out, check_values,
                         fp8_dtype):
    """``(T, H, D, page, bs, max_pages, num_pages, width, out)`` of ``paged_indexer_logits`` (``out`` allocated)."""
    fn = "paged_indexer_logits"
    check_tensor("q", q, dtype=(fp8_dtype, torch.float32), dims=3, contiguous=True,
                 fix="pass the indexer's queries [T, H, D] (FP8, or fp32 for a full-precision cache).")
    T, H, D = q.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), contiguous=True,
                 fix=f"pass the fp32 head weights [T={T}, H={H}].")
    check_tensor("keys", keys, dtype=q.dtype, dims=3, fix="pass IndexerKeyCache.key_pages(layer_id).")
    num_pages, page, kd = keys.shape
    if kd != D or keys.stride(2) != 1 or keys.stride(1) != D:
        fail(f"{fn}: keys", f"[num_pages, page_size, D={D}] with token-major rows of D contiguous values",
             f"shape {tuple(keys.shape)}, strides {keys.stride()}", "pass IndexerKeyCache.key_pages(layer_id).")
    check_tensor("scales", scales, dtype=torch.float32, shape=(num_pages, page),
                 fix="pass IndexerKeyCache.scale_pages(layer_id).")
    if scales.stride(1) != 1:
        fail(f"{fn}: scales", "one page's scales contiguous", f"strides {scales.stride()}",
             "pass IndexerKeyCache.scale_pages(layer_id).")
    check_tensor("block_table", block_table, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass req_to_token[req_pool_indices, ::page_size] // page_size as int32.")
    bs, max_pages = block_table.shape
    check_tensor("token_req", token_req, dtype=torch.int32, shape=(T,), contiguous=True,
                 fix=f"pass the block-table row of each query token, int32 [T={T}].")
    check_tensor("bounds", bounds, dtype=torch.int32, shape=(T,), contiguous=True,
                 fix=f"pass each query token's position + 1, int32 [T={T}].")
    width = check_int("width", width, low=0, high=2**31 - 1, error=ShapeError)
    if out is None:
        out = torch.empty((T, width), dtype=torch.float32, device=q.device)
    check_tensor("out", out, dtype=torch.float32, shape=(T, width), contiguous=True,
                 fix=f"pass out=None, or torch.empty({T}, {width}) in fp32.")
    device = q.device
    check_kernel_device(f"{fn}: q", q, "move the cache and queries to the GPU, or use "
                        "LightningIndexer(scoring_backend='torch').")
    for name, t in (("weights", weights), ("keys", keys), ("scales", scales), ("block_table", block_table),
                    ("token_req", token_req), ("bounds", bounds), ("out", out)):
        if t.device != device:
            fail(f"{fn}: {name}", f"a tensor on {device} (the device of q)", f"one on {t.device}",
                 f"move it with {name}.to({str(device)!r}).")
    fp8 = q.dtype == fp8_dtype
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise SparseRefError(f"{fn}: FP8 e4m3 tl.dot needs compute capability >= 8.9, this GPU has "
                             f"{torch.cuda.get_device_capability(device)}. Fix: use "
                             f"LightningIndexer(scoring_backend='torch') (dequantised keys), or a Hopper/Ada GPU.")
    if fp8 and (keys.stride(0) % 4 or (scales.data_ptr() - keys.data_ptr()) % 4):
        fail(f"{fn}: keys", "pages whose byte size is a multiple of 4", f"page stride {keys.stride(0)} bytes",
             "use a page_size * head_dim that is a multiple of 4.")
    if T and check_values and not capturing():  # LightningIndexer checked its batch already
        lo, hi = (int(x) for x in token_req.aminmax())
        if lo < 0 or hi >= bs:
            fail(f"{fn}: token_req", f"rows in [0, {bs}) of block_table", f"min {lo}, max {hi}",
                 "one block-table row per query token's request.")
        lo, hi = (int(x) for x in bounds.aminmax())
        if lo < 0 or hi > min(width, max_pages * page):
            fail(f"{fn}: bounds", f"values in [0, {min(width, max_pages * page)}] (width, and the pages of "
                 "block_table)", f"min {lo}, max {hi}", "bounds are positions + 1, within the row width.")
        if block_table.numel():
            lo, hi = (int(x) for x in block_table.aminmax())
            if lo < 0 or hi >= num_pages:
                fail(f"{fn}: block_table", f"page ids in [0, {num_pages})", f"min {lo}, max {hi}",
                     "build it from req_to_token of the cache's own pools.")
    return T, H, D, page, bs, max_pages, num_pages, width, out


def _check_knob(name: str, value, low: int) -> None:
    if value is None:
        return
    check_int(name, value, low=low, high=1024, fix=f"leave {name}=None for the default.")
    if value & (value - 1):
        fail(name, "a power of two", repr(value), f"leave {name}=None for the default.", ConfigError)


def check_decode_knobs(knobs: dict, max_splits: int) -> dict:
    """The decode attention launch knobs (``TUNING``), checked: splits, powers of two, the dot path's switches."""
    if knobs["num_splits"] is not None:
        check_int("num_splits", knobs["num_splits"], low=1, high=max_splits, fix="leave num_splits=None.")
    _check_knob("block_n", knobs["block_n"], 16)
    _check_knob("num_warps", knobs["num_warps"], 1)
    if knobs["num_stages"] is not None:
        check_int("num_stages", knobs["num_stages"], low=1, high=8, fix="leave num_stages=None for the default.")
    if knobs["use_dot"] not in (None, True, False) or knobs["precise"] not in (True, False):
        fail("use_dot / precise", "None, True or False (use_dot) and True or False (precise)",
             f"{knobs['use_dot']!r} / {knobs['precise']!r}", "leave the defaults.", ConfigError)
    if knobs["pdl"] not in (True, False):
        fail("pdl", "True or False", repr(knobs["pdl"]), "leave pdl=True (it is off by itself off Hopper).",
             ConfigError)
    return knobs


def check_decode_attention(q, k_buffer, v_buffer, page_table, kv_lens, page_size, scale, out):
    """``(page_size, scale, num_pages)`` of ``paged_decode_attention``."""
    fn = "paged_decode_attention"
    check_tensor("q", q, dtype=FLOAT_DTYPES, dims=3, fix="pass one query token per request, [bs, H_q, D].")
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, dims=3, contiguous=True,
                 fix="pass the layer's key buffer of the KV pool, [num_slots, H_kv, D].")
    check_tensor("v_buffer", v_buffer, dtype=k_buffer.dtype, shape=tuple(k_buffer.shape), contiguous=True,
                 fix="pass the layer's value buffer: same shape and dtype as k_buffer.")
    bs, num_q_heads, head_dim = q.shape
    num_slots, num_kv_heads, kv_dim = k_buffer.shape
    if kv_dim != head_dim:
        fail("q", f"head dim {kv_dim} (the KV buffers' head dim)", f"shape {tuple(q.shape)}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        fail("q", f"a multiple of the {num_kv_heads} KV heads as query heads (GQA)", f"{num_q_heads} query heads",
             "pass all query heads of the layer.")
    if head_dim == 0:
        fail("q", "a head dim >= 1", f"shape {tuple(q.shape)}")
    check_tensor("page_table", page_table, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the page_table of adaptor.to_attention_metadata (int32 [bs, W]).")
    check_tensor("kv_lens", kv_lens, dtype=torch.int32, shape=(bs,), contiguous=True,
                 fix="pass the kv_lens of adaptor.to_attention_metadata (int32, one per request).")
    if page_table.shape[0] != bs:
        fail("page_table", f"{bs} rows (one per query)", f"shape {tuple(page_table.shape)}")
    page_size = check_int("page_size", page_size, low=1, error=ShapeError, fix="pass the KV pool's page size.")
    if num_slots % page_size or num_slots == 0:
        fail("k_buffer", f"a whole number (>= 1) of pages of {page_size} slots", f"{num_slots} slots",
             "pass the buffer of a pool created with this page_size.")
    num_pages = num_slots // page_size
    width = page_table.shape[1]
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(bs, num_q_heads, head_dim), contiguous=True,
                     fix="pass torch.empty(bs, H_q, D, dtype=torch.float32) on the device of q.")
    check_same_device(fn, "q", {"q": q, "k_buffer": k_buffer, "v_buffer": v_buffer, "page_table": page_table,
                                "kv_lens": kv_lens, "out": out})
    check_kernel_device(f"{fn}: q", q, "move the tensors to the GPU, or use sparse_ref.attention."
                        "sparse_decode_attention on CPU.")
    scale = 1.0 / head_dim ** 0.5 if scale is None else check_float("scale", scale, error=ShapeError)
    if width * page_size >= 2**31:
        fail("page_table", "W * page_size < 2**31", f"W={width}, page_size={page_size}")
    # value checks (host syncs; skipped while a CUDA graph captures: the kernel clamps instead)
    check_range("page_table", page_table, 0, num_pages - 1,
                "entries past a row's pages must be the padding page 0; every id must name a page of the pool.")
    check_range("kv_lens", kv_lens, 0, width * page_size,
                f"kv_lens[r] counts tokens of the row's {width} table entries of {page_size} slots.")
    return page_size, scale, num_pages


# --------------------------------------------------------------------------------------------- the command lines
def cli_positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (``--context 0`` or ``--steps -3`` exit 2 naming the flag)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def cli_output_file(text: str):
    """An argparse type: a file path that can be written (its folder is created now), not a folder, not empty."""
    import argparse
    import os
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot create the folder {str(path.parent)!r}: {e.strerror}") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return path
