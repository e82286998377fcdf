"""The fast tier: Triton kernels, one module (or subpackage) per kernel family.

Each family's public function checks its inputs (``sparse_ref.checks``), then launches; the torch
reference it must match lives in the reading set of ``sparse_ref``. Kernel modules import only the
leaf modules ``errors``, ``checks`` and ``device`` of the package; everything else (configs, pools)
arrives as an argument. Launch knobs live in one ``TUNING`` table per family, never in a public
signature: ``tuning(table, **knobs)`` sets some for a ``with`` block (benchmarks and tests use it).
One switch is shared by every family: programmatic dependent launch between consecutive launches
(``after_previous_launch`` in the kernel, ``pdl_options`` at the launch; a ``"pdl"`` knob per table).

Importing this package goes through ``sparse_ref/__init__.py`` first, which turns on Triton's
interpreter when there is no GPU.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from sparse_ref.checks import fail
from sparse_ref.device import triton_interpreted
from sparse_ref.errors import ConfigError


@triton.jit
def after_previous_launch(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and later). A kernel launched with ``launch_pdl=True`` may
    start while the kernel before it on the stream is still finishing: every program first waits here
    until that kernel's writes are visible (so nothing is read or written early), then allows the next
    kernel to launch, so that its programs are scheduled while this one runs instead of after a gap.
    A no-op when PDL is False (CPU interpreter, older GPUs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_options(device: torch.device, on: bool = True) -> dict:
    """Launch options for ``after_previous_launch``: the constexpr and ``launch_pdl`` when ``on`` (a family's
    ``TUNING["pdl"]``) on a Hopper-or-later GPU; off on the CPU interpreter."""
    on = (bool(on) and device.type == "cuda" and not triton_interpreted()
          and torch.cuda.get_device_capability(device)[0] >= 9)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


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
