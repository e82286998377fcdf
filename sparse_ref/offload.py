"""KV offload to host memory with a per-request device hot buffer, as SGLang's HiSparse does (torch reference).

Every token's K/V of an offloaded layer lives in host memory (pinned when CUDA is there): the KV pool's
``host_layers``, addressed by the same slots (``req_to_token``); the device keeps none of it. On the device
each request row owns a hot buffer of ``size`` token slots, replaced least-recently-used, plus one slot
reserved for the newest token: the write path puts the new token's K/V there (and in the host pool), so it
is always a hit. Each step, per layer, ``swap_in`` turns the tokens that attention reads
(``positions_read``: a request's kept pages or tokens, or all of a dense row's) into hot slots: a hit keeps
its slot, a miss takes an empty slot or the least recently used one this step does not need, and its K/V
is copied in from the host pool. Attention then reads the hot buffer through a page-size-1 table: the same
tokens, in the same order, as the all-on-device step.

The buffer's state is kept as the kernel keeps it (``sparse_ref.kernels.swap_in``, one launch, no host sync):
per layer and row, the token each slot holds (``token``, -1 empty), the step it was last used
(``last_used``), the reverse map token -> slot (``slot_of``), the slots in eviction order (``lru``: empty
first, then least recently used, ties by slot id; ``lru_order`` derives it from the other two), a step
counter per layer (``clock``), the hit / miss counts (``stats``) and, per batch row, a flag per chunk of table
entries, 0 once the kernel's copies into it landed (``ready``: attention over a chunk starts while the others
copy). The kernel keeps ``lru`` so that it never sorts: a row's victims are the first slots of its list that this
step does not use. This reference reads the state back and loops on the host: a host sync per layer.
"""

from __future__ import annotations

import torch

from sparse_ref.adaptor import Metadata
from sparse_ref.backend import torch_twin
from sparse_ref.checks import INT32_MAX, check_device, check_int, check_kv_dtype, fail
from sparse_ref.errors import ConfigError, PoolError


class OffloadedKV:
    """Offload as one object: the host pool (the KV pool's ``host_layers``), the hot buffers of the offloaded
    ``layers``, the write path and the swap-in (the backend's: this module's reference or the Triton kernel). The
    engine calls ``read`` once per offloaded layer and step (it writes the new token too), ``forget`` when a request
    leaves."""

    def __init__(self, pool, layers: list[int], rows: int, size: int, max_context_len: int, backend, device):
        from sparse_ref.backend import Backend

        if not isinstance(backend, Backend):
            fail("backend", "a Backend (sparse_ref.backend.choose_backend)", repr(backend),
                 "pass choose_backend('auto', device), as the engine does.", ConfigError)
        self.layers, self.backend = list(layers), backend
        self.host = HostKVPool.of_pool(pool)  # the same tensors: set_kv and the kernel write them
        self.hot = HotBuffer(pool.num_layers, rows, size, pool.num_kv_heads, pool.head_dim, max_context_len,
                             pool.dtype, device, layers=self.layers)

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hot.k[layer], self.hot.v[layer]

    @property
    def ready(self) -> tuple[torch.Tensor, int]:
        """What attention waits on (``paged_decode_attention(ready=...)``): the swap-in kernel's flags, their chunk."""
        return self.hot.ready, self.hot.ready_chunk

    def forget(self, row: int) -> None:
        self.hot.forget(row)

    def read(self, layer: int, batch, md: Metadata, k: torch.Tensor, v: torch.Tensor,
             req_to_token: torch.Tensor) -> Metadata:
        """The new token into the host pool and its row's reserved slot, then the tokens attention reads into the
        hot buffer: the metadata over the hot buffer (page size 1, the same tokens in the same order). The kernel
        lists the positions itself and needs no host sync (a CUDA graph holds it); the reference reads back."""
        assert md.selected is not None, "offloaded layers are sparse"
        table, counts = self.backend.swap_in(self.hot, layer, md, batch, (k, v), self.host, req_to_token)
        return Metadata(table, counts, 1, md.selected, md.lengths, md.sparse_mask)


@torch_twin("swap_in")
def swap_in_torch(hot: HotBuffer, layer: int, md: Metadata, batch, new_kv: tuple, host: HostKVPool,
                  req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's torch swap-in (the kernel's signature): the new token's K/V into the host pool (as ``set_kv``
    stores it) and its reserved slot, then ``HotBuffer.swap_in`` of the positions attention reads."""
    width = md.page_table.shape[1] * md.page_size  # the all-on-device table's width in tokens
    positions, counts = positions_read(md.selected, md.lengths, md.sparse_mask, batch.seq_lens, md.page_size, width)
    k, v = new_kv
    slots = batch.out_cache_loc.to(host.k[layer].device).long()
    host.k[layer][slots] = k.to(host.k[layer].device, host.k[layer].dtype)
    host.v[layer][slots] = v.to(host.v[layer].device, host.v[layer].dtype)
    hot.write_newest(layer, batch.req_pool_indices, k, v)
    table = hot.swap_in(layer, batch.req_pool_indices, positions, counts, batch.seq_lens, host, req_to_token)
    return table, counts


def most_tokens_read(algorithms, configs, layers, dsa_topk: int, page_size: int, max_context_len: int) -> int:
    """The most tokens one request reads in a step besides its newest (reserved slot), in any of ``layers``: the hot
    buffer must hold them. No row reads more than the ``max_context_len - 1`` tokens before its newest."""
    most = 0
    for layer in layers:
        algo, cfg = algorithms[layer], configs[layer]
        reads = dsa_topk if algo.name == "deepseek_dsa" else cfg.selection_width(algo.max_pages) * page_size
        most = max(most, reads, cfg.min_sparse_seq_len - 1)  # a row below min_sparse_seq_len reads it all
    return max(1, min(most, max_context_len - 1))


class HostKVPool:
    """Every layer's K/V ``[num_slots, H_kv, D]`` in host memory, pinned when CUDA is there (a kernel reads it).

    The engine's is ``of_pool(token_to_kv_pool)``: the KV pool's host layers themselves (no second copy)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
        check_sizes("HostKVPool", num_slots=num_slots, num_layers=num_layers, num_kv_heads=num_kv_heads,
                    head_dim=head_dim)
        check_layers_and_dtype("HostKVPool", num_layers, None, dtype)
        pin = torch.cuda.is_available()
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    @classmethod
    def of_pool(cls, pool) -> HostKVPool:
        """The host layers of a ``TokenToKVPool`` (``host_layers``) as a host pool: the same tensors."""
        host = cls.__new__(cls)
        host.k = [b if i in pool.host_layers else None for i, b in enumerate(pool.k_buffer)]
        host.v = [b if i in pool.host_layers else None for i, b in enumerate(pool.v_buffer)]
        return host


class HotBuffer:
    """Per (layer, request row): ``size`` token slots replaced least-recently-used, and the newest token's slot.

    Slot ids index ``k[layer]`` / ``v[layer]`` ``[1 + rows * (size + 1), H_kv, D]`` (slot 0 is padding); row
    ``r`` owns ``1 + r * (size + 1) + [0, size]``, its last one the newest token's.
    """

    def __init__(self, num_layers: int, num_rows: int, size: int, num_kv_heads: int, head_dim: int,
                 max_context_len: int, dtype=torch.float32, device="cpu", layers=None):
        """``layers``: the layers that get K/V slots (default all; the engine's offloaded layers)."""
        check_sizes("HotBuffer", num_layers=num_layers, num_rows=num_rows, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, max_context_len=max_context_len)
        size = check_int("HotBuffer(size)", size, low=1, high=MAX_BUFFER, error=ConfigError)
        check_layers_and_dtype("HotBuffer", num_layers, layers, dtype)
        self.size, self.width, self.device = size, size + 1, check_device("HotBuffer(device)", device)
        shape, on = (1 + num_rows * self.width, num_kv_heads, head_dim), {"device": self.device}
        has = set(range(num_layers) if layers is None else layers)
        self.k = [torch.zeros(shape, dtype=dtype, **on) if i in has else None for i in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, **on) if i in has else None for i in range(num_layers)]
        self.token = torch.full((num_layers, num_rows, size), -1, dtype=torch.int32, **on)  # position held
        self.last_used = torch.zeros((num_layers, num_rows, size), dtype=torch.int32, **on)  # step of last use
        self.slot_of = torch.full((num_layers, num_rows, max_context_len), -1, dtype=torch.int32, **on)
        self.lru = torch.arange(size, dtype=torch.int32, **on).repeat(num_layers, num_rows, 1)  # eviction order
        self.clock = torch.zeros(num_layers, dtype=torch.int32, **on)  # swap-ins so far, per layer
        self.stats = torch.zeros(2, dtype=torch.int64, **on)  # tokens read that were held (hits), copied in
        self.ready_chunk = READY_CHUNK  # the kernel's flags, one per chunk of a row's table entries, 0: copied in
        self.ready = torch.zeros((num_rows, -(-self.width // READY_CHUNK)), dtype=torch.int32, **on)
        self.copy_list = torch.zeros(num_rows * self.width, dtype=torch.int32, **on)  # (the kernel's copies)
        self.token_bytes = 2 * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()  # K + V

    @property
    def hits(self) -> int:
        return int(self.stats[0])

    @property
    def misses(self) -> int:
        return int(self.stats[1])

    @property
    def bytes_in(self) -> int:
        """K/V bytes copied in from the host pool so far."""
        return self.misses * self.token_bytes

    def base(self, row: int) -> int:
        return 1 + row * self.width

    def write_newest(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new token of each row (``k``, ``v``: ``[bs, H_kv, D]``) into its reserved slot."""
        check_hot_rows(self, layer, rows)
        want = (rows.shape[0], *self.k[layer].shape[1:])
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                fail(f"write_newest({name})", f"[bs, H_kv, D] = {want}", str(getattr(t, "shape", t)),
                     "pass the new tokens' K/V, one per row.", PoolError)
        slots = 1 + rows.to(self.device).long() * self.width + self.size
        self.k[layer][slots] = k.to(self.k[layer].dtype)
        self.v[layer][slots] = v.to(self.v[layer].dtype)

    def forget(self, row: int) -> None:
        """The row's request left: its slots hold nothing (the next request of the row starts empty)."""
        row = check_int("forget(row)", row, low=0, high=self.token.shape[1] - 1, error=PoolError,
                        fix="pass the finished request's req_pool_idx (a negative row would wrap to another's).")
        self.token[:, row] = -1
        self.last_used[:, row] = 0
        self.slot_of[:, row] = -1
        self.lru[:, row] = torch.arange(self.size, dtype=torch.int32, device=self.device)

    def swap_in(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor,
                seq_lens: torch.Tensor, host: HostKVPool, req_to_token: torch.Tensor) -> torch.Tensor:
        """int32 ``[bs, W]``: the hot slots of each row's first ``counts[b]`` ``positions`` (``positions_read``),
        0 past them; misses copied in from ``host``; the state updated."""
        check_hot_rows(self, layer, rows)
        check_hot_reads(self, rows, positions, counts, seq_lens)  # before anything changes
        self.clock[layer] += 1
        clock, table = int(self.clock[layer]), torch.zeros(positions.shape, dtype=torch.int32)
        hits = misses = 0
        for b, (row, n, seq_len) in enumerate(zip(rows.tolist(), counts.tolist(), seq_lens.tolist(), strict=True)):
            want, newest = positions[b, :n].tolist(), seq_len - 1
            tokens, used = self.token[layer, row].tolist(), self.last_used[layer, row].tolist()
            held = {t: s for s, t in enumerate(tokens) if t >= 0}
            needed = [t for t in want if t != newest]
            missing = [t for t in needed if t not in held]
            for t in needed:
                if t in held:
                    used[held[t]] = clock
            free = sorted((s for s in range(self.size) if used[s] != clock),  # empty slots first, then the least
                          key=lambda s: (tokens[s] >= 0, used[s] if tokens[s] >= 0 else 0, s))  # recently used
            victims = sorted(free[: len(missing)])  # in slot order
            for t, s in zip(missing, victims, strict=True):
                if tokens[s] >= 0:
                    del held[tokens[s]]
                tokens[s], used[s], held[t] = t, clock, s
            if missing:
                src = req_to_token[row, torch.tensor(missing, device=req_to_token.device)].long().cpu()
                dst = torch.tensor(victims, device=self.device) + self.base(row)
                self.k[layer][dst] = host.k[layer][src].to(self.device)
                self.v[layer][dst] = host.v[layer][src].to(self.device)
            self.token[layer, row] = torch.tensor(tokens, dtype=torch.int32)
            self.last_used[layer, row] = torch.tensor(used, dtype=torch.int32)
            self.lru[layer, row] = lru_order(self.token[layer, row], self.last_used[layer, row])
            self.slot_of[layer, row] = -1
            if held:
                self.slot_of[layer, row, torch.tensor(list(held))] = torch.tensor(list(held.values()),
                                                                                 dtype=torch.int32)
            hits, misses = hits + len(want) - len(missing), misses + len(missing)
            table[b, :n] = torch.tensor([self.base(row) + (self.size if t == newest else held[t]) for t in want],
                                        dtype=torch.int32)
        self.stats += torch.tensor([hits, misses], device=self.device)
        return table.to(self.device)


def lru_order(token: torch.Tensor, last_used: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., size]``: each row's slots in eviction order (empty first by slot id, then by ``last_used``,
    ties by slot id), from its ``token`` and ``last_used`` ``[..., size]``."""
    size = token.shape[-1]
    slot = torch.arange(size, device=token.device)
    key = torch.where(token >= 0, last_used.long() + 1, 0) * size + slot  # unique: argsort is the order
    return key.argsort(dim=-1).to(torch.int32)


def positions_read(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor, seq_lens: torch.Tensor,
                   page_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions int32 [bs, width], counts int32 [bs])``: the token positions attention reads, per row, in the
    order the all-on-device page table reads them (the first ``counts[b]`` valid, 0 after): the kept pages'
    tokens below ``seq_len`` for a sparse row, every token for a dense one. Tensor ops only (no host sync).

    Kept pages ascend, so only the last one can reach past ``seq_len``: the valid positions form a prefix."""
    bs, device = selected.shape[0], selected.device
    offsets = torch.arange(page_size, device=device)
    pos = (selected.long()[:, :, None] * page_size + offsets).reshape(bs, -1)
    j = torch.arange(max(width, pos.shape[1]), device=device)
    pos = torch.nn.functional.pad(pos, (0, j.numel() - pos.shape[1]))
    seq_lens = seq_lens.long()[:, None]
    kept = (j < lengths.long()[:, None] * page_size) & (pos < seq_lens)
    sparse = (sparse_mask & (lengths > 0))[:, None]
    valid = torch.where(sparse, kept, j < seq_lens)[:, :width]
    positions = torch.where(sparse, pos, j)[:, :width]
    return torch.where(valid, positions, 0).to(torch.int32), valid.sum(1).to(torch.int32)


def check_hot_rows(hot, layer, rows) -> None:
    """A layer with hot slots, and request rows of the buffer, each once (a row of -1 would wrap to the last row:
    another request's state)."""
    layers = [i for i, k in enumerate(hot.k) if k is not None]
    check_int("layer", layer, low=0, high=len(hot.k) - 1, error=PoolError)
    if hot.k[layer] is None:
        fail("layer", f"a layer with hot slots: {layers}", str(layer), "pass an offloaded layer.", PoolError)
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        fail("rows", "an int tensor [bs] of request rows", str(getattr(rows, "shape", rows)),
             "pass forward_batch.req_pool_indices.", PoolError)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= hot.token.shape[1]):
        fail("rows", f"request rows in [0, {hot.token.shape[1]})", str(rows.tolist()[:8]),
             "pass forward_batch.req_pool_indices (a negative row would wrap to another request's).", PoolError)
    if rows.unique().numel() != rows.numel():
        fail("rows", "each request row once", str(rows.tolist()[:8]), "batch each request once.", PoolError)


def check_hot_reads(hot, rows, positions, counts, seq_lens) -> None:
    """Each row's first ``counts`` positions lie in ``[0, seq_len)``, once each, and all but its newest fit its
    ``size`` slots (the engine sizes the buffer for its largest selection: ``check_offload``)."""
    bs = rows.shape[0]
    if tuple(positions.shape[:1]) != (bs,) or tuple(counts.shape) != (bs,) or tuple(seq_lens.shape) != (bs,):
        fail("positions, counts, seq_lens", f"one row each per request row ({bs})",
             f"{tuple(positions.shape)}, {tuple(counts.shape)}, {tuple(seq_lens.shape)}", "pass positions_read's "
             "output and the batch's seq_lens.", PoolError)
    for b, (n, seq_len) in enumerate(zip(counts.tolist(), seq_lens.tolist(), strict=True)):
        want = positions[b, :n].tolist() if 0 <= n <= positions.shape[1] else None
        if want is None or any(not 0 <= t < seq_len for t in want) or len(set(want)) != n:
            fail(f"positions[{b}]", f"counts[{b}] distinct positions in [0, seq_len={seq_len})",
                 f"counts {n}, positions {positions[b].tolist()[:8]}", "pass positions_read's output.", PoolError)
        if sum(t != seq_len - 1 for t in want) > hot.size:
            fail("hot.size", f"room for every token a row reads: at most {hot.size} + its newest token",
                 f"row {int(rows[b])} reading {n}", "build the buffer for the largest selection.")


def check_offload_backend(offloaded, backend) -> None:
    """Offload on a GPU needs the Triton backend: the host layers are read by kernels through unified addressing
    (the torch reference indexes host tensors with device indices: CPU only)."""
    if offloaded and backend.device.type == "cuda" and not backend.compiled:
        fail("backend", "'triton' (or 'auto') with offload_buffer on a GPU", repr(backend.name),
             "build the engine with backend='auto', or run the torch reference on CPU.", ConfigError)


READY_CHUNK = 256  # table entries per flag of the swap-in kernel's copies (attention's programs wait on them)
MAX_BUFFER = 1 << 16  # token slots a hot-buffer row may hold (the swap-in kernel's one program per row holds them)


def check_sizes(owner: str, **sizes) -> None:
    for name, value in sizes.items():
        check_int(f"{owner}({name})", value, low=1, high=INT32_MAX, error=ConfigError)


def check_layers_and_dtype(owner: str, num_layers: int, layers, dtype) -> None:
    """The layers that get slots, each in ``[0, num_layers)`` and once, and a K/V dtype the pool stores."""
    if layers is not None and (not isinstance(layers, (list, tuple, range)) or len(set(layers)) != len(layers) or
                               any(type(i) is not int or not 0 <= i < num_layers for i in layers)):
        fail(f"{owner}(layers)", f"distinct layer indices in [0, {num_layers})", repr(layers),
             "pass the offloaded layers (or None: every layer).", ConfigError)
    check_kv_dtype(f"{owner}(dtype)", dtype, ConfigError)


def check_offload(size, needed: int, layer_names: list[str]) -> int:
    """The hot buffer's size: an int at least the most tokens one row of a sparse layer reads in a step, at most
    ``MAX_BUFFER`` (checked when the engine is built, so that no step is refused later)."""
    size = check_int("offload_buffer", size, low=1, high=MAX_BUFFER, error=ConfigError,
                     fix=f"a hot buffer of 1 to {MAX_BUFFER} token slots a request row.")
    if size < needed:
        fail("offload_buffer", f"at least {needed} token slots: the most tokens one request reads in a step (the "
             f"selection budget, or a dense row below min_sparse_seq_len) in layers {layer_names}", repr(size),
             f"pass offload_buffer >= {needed} (HiSparse's default is twice the top-k).", ConfigError)
    return size
