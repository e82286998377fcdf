"""Count the places where code reads a tensor's value back to Python: each is a host sync on a GPU.

On a CPU nothing syncs, so the engine's "no host sync in a decode step" is counted instead: the tensor
methods and torch functions that must wait for the device (``item``, ``tolist``, ``bool(t)``, ``int(t)``,
``torch.equal``, ``nonzero``, ``unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``)
are wrapped for the duration of a ``with`` block, and each call is counted by the line that made it.
On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the real check (``tests/test_host_syncs.py``).
"""

from __future__ import annotations

import collections
import contextlib
import traceback

import torch

TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
                  "masked_select")
TORCH_FUNCTIONS = ("equal", "nonzero", "unique", "masked_select", "repeat_interleave")


@contextlib.contextmanager
def count_host_reads():
    """Yield a ``Counter`` of ``"<what> <file>:<line>"`` -> calls, filled while the block runs."""
    where: collections.Counter = collections.Counter()
    saved = {}

    def wrap(owner, name):
        original = getattr(owner, name)
        saved[(owner, name)] = original

        def counted(*args, **kwargs):
            if not (name == "repeat_interleave" and "output_size" in kwargs):  # with output_size: no sync
                caller = traceback.extract_stack(limit=3)[-2]
                where[f"{name} {caller.filename.rsplit('/', 2)[-1]}:{caller.lineno}"] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in TENSOR_METHODS:
        wrap(torch.Tensor, name)
    for name in TORCH_FUNCTIONS:
        wrap(torch, name)
    try:
        yield where
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
