"""KV offload to host memory with a per-request device hot buffer, as SGLang's HiSparse does (torch reference).

Every token's K/V lives in a host pool (pinned when CUDA is there), addressed by the same slots as the KV
pool (``req_to_token``). On the device each request row owns a hot buffer of ``size`` token slots, replaced
least-recently-used, plus one slot reserved for the newest token: the write path puts the new token's K/V
there (and in the host pool), so it is always a hit. Each step, per layer, ``swap_in`` turns the tokens that
attention reads (a request's kept pages or tokens, or all of a dense row's) into hot slots: a hit keeps its
slot, a miss takes a free slot or the least recently used one this step does not need, and its K/V is copied
in from the host pool. Attention then reads the hot buffer through a page-size-1 table: the same tokens, in
the same order, as the all-on-device step.

This reference keeps the buffer's bookkeeping on the host (it reads each selection back: a host sync per
layer on a GPU); ``hits`` and ``misses`` count every lookup, ``bytes_in`` the K/V bytes copied in.
"""

from __future__ import annotations

import torch

from sparse_ref.checks import check_int, fail
from sparse_ref.errors import ConfigError


class HostKVPool:
    """Every layer's K/V ``[num_slots, H_kv, D]`` in host memory, pinned when CUDA is there (copies can be async)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
        pin = torch.cuda.is_available()
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V rows of ``slots`` (the KV pool's slots) into the host pool."""
        slots = slots.cpu().long()
        self.k[layer][slots] = k.to("cpu", self.k[layer].dtype)
        self.v[layer][slots] = v.to("cpu", self.v[layer].dtype)


class HotBuffer:
    """Per (layer, request row): ``size`` token slots replaced least-recently-used, and the newest token's slot.

    Slot ids index ``k[layer]`` / ``v[layer]`` ``[1 + rows * (size + 1), H_kv, D]`` (slot 0 is padding); row
    ``r`` owns ``1 + r * (size + 1) + [0, size]``, its last one the newest token's.
    """

    def __init__(self, num_layers: int, num_rows: int, size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        self.size, self.width, self.device = size, size + 1, torch.device(device)
        shape = (1 + num_rows * self.width, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.token = torch.full((num_layers, num_rows, size), -1, dtype=torch.int64)  # position held (-1: empty)
        self.last_used = torch.zeros((num_layers, num_rows, size), dtype=torch.int64)  # step of its last use
        self.clock = self.hits = self.misses = self.bytes_in = 0

    def base(self, row: int) -> int:
        return 1 + row * self.width

    def write_newest(self, layer: int, rows: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """The new token of each row (``k``, ``v``: ``[bs, H_kv, D]``) into its reserved slot."""
        slots = torch.tensor([self.base(r) + self.size for r in rows], dtype=torch.long, device=self.device)
        self.k[layer][slots] = k.to(self.k[layer].dtype)
        self.v[layer][slots] = v.to(self.v[layer].dtype)

    def forget(self, row: int) -> None:
        """The row's request left: its slots hold nothing (the next request of the row starts empty)."""
        self.token[:, row] = -1
        self.last_used[:, row] = 0

    def swap_in(self, layer: int, rows: list[int], positions: list[list[int]], seq_lens: list[int],
                host: HostKVPool, req_to_token: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table int32 [bs, width], kv_lens int32 [bs])``: hot slots of each row's ``positions`` (ascending
        token positions that attention reads), 0 past them; misses copied in from ``host``."""
        self.clock += 1
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for b, (row, want, seq_len) in enumerate(zip(rows, positions, seq_lens, strict=True)):
            newest = seq_len - 1
            tokens, used = self.token[layer, row], self.last_used[layer, row]
            held = {int(t): s for s, t in enumerate(tokens.tolist()) if t >= 0}
            needed = [t for t in want if t != newest]
            assert len(needed) <= self.size, "the engine sizes the buffer for its largest selection"
            missing = [t for t in needed if t not in held]
            keep = {held[t] for t in needed if t in held}
            free = sorted((s for s in range(self.size) if s not in keep),
                          key=lambda s: (int(tokens[s]) >= 0, int(used[s]), s))  # empty first, then least recent
            if missing:
                slots = torch.tensor(free[: len(missing)], dtype=torch.long)
                src = req_to_token[row, torch.tensor(missing, device=req_to_token.device)].long().cpu()
                dst = (self.base(row) + slots).to(self.device)
                self.k[layer][dst] = host.k[layer][src].to(self.device, non_blocking=True)
                self.v[layer][dst] = host.v[layer][src].to(self.device, non_blocking=True)
                tokens[slots] = torch.tensor(missing)
                held.update(zip(missing, slots.tolist(), strict=True))
                self.bytes_in += 2 * host.k[layer][src].numel() * host.k[layer].element_size()
            for t in needed:
                used[held[t]] = self.clock
            self.hits += len(needed) - len(missing) + (newest in want)
            self.misses += len(missing)
            slot_of = {**held, newest: self.size}
            table[b, : len(want)] = torch.tensor([self.base(row) + slot_of[t] for t in want], dtype=torch.int32)
        kv_lens = torch.tensor([len(w) for w in positions], dtype=torch.int32)
        return table.to(self.device), kv_lens.to(self.device)


def positions_read(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor,
                   seq_lens: torch.Tensor, page_size: int) -> list[list[int]]:
    """The token positions attention reads, per row, in the order the all-on-device page table reads them: the
    kept pages' tokens (below ``seq_len``) for a sparse row, every token for a dense one."""
    out = []
    for sel, n_kept, sparse, seq_len in zip(selected.tolist(), lengths.tolist(), sparse_mask.tolist(),
                                            seq_lens.tolist(), strict=True):
        if sparse and n_kept > 0:
            out.append([p * page_size + o for p in sel[:n_kept] for o in range(page_size) if p * page_size + o
                        < seq_len])
        else:
            out.append(list(range(seq_len)))
    return out


def check_offload(size, needed: int, layer_names: list[str]) -> int:
    """The hot buffer's size: an int at least the most tokens one row of a sparse layer reads in a step."""
    size = check_int("offload_buffer", size, low=1, error=ConfigError)
    if size < needed:
        fail("offload_buffer", f"at least {needed} token slots: the most tokens one request reads in a step (the "
             f"selection budget, or a dense row below min_sparse_seq_len) in layers {layer_names}", repr(size),
             f"pass offload_buffer >= {needed} (HiSparse's default is twice the top-k).", ConfigError)
    return size
