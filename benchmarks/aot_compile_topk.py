"""Compile the split-chain top-k kernels for sm_90 on a machine without a GPU (nothing is launched).

The interpreter runs kernels as Python, so it cannot see compile-only errors (a loop-carried variable
changing type, say). Run ``python benchmarks/aot_compile_topk.py [--quick]`` before spending GPU time;
``AOT_FILE=path/to/topk.py`` checks another copy of the kernel file."""
import inspect
import itertools
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
import importlib.util  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import sparse_ref  # noqa: E402,F401

if os.environ.get("AOT_FILE"):
    spec = importlib.util.spec_from_file_location("topk_under_test", os.environ["AOT_FILE"])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
else:
    from sparse_ref.kernels import topk as m  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTRS_F = {"scores"}
PTRS_I = {"hist", "split_buf", "out", "lengths_out", "k_ptr", "len_ptr", "budget_ptr", "seq_ptr", "cand_key",
          "cand_id", "cand_n", "overflow"}


def sig_for(fn, constexprs, dtype="*fp32"):
    params = inspect.signature(fn.fn).parameters
    sig = {}
    for name in params:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in PTRS_F:
            sig[name] = dtype
        elif name == "mask_ptr":
            sig[name] = "*i1"
        elif name in PTRS_I:
            sig[name] = "*i32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(fn, constexprs, num_warps, dtype="*fp32"):
    src = ASTSource(fn=fn, signature=sig_for(fn, constexprs, dtype), constexprs=constexprs)
    t = time.time()
    triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    return time.time() - t


failures = 0
n = 0
flag_sets = [dict(HAS_K=a, HAS_LEN=b, PAGE=c, USE_TABLE=d) for a, b, c, d in
             [(False, False, False, False), (False, True, False, False), (True, True, False, False),
              (False, False, True, False), (False, False, True, True)]]
quick = "--quick" in sys.argv
for flags, buffer, (block, warps) in itertools.product(flag_sets[:2] if quick else flag_sets, (True, False),
                                                       [(512, 4), (1024, 8), (32, 1)]):
    jobs = [(m._radix_pass_kernel, dict(PASS=p, BITS=8, BLOCK=block, BUFFER=buffer, **flags)) for p in range(4)]
    jobs.append((m._compact_kernel, dict(BITS=8, BLOCK=block, S_PAD=16, BUFFER=buffer, **flags)))
    for fn, ce in jobs:
        n += 1
        try:
            dt = compile_one(fn, ce, warps)
            print(f"ok   {fn.fn.__name__:<20} {ce} warps={warps} ({dt:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"FAIL {fn.fn.__name__:<20} {ce} warps={warps}: {str(e)[-400:]}", flush=True)
print(f"{n - failures}/{n} compiled for sm_90")
sys.exit(1 if failures else 0)
