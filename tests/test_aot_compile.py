"""Every Triton kernel that is launched compiles for sm_90 ahead of time, without a GPU, under each Triton (and, at
the GPU shapes, for the older GPUs a tutorial audience brings: sm_89, sm_80, sm_75).

Triton's interpreter runs kernels as Python and accepts code the real compiler refuses (a variable
that changes type in a branch, say one that starts as the constexpr an int argument of 1 becomes), so
CI compiles each kernel for an H100/H200 target (``GPUTarget("cuda", 90, 32)``) through
``triton.compile(ASTSource(...))``. Nothing is launched, so no GPU is needed. Two sources of variants:

* ``tests/aot_variants.py``: the constexpr variants the package's launchers pick at the GPU shapes.
  **Every module-level ``triton.JITFunction`` of ``sparse_ref.kernels`` named ``*_kernel`` (everything
  that is launched) must appear there**; helpers are compiled as part of the kernels that call them.
* every launch this session made through the interpreter (``launch_recorder.py``): the package's kernels
  at the tests' sizes, the tests' own kernels and the notebooks'. That test must see them all: in one
  process it runs last (``conftest.py``); ``make test`` runs the tests and notebooks in parallel workers,
  which all append to one record file, then this test on its own.

A GPU-shape variant is compiled to PTX and a cubin under the installed Triton (to the IR under the other, and for
the older GPUs); a recorded launch through the TritonGPU IR under the installed Triton (the frontend and the
layout lowering, where the interpreter's leniency shows: types, power-of-two ranges) and the frontend alone
under the other (a third of the time again; the GPU check runs the default launches there for real),
which takes a tenth of the time (the stage runner uses ``triton.compiler``'s ``make_backend``, the same
steps ``triton.compile`` takes). The compiles run in subprocesses with ``TRITON_INTERPRET=0``: once with
the installed Triton, and once with each other Triton found under ``build/tritons/<version>/`` (``make
tritons`` installs 3.6 there, the GPU machine's version), so both supported Tritons compile every
variant. Variants are spread over the machine's cores.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import launch_recorder
import pytest
from aot_variants import VARIANTS, runs_on

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
OTHER_TRITONS = REPO / "build" / "tritons"

SCRIPT = r"""
import importlib, json, os, pkgutil, sys, time
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sparse_ref.kernels

tests, part, parts, records_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]  # "-": the variants
capabilities = [int(c) for c in sys.argv[5].split(",")]  # 90: sm_90 (H100/H200); 89 L4, 80 A100, 75 T4
depth = sys.argv[6]  # "cubin": through ptxas; "ttgir": to the TritonGPU IR; "ttir": the frontend only
sys.path.insert(0, tests)
sys.path.insert(0, os.path.join(os.path.dirname(tests), "kernels"))  # the lesson kernels (kernels/*.py)
from aot_variants import VARIANTS, runs_on

targets = {c: GPUTarget("cuda", c, 32) for c in capabilities}
report = {"triton": triton.__version__, "compiled": 0, "failed": [], "uncovered": [], "seconds": 0.0}


def to_ttgir(src, options, target):
    # what triton.compile runs up to the TritonGPU IR (or the Triton IR: depth), the frontend where the interpreter's
    # leniency shows (types, power-of-two ranges) and the layouts, without LLVM and ptxas: a tenth of the time
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    options = backend.parse_options(dict(options or {}, **src.parse_options()))
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    names = list(stages)
    for name in names[names.index(src.ext): names.index(depth) + 1]:
        module = stages[name](module, {"target": target, **options.__dict__})
    return module
start = time.time()
kernels = set()
for info in pkgutil.walk_packages(sparse_ref.kernels.__path__, "sparse_ref.kernels."):
    module = importlib.import_module(info.name)
    kernels |= {f"{info.name}.{k}" for k, v in vars(module).items()  # defined here, not imported
                if isinstance(v, triton.JITFunction) and k.endswith("_kernel") and v.fn.__module__ == info.name}
covered = {f"{v[0].fn.__module__}.{v[0].fn.__name__}" for v in VARIANTS}
report["uncovered"] = sorted(kernels - covered)


def notebook_kernel(entry):
    # a kernel defined in a notebook: its namespace's jit functions, rebuilt from their sources as a module
    # (triton.jit reads a function's source from its file)
    import hashlib, tempfile
    lines = ["import triton", "import triton.language as tl"]
    lines += [f"from {module} import {name} as {alias}" for module, name, alias in entry["imports"]]
    text = "\n".join(lines) + "\n\n\n" + "\n\n".join(entry["sources"][::-1])
    name = "notebook_kernels_" + hashlib.sha1(text.encode()).hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), "sparse_ref_aot")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name + ".py")
    if not os.path.exists(path):  # written once, atomically: parallel workers import it while others write
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return getattr(importlib.import_module(name), entry["kernel"])


jobs = [(kernel, sig, ce, opts, "variant", c) for c in capabilities for kernel, sig, ce, opts in VARIANTS
        if runs_on(kernel, sig, ce, c)] if records_path == "-" else []
if records_path != "-" and os.path.exists(records_path):
    for line in dict.fromkeys(open(records_path)):  # each distinct launch once (every process appends its own)
        e = json.loads(line)
        if e["module"] == "__main__":
            kernel = notebook_kernel(e)
        else:
            kernel = getattr(importlib.import_module(e["module"]), e["kernel"])
        sig = {k: tuple(v) if isinstance(v, list) else v for k, v in e["signature"].items()}
        ce = {tuple(int(i) for i in k.split(",")) if "," in k else k: v for k, v in e["constexprs"].items()}
        jobs.append((kernel, sig, ce, e["options"] or {}, "launch", capabilities[0]))
mine = [job for i, job in enumerate(jobs) if i % parts == part]
for i, (kernel, sig, ce, opts, kind, capability) in enumerate(mine):
    if i % max(1, len(mine) // 5) == 0:  # progress, read by the parent as it goes
        print(f"AOT-PROGRESS {i} {len(mine)}", flush=True)
    sig = {**sig, **{c: "constexpr" for c in ce if isinstance(c, str)}}
    if "PDL" in ce and capability < 90:  # programmatic dependent launch is Hopper's: off below (pdl_options)
        ce = {**ce, "PDL": False}
    try:
        src = ASTSource(fn=kernel, signature=sig, constexprs=ce)
        if depth == "cubin":  # the GPU shapes on an H100/H200: PTX and a cubin
            triton.compile(src, target=targets[capability], options=opts)
        else:  # the frontend (types, ranges: where the interpreter is lenient), and the TritonGPU lowering
            to_ttgir(src, opts, targets[capability])
        report["compiled"] += 1
    except Exception as e:  # noqa: BLE001
        label = f"{kind} sm_{capability} {kernel.fn.__module__}.{kernel.fn.__name__} {ce} {opts}"
        report["failed"].append(f"{label}: {type(e).__name__}: {str(e)[-700:]}")
report["seconds"] = round(time.time() - start, 1)
print("AOT-REPORT " + json.dumps(report))
"""


def tritons() -> list[tuple[str, dict]]:
    """``(name, environment)`` per Triton to compile with: the installed one, then each under build/tritons/."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    found = [("installed", env)]
    for folder in sorted(OTHER_TRITONS.glob("*")) if OTHER_TRITONS.is_dir() else []:
        found.append((folder.name, {**env, "PYTHONPATH": os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])}))
    return found


def compile_all(env: dict, records: str, parts: int, capabilities=(90,), label: str = "",
                depth: str = "ttgir") -> list[dict]:
    """Compile in ``parts`` processes; a line of progress as each passes a fifth of its share (seen with ``-s``, as
    ``make test`` runs the recorded launches: that step takes minutes on 2 cores)."""
    done, start = {}, time.time()

    def one(part):
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(TESTS), str(part), str(parts), records,
                                 ",".join(map(str, capabilities)), depth],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("AOT-PROGRESS "):
                done[part] = [int(n) for n in line.split()[1:]]
                counts = [sum(d[i] for d in done.values()) for i in (0, 1)]
                print(f"  compile check {label} sm_{'/'.join(map(str, capabilities))}: {counts[0]} of {counts[1]}+ in "
                      f"{time.time() - start:.0f} s", flush=True)
        stderr = proc.stderr.read()
        proc.wait(timeout=1500)
        reports = [line for line in lines if line.startswith("AOT-REPORT ")]
        assert proc.returncode == 0 and reports, f"compile script failed:\n{''.join(lines)[-3000:]}\n{stderr[-3000:]}"
        return json.loads(reports[-1][len("AOT-REPORT "):])

    with ThreadPoolExecutor(parts) as pool:
        return list(pool.map(one, range(parts)))


PARTS = max(1, min(4, os.cpu_count() or 1))


@pytest.mark.parametrize("name, env", tritons(), ids=[name for name, _ in tritons()])
def test_gpu_shape_variants_compile_for_sm90(name, env):
    """The variants of ``aot_variants.py``, under the installed Triton to PTX and a cubin (ptxas sees what the IR does
    not: registers, Hopper-only instructions), under the GPU machine's to the TritonGPU IR (the GPU check runs
    them there for real); every launched kernel of the package is among them."""
    pytest.importorskip("triton")
    reports = compile_all(env, "-", parts=PARTS, depth="cubin" if name == "installed" else "ttgir")
    failed = [f for r in reports for f in r["failed"]]
    print(f"triton {reports[0]['triton']} ({name}): {sum(r['compiled'] for r in reports)} GPU-shape variants "
          f"compiled, {max(r['seconds'] for r in reports)} s")
    assert not reports[0]["uncovered"], f"kernels missing from tests/aot_variants.py: {reports[0]['uncovered']}"
    assert not failed, f"sm_90 compile failures under triton {reports[0]['triton']}:\n" + "\n".join(failed)
    assert sum(r["compiled"] for r in reports) >= 100, "fewer variants than the GPU-shape table holds"


def test_gpu_shape_variants_compile_for_older_gpus():
    """The variants the backend launches on an L4 (8.9), an A100 or A10G (8.0; 8.6 compiles alike) and a T4 (7.5),
    under the installed Triton, through the TritonGPU IR (where a dtype or an instruction the target lacks fails):
    every variant but those whose operation takes its torch twin there (``aot_variants.runs_on``)."""
    older = (89, 80, 75)
    reports = compile_all(tritons()[0][1], "-", parts=PARTS, capabilities=older)
    failed = [f for r in reports for f in r["failed"]]
    compiled = sum(r["compiled"] for r in reports)
    want = {c: sum(runs_on(kernel, sig, ce, c) for kernel, sig, ce, _ in VARIANTS) for c in older}
    print(f"triton {reports[0]['triton']}: {compiled} GPU-shape variants compiled for sm_89/80/75 ({want}), "
          f"{max(r['seconds'] for r in reports)} s")
    assert not failed, f"compile failures under triton {reports[0]['triton']}:\n" + "\n".join(failed)
    assert compiled == sum(want.values()) and min(want.values()) >= 60, (compiled, want)


@pytest.mark.parametrize("name, env", tritons(), ids=[name for name, _ in tritons()])
def test_recorded_launches_compile_for_sm90(name, env):
    """Every launch this session's tests and notebooks made through the interpreter, to the TritonGPU IR (the other
    Triton: its frontend). It runs after them (``conftest.py`` puts it last; ``make test`` runs it on its own after
    the parallel run)."""
    pytest.importorskip("triton")
    records = os.environ.get(launch_recorder.ENV, "-")
    if records == "-" or not os.path.exists(records) or not os.path.getsize(records):
        pytest.skip("no launch was recorded in this session (a GPU runs compiled kernels, nothing to record)")
    reports = compile_all(env, records, parts=PARTS, label=f"triton {name}, recorded launches,",
                          depth="ttgir" if name == "installed" else "ttir")
    failed = [f for r in reports for f in r["failed"]]
    print(f"triton {reports[0]['triton']} ({name}): {sum(r['compiled'] for r in reports)} recorded launches "
          f"compiled, {max(r['seconds'] for r in reports)} s")
    assert not failed, f"sm_90 compile failures under triton {reports[0]['triton']}:\n" + "\n".join(failed)
