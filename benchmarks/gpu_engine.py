"""GPU check of the decode engine, the demo and notebook 07, in one command (exit code != 0 on any failure).

    python benchmarks/gpu_engine.py            # from the repository root, on a CUDA machine

1. ``pytest tests/test_engine.py tests/test_demo.py``: on CUDA this includes the engine on the GPU
   (Triton Quest scoring, Triton page selection, Triton decode attention) against the CPU engine,
   and the Triton attention backend against torch through the engine;
2. ``python -m sparse_ref.demo`` at GPU sizes (32K-token requests), which prints sparse and dense
   time per decode step;
3. notebook 07 under nbmake at GPU sizes (``SPARSE_REF_FAST=0``).

Prints a compact table at the end: step, exit code, seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STEPS = [
    ("pytest engine + demo", [sys.executable, "-m", "pytest", "tests/test_engine.py", "tests/test_demo.py", "-q",
                              "-rs"], {}),
    ("demo (GPU sizes)", [sys.executable, "-m", "sparse_ref.demo", "--out", "build/demo_gpu.png"], {}),
    ("nbmake 07 (GPU sizes)", [sys.executable, "-m", "pytest", "--nbmake", "notebooks/07_end_to_end.ipynb",
                               "--nbmake-timeout=900", "-q"], {"SPARSE_REF_FAST": "0"}),
]


def main() -> int:
    rows = []
    for name, cmd, env in STEPS:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
        rows.append((name, rc, time.perf_counter() - start))
    print("\nstep                     rc   seconds")
    for name, rc, seconds in rows:
        print(f"{name:<24} {rc:>3} {seconds:>9.1f}")
    return 1 if any(rc for _, rc, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
