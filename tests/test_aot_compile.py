"""Every Triton kernel of ``kernels/`` compiles for sm_90 ahead of time, without a GPU.

Triton's interpreter runs kernels as Python and accepts code the real compiler refuses (a
loop-carried variable that changes type, say), so CI compiles each kernel for an H100/H200
target (``GPUTarget("cuda", 90, 32)``) through ``triton.compile(ASTSource(...))``. Nothing is
launched, so no GPU is needed.

The rule: each module ``kernels/<name>.py`` exports ``AOT_VARIANTS``, a list of
``(kernel, signature, constexprs)`` or ``(kernel, signature, constexprs, options)`` tuples
(``options`` e.g. ``{"num_warps": 8}``), covering the constexpr variants its launcher uses (a
representative subset where there are many). **Every module-level ``triton.JITFunction`` whose
name ends in ``_kernel`` (i.e. everything that is launched) must appear in ``AOT_VARIANTS``**;
``@triton.jit`` helpers (other names) are compiled as part of the kernels that call them. Modules
are discovered by listing ``kernels/*.py``, so a new kernel module is checked without editing
this file. All compiles run in one subprocess with ``TRITON_INTERPRET=0``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels"

SCRIPT = r"""
import importlib, json, os, sys, time
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sparse_ref  # noqa: F401  (sets nothing: TRITON_INTERPRET is already chosen)

target = GPUTarget("cuda", 90, 32)
report = {"compiled": [], "failed": [], "uncovered": [], "no_variants": []}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(f"sparse_ref.kernels.{name}")
    kernels = {k for k, v in vars(module).items()  # the kernels defined here, not those imported
               if isinstance(v, triton.JITFunction) and k.endswith("_kernel") and v.fn.__module__ == module.__name__}
    variants = getattr(module, "AOT_VARIANTS", None)
    if variants is None:
        if kernels:
            report["no_variants"].append(name)
        continue
    covered = {v[0].fn.__name__ for v in variants}
    report["uncovered"] += [f"{name}.{k}" for k in sorted(kernels - covered)]
    for variant in variants:
        kernel, signature, constexprs = variant[:3]
        options = variant[3] if len(variant) > 3 else {}
        signature = {**signature, **{c: "constexpr" for c in constexprs}}
        label = f"{name}.{kernel.fn.__name__} {constexprs} {options}"
        t = time.time()
        try:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                           options=options)
            report["compiled"].append(f"{label} ({time.time() - t:.1f} s)")
        except Exception as e:  # noqa: BLE001
            report["failed"].append(f"{label}: {type(e).__name__}: {str(e)[-600:]}")
print("AOT-REPORT " + json.dumps(report))
"""


def kernel_modules() -> list[str]:
    return sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")


def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(kernel_modules())], capture_output=True,
                          text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AOT-REPORT ")]
    assert proc.returncode == 0 and lines, f"compile script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1][len("AOT-REPORT "):])
    assert not report["no_variants"], f"kernel modules without AOT_VARIANTS: {report['no_variants']}"
    assert not report["uncovered"], f"kernels missing from AOT_VARIANTS: {report['uncovered']}"
    assert not report["failed"], "sm_90 compile failures:\n" + "\n".join(report["failed"])
    assert report["compiled"], "nothing was compiled"
