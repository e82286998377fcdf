"""The fast tier: Triton kernels, one module (or subpackage) per kernel family.

Each family's public function checks its inputs (``sparse_ref.checks``), then launches; the torch
reference it must match lives in the reading set of ``sparse_ref``. Kernel modules import only the
leaf modules ``errors``, ``checks`` and ``device`` of the package; everything else (configs, pools)
arrives as an argument. Launch knobs live in one ``TUNING`` table per family, never in a public
signature: ``tuning(table, **knobs)`` sets some for a ``with`` block (benchmarks and tests use it).
One switch is shared by every family: programmatic dependent launch between consecutive launches
(``after_previous_launch`` in the kernel, ``pdl_options`` at the launch), on wherever the GPU has it.

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
    """Launch options for ``after_previous_launch``: the constexpr and ``launch_pdl`` when ``on`` (the default) on a
    Hopper-or-later GPU; off on the CPU interpreter."""
    on = (bool(on) and device.type == "cuda" and not triton_interpreted()
          and torch.cuda.get_device_capability(device)[0] >= 9)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


class Knob:
    """The declared range of one launch knob: an int in ``[low, high]`` (a power of two with ``pow2``; 0 also
    allowed with ``zero``: "off"), or a flag (True / False); ``none``: None also allowed ("the default")."""

    def __init__(self, low: int = 0, high: int = 0, *, pow2: bool = False, zero: bool = False, none: bool = False,
                 flag: bool = False):
        self.low, self.high, self.pow2, self.zero, self.none, self.flag = low, high, pow2, zero, none, flag

    def describe(self) -> str:
        if self.flag:
            want = "True or False"
        else:
            want = f"{'a power of two' if self.pow2 else 'an int'} in [{self.low}, {self.high}]"
            want += " or 0 (off)" if self.zero else ""
        return want + (" or None (the default)" if self.none else "")

    def check(self, name: str, value):
        if value is None and self.none:
            return value
        if self.flag:
            if value is not True and value is not False:
                fail(name, self.describe(), repr(value), "leave the default.", ConfigError)
            return value
        ok = isinstance(value, int) and not isinstance(value, bool) and (
            (value == 0 and self.zero) or (self.low <= value <= self.high and not (self.pow2 and value & (value - 1))))
        if not ok:
            fail(name, self.describe(), repr(value), "leave the default (or None where allowed).", ConfigError)
        return value


class Knobs(dict):
    """A family's ``TUNING`` table: launch knobs by name, each value checked against its declared range
    (``Knob``) whenever it is set (``tuning``, ``table[name] = v``, ``table.update``, ``table |= {...}``), so a bad
    knob raises a ``ConfigError`` naming it, never an out-of-bounds access inside a kernel; no knob can be
    removed (``del``, ``pop``, ``popitem``, ``clear`` raise instead of leaving a launch a missing key)."""

    def __init__(self, family: str, ranges: dict[str, Knob], **defaults):
        super().__init__()
        self.family, self.ranges = family, ranges
        assert set(defaults) == set(ranges), "every knob has a declared range"
        self.update(defaults)

    def __setitem__(self, name, value) -> None:
        if name not in self.ranges:
            fail(f"{self.family}.TUNING", f"a knob of this table: {sorted(self.ranges)}", repr(name),
                 "name a knob the table has.", ConfigError)
        super().__setitem__(name, self.ranges[name].check(f"{self.family}.TUNING[{name!r}]", value))

    def update(self, *args, **kwargs) -> None:
        values = dict(*args, **kwargs)
        for name, value in values.items():  # all checked before any is set
            if name in self.ranges:
                self.ranges[name].check(f"{self.family}.TUNING[{name!r}]", value)
        for name, value in values.items():
            self[name] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, name, value=None):
        if name not in self:
            self[name] = value
        return self[name]

    def _removes(self, *args, **kwargs):
        fail(f"{self.family}.TUNING", "every knob kept (a launch reads each one)", "an attempt to remove one",
             "set the knob to another value in its range instead, e.g. with tuning(table, knob=value).",
             ConfigError)

    __delitem__ = pop = popitem = clear = _removes


@contextlib.contextmanager
def tuning(table: Knobs, **knobs):
    """Set launch knobs of one family's ``TUNING`` table inside a ``with`` block; restore them after.

    ``with tuning(decode_attention.TUNING, num_splits=4): ...``. An unknown knob, or a value outside the
    knob's declared range, raises ``ConfigError`` at once, before anything is set.
    """
    if not isinstance(table, Knobs):
        fail("tuning(table)", "a kernel family's TUNING table (e.g. sparse_ref.kernels.topk.TUNING)",
             type(table).__name__, "pass the family's TUNING.", ConfigError)
    unknown = sorted(set(knobs) - set(table))
    if unknown:
        fail("tuning", f"knobs of this table: {sorted(table)}", f"{unknown}", "name a knob the table has.",
             ConfigError)
    saved = dict(table)
    table.update(knobs)  # every value checked first: nothing is set if one is out of range
    try:
        yield table
    finally:
        table.update(saved)  # (every knob is always there: restoring is setting them all back)
