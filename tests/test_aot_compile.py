"""Every Triton kernel of ``sparse_ref.kernels`` compiles for sm_90 ahead of time, without a GPU.

Triton's interpreter runs kernels as Python and accepts code the real compiler refuses (a
loop-carried variable that changes type, say), so CI compiles each kernel for an H100/H200
target (``GPUTarget("cuda", 90, 32)``) through ``triton.compile(ASTSource(...))``. Nothing is
launched, so no GPU is needed.

The variants live in ``tests/aot_variants.py`` (the constexpr variants the launchers pick at the
GPU shapes). **Every module-level ``triton.JITFunction`` of ``sparse_ref.kernels`` whose name ends
in ``_kernel`` (i.e. everything that is launched) must appear there**; ``@triton.jit`` helpers
(other names) are compiled as part of the kernels that call them. Modules are discovered by walking
the package, so a new kernel module is checked without editing this file. All compiles run in one
subprocess with ``TRITON_INTERPRET=0``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import importlib, json, os, pkgutil, sys, time
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sparse_ref.kernels

sys.path.insert(0, sys.argv[1])
from aot_variants import VARIANTS

target = GPUTarget("cuda", 90, 32)
report = {"compiled": [], "failed": [], "uncovered": []}
kernels = set()
for info in pkgutil.walk_packages(sparse_ref.kernels.__path__, "sparse_ref.kernels."):
    module = importlib.import_module(info.name)
    kernels |= {f"{info.name}.{k}" for k, v in vars(module).items()  # defined here, not imported
                if isinstance(v, triton.JITFunction) and k.endswith("_kernel") and v.fn.__module__ == info.name}
covered = {f"{v[0].fn.__module__}.{v[0].fn.__name__}" for v in VARIANTS}
report["uncovered"] = sorted(kernels - covered)
for kernel, signature, constexprs, options in VARIANTS:
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    label = f"{kernel.fn.__module__}.{kernel.fn.__name__} {constexprs} {options}"
    t = time.time()
    try:
        triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                       options=options)
        report["compiled"].append(f"{label} ({time.time() - t:.1f} s)")
    except Exception as e:  # noqa: BLE001
        report["failed"].append(f"{label}: {type(e).__name__}: {str(e)[-600:]}")
print("AOT-REPORT " + json.dumps(report))
"""


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS)], capture_output=True, text=True, env=env,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AOT-REPORT ")]
    assert proc.returncode == 0 and lines, f"compile script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1][len("AOT-REPORT "):])
    assert not report["uncovered"], f"kernels missing from tests/aot_variants.py: {report['uncovered']}"
    assert not report["failed"], "sm_90 compile failures:\n" + "\n".join(report["failed"])
    assert report["compiled"], "nothing was compiled"
