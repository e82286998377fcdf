"""The fast tier: Triton kernels, one module (or subpackage) per kernel family.

Each family's public function checks its inputs (``sparse_ref.checks``), then launches; the torch
reference it must match lives in the reading set of ``sparse_ref``. Kernel modules import only the
leaf modules ``errors``, ``checks`` and ``device`` of the package; everything else (configs, pools)
arrives as an argument. Launch knobs live in one ``TUNING`` table per family, never in a public
signature: ``tuning(table, **knobs)`` sets some for a ``with`` block (benchmarks and tests use it).

Importing this package goes through ``sparse_ref/__init__.py`` first, which turns on Triton's
interpreter when there is no GPU.
"""

from __future__ import annotations

import contextlib

from sparse_ref.checks import fail
from sparse_ref.errors import ConfigError


@contextlib.contextmanager
def tuning(table: dict, **knobs):
    """Set launch knobs of one family's ``TUNING`` table inside a ``with`` block; restore them after.

    ``with tuning(decode_attention.TUNING, num_splits=4): ...``. An unknown knob raises ``ConfigError``
    at once; a bad value raises when a launcher reads it.
    """
    unknown = sorted(set(knobs) - set(table))
    if unknown:
        fail("tuning", f"knobs of this table: {sorted(table)}", f"{unknown}", "name a knob the table has.",
             ConfigError)
    saved = dict(table)
    table.update(knobs)
    try:
        yield table
    finally:
        table.clear()
        table.update(saved)
