"""The backend: the decode step's operations, each a Triton kernel or its torch twin, chosen once per device.

``choose_backend(backend, device)`` turns the user's one argument (``"auto"``, ``"torch"``, ``"triton"``) into a
``Backend``: a table of operations, one signature per row whichever side runs it. The engine builds one and
hands it to the algorithms, the adaptor, the offload and the graph step, which call ``backend.attention(...)``
and never ask which side they hold. ``"auto"`` is Triton on a CUDA GPU and torch on a CPU (the kernels would
run there through Triton's interpreter: exact, slow). On a GPU the Triton side keeps to what the GPU's compute
capability runs (``CAPABILITIES``); where it cannot, that operation takes its torch twin and says so in one
line, once. ``SPARSE_REF_CAPABILITY=8.0`` makes the package believe it runs on another capability (a test aid:
the choice changes, the GPU does not). ``docs/design.md`` section 3.11 has the table and why.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparse_ref.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
CAPABILITY_ENV = "SPARSE_REF_CAPABILITY"
# What a GPU below a capability cannot run in Triton: (operation, the tensor dtype that needs it, the capability,
# what it is). T4 (7.5) has no bf16 tensor cores; A100 and A10G (8.0, 8.6) no FP8; L4 (8.9) and H100/H200 (9.0) all.
CAPABILITIES = (
    ("attention", torch.bfloat16, (8, 0), "bf16 K/V"),
    ("dsa_logits", torch.float8_e4m3fn, (8, 9), "FP8 keys"),
    ("dsa_logits", torch.bfloat16, (8, 0), "bf16 keys"),
    ("quest_scores", torch.bfloat16, (8, 0), "bf16 bounds"),
    ("update_bounds", torch.bfloat16, (8, 0), "bf16 bounds"),
)
# Which argument of each of those operations carries that dtype (keys, bounds, K/V)
_DTYPE_ARGUMENT = {"attention": 1, "dsa_logits": 2, "quest_scores": 1, "update_bounds": 1}
_said: set[str] = set()
OPERATIONS = ("quest_scores", "update_bounds", "select_pages", "select_to_table", "page_table", "attention",
              "dsa_logits", "topk", "swap_in")
# The torch column: each twin registers itself where it is defined (``@torch_twin("attention")``); importing
# sparse_ref imports every module that defines one, so the column is whole before anyone chooses a backend.
TORCH_TWINS: dict[str, Callable] = {}


def torch_twin(operation: str):
    """Register the decorated function as the torch side of ``operation`` (one of ``OPERATIONS``)."""
    assert operation in OPERATIONS and operation not in TORCH_TWINS, operation

    def register(fn: Callable) -> Callable:
        TORCH_TWINS[operation] = fn
        return fn
    return register


@dataclass(frozen=True)
class Backend:
    """One column of the operations table (the signatures: ``docs/design.md`` section 3.11)."""

    name: str  # "torch" or "triton"
    device: torch.device
    capability: tuple[int, int] | None  # the GPU's (or SPARSE_REF_CAPABILITY's); None on a CPU
    quest_scores: Callable  # (queries, page_min, page_max, page_valid, req_to_token, rows, P, max_pages, gqa_mode)
    update_bounds: Callable  # (k_buffer, page_min, page_max, page_valid, req_to_token, rows, seq_lens, P, prefix_lens)
    select_pages: Callable  # (scores, seq_lens, sparse_mask, P, config) -> (selected, lengths)
    select_to_table: Callable  # (... , rows, req_to_token, out) -> (selected, lengths, page_table, kv_lens, cu)
    page_table: Callable  # (selected, lengths, sparse_mask, seq_lens, rows, req_to_token, P, out) -> (table, ...)
    attention: Callable  # (q, k_buffer, v_buffer, page_table, kv_lens, P) -> fp32 [bs, H_q, D]
    dsa_logits: Callable  # (q, weights, keys, scales, block_table, token_req, bounds, width, fill_tail)
    topk: Callable  # (scores, k, lengths, order=, width=) -> int32 ids
    swap_in: Callable  # (hot, layer, md, batch, new_kv, host, req_to_token) -> (table, counts)
    torch_for: tuple = ()  # (operation, dtype) pairs this GPU sends to the torch twin (CAPABILITIES)

    @property
    def compiled(self) -> bool:
        """Triton compiled for a GPU: no host sync (a CUDA graph can hold the step; the torch offload reference reads
        back) and pinned host memory read through unified addressing (an offloaded layer's K/V)."""
        return self.name == "triton" and self.device.type == "cuda"

    @property
    def syncs(self) -> bool:
        """The torch column: its offload swap-in reads each selection back on the host (no CUDA graph holds it)."""
        return self.name == "torch"


def choose_backend(backend="auto", device="cpu") -> Backend:
    """The ``Backend`` for ``device`` (a ``Backend`` passes through; see the module docstring)."""
    if isinstance(backend, Backend):
        return backend
    device = torch.device(device)
    name, capability = check_backend(backend, device)
    ops = {op: TORCH_TWINS[op] for op in OPERATIONS}
    torch_for = tuple((op, dtype) for op, dtype, needed, _ in CAPABILITIES
                      if name == "triton" and capability is not None and capability < needed)
    if name == "triton":
        torch_ops, ops = ops, triton_ops(ops)
        for op, dtype, needed, what in CAPABILITIES:
            if (op, dtype) in torch_for:
                ops[op] = _unless(dtype, _DTYPE_ARGUMENT[op], ops[op], torch_ops[op], f"{op.replace('_', ' ')}: "
                                  f"{what} need compute capability {needed[0]}.{needed[1]}; this GPU has "
                                  f"{capability[0]}.{capability[1]}, using the torch path")
    return Backend(name, device, capability, **ops, torch_for=torch_for)


def triton_ops(twins: dict) -> dict:
    """The Triton column: each kernel's launcher at its torch twin's signature (the caller has checked the values).
    Page selection holds a row in one program's registers; longer rows select in torch (the table still in Triton)."""
    from functools import partial  # lazy below: torch alone never imports a kernel

    from sparse_ref.kernels import decode_attention, dsa, page_select, page_table, quest, quest_bounds, swap_in, topk

    def fits(scores):
        return scores.shape[1] <= page_select.MAX_REGISTER_PAGES

    table = partial(page_table.page_table_from_selection, check_values=False)

    def select_pages(scores, seq_lens, sparse_mask, page_size, config):
        if not fits(scores):
            return twins["select_pages"](scores, seq_lens, sparse_mask, page_size, config)
        return page_select.select_pages_triton(scores, seq_lens, sparse_mask, page_size, config, check_values=False)

    def select_to_table(scores, seq_lens, sparse_mask, page_size, config, rows, req_to_token, out=None):
        if fits(scores):
            return page_select.select_pages_to_table(scores, seq_lens, sparse_mask, page_size, config, rows,
                                                     req_to_token, out=out, check_values=False)
        selected, lengths = select_pages(scores, seq_lens, sparse_mask, page_size, config)
        return selected, lengths, *table(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size, out)

    def dsa_logits(q, weights, keys, scales, block_table, token_req, bounds, width, fill_tail=True):
        return dsa.paged_indexer_logits(q, weights, keys, scales, block_table, token_req, bounds, width,
                                        fill_tail=fill_tail, check_values=False)

    return dict(quest_scores=partial(quest.quest_page_scores_from_queries, check_values=False),
                update_bounds=quest_bounds.update_page_bounds, select_pages=select_pages,
                select_to_table=select_to_table, page_table=table, attention=decode_attention.paged_decode_attention,
                dsa_logits=dsa_logits, topk=topk.topk, swap_in=swap_in.swap_in)


def _unless(dtype, argument: int, kernel: Callable, twin: Callable, line: str) -> Callable:
    """``kernel``, except on a ``dtype`` tensor at ``argument``: ``twin``, saying ``line`` once."""
    def op(*args, **kwargs):
        if args[argument].dtype != dtype:
            return kernel(*args, **kwargs)
        if line not in _said:
            _said.add(line)
            print(line)
        return twin(*args, **kwargs)
    return op


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability the backend plans for: ``SPARSE_REF_CAPABILITY`` where set, else the GPU's."""
    value = os.environ.get(CAPABILITY_ENV, "").strip()
    if value:
        major, _, minor = value.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ConfigError(f"{CAPABILITY_ENV}: expected a compute capability such as 8.0 or 7.5, got {value!r}. "
                              f"Fix: unset it (the GPU's own), or e.g. {CAPABILITY_ENV}=8.0.")
        return int(major), int(minor)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


# ------------------------------ argument checks (each entry point above calls one first)
def check_backend(backend, device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """``(name, capability)``: ``"auto"`` resolved (Triton on CUDA, torch elsewhere); anything else refused."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: expected one of {BACKENDS} (or a Backend), got {backend!r}. Fix: leave "
                          "backend='auto' (Triton on a GPU, torch on CPU), or 'torch' for the references, 'triton' "
                          "for the kernels.")
    name = ("triton" if device.type == "cuda" else "torch") if backend == "auto" else backend
    return name, capability(device) if name == "triton" else None
