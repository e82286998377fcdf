"""Registers and spills of the long-row top-k kernels on sm_90, without a GPU.

    python benchmarks/kernel_registers.py

Compiles each kernel of the long-row top-k (``kernels/topk_threshold.py``, ``kernels/topk_select.py``)
at the 64 x 64K, k=2048 launch shape (Triton's ahead-of-time path, as ``tests/test_aot_compile.py``) and
runs the ``ptxas`` that ships with Triton with ``-v`` on its PTX. A program's registers bound how many of
its programs an SM holds at once (65536 registers per SM), which matters for the memory-bound passes.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU target even on a machine without one

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparse_ref.kernels import topk, topk_select, topk_threshold  # noqa: E402

POINTERS = dict(scores="*fp32", out="*i32", cand="*i32", work="*i32", sync="*i32")  # (k: an int)
SHAPE = dict(lengths=None, G=4096, LOG_C=5)  # 64 x 65536, k=2048: G = 4096, 32 chunks of 2048
KERNELS = [  # (kernel, its other constexprs, num_warps as the launcher's defaults)
    (topk_threshold._delegates_kernel, dict(COLS=1024, ROWS=8, LOCAL=True), topk.TUNING["delegate_warps"]),
    (topk_select._candidates_kernel, dict(CHUNK=2048, SLOTS=4096, BITMASK=True, REVERSE=True),
     topk.TUNING["candidate_warps"]),
    (topk_select._select_kernel, dict(CHUNK=2048, SLOTS=4096, BITMASK=True, PAIR=128, SPAN=16384,
                                      TILE=topk.TUNING["tie_tile"]), topk.TUNING["select_warps"]),
]


def ptxas_report(kernel, constexprs: dict, num_warps: int) -> str:
    """ptxas -v's register and spill lines for one compile variant (PDL on, as on a Hopper GPU)."""
    constexprs = {"PDL": True, **SHAPE, **constexprs}
    signature = {a: "constexpr" if a in constexprs else POINTERS.get(a, "i32") for a in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    result = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                            text=True, check=True)
    os.unlink(f.name)
    return " | ".join(line.split(":", 1)[-1].strip() for line in result.stderr.splitlines()
                      if "registers" in line or "spill" in line)


if __name__ == "__main__":
    for kernel, constexprs, num_warps in KERNELS:
        report = ptxas_report(kernel, constexprs, num_warps)
        print(f"{kernel.fn.__name__:<20} {num_warps:2d} warps: {report}", flush=True)
