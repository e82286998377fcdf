"""A newcomer's first day: the commands the README gives work as root, refuse what cannot run before any work,
and print nothing that is not for the reader (start-up warnings, the interpreter's numpy warnings)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_ref import bench, demo
from sparse_ref.cli import cli_parser

REPO = Path(__file__).resolve().parents[1]


def make_variable(name: str) -> str:
    """The value of a Makefile variable, as make expands it."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-%: ; @echo $($*)", f"print-{name}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def dry_run(target: str, *args: str) -> str:
    out = subprocess.run(["make", "-n", "--no-print-directory", target, *args], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---------------------------------------------------------------- the student copies open as root too
def test_homework_opens_the_student_copies_in_jupyterlab_as_root_too():
    commands = dry_run("homework")
    assert "student_copy.py" in commands and "build/exercises" in commands
    lab = dry_run("lab", "LAB_DIR=build/exercises")
    assert "-m jupyterlab" in lab and "build/exercises/" in lab
    assert ("--allow-root" in lab) == (os.geteuid() == 0), lab


def test_the_readme_opens_the_student_copies_through_make():
    readme = (REPO / "README.md").read_text()
    assert "make homework" in readme
    assert "jupyterlab build/exercises" not in readme, "a bare jupyterlab call exits 1 as root"


# ---------------------------------------------------------------- the demo refuses what does not fit memory
def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert out.out == "" and "Traceback" not in line
    return line


def test_a_demo_too_large_for_any_machine_is_refused_with_the_estimate(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(["--batch", "256", "--context", str(1 << 20)], capsys)
    assert "--context" in line and "GiB" in line and "is free" in line and "Fix:" in line
    assert list(tmp_path.iterdir()) == []


def test_the_largest_context_the_refusal_names_is_accepted(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "free_memory_bytes", lambda gpu: 4 << 30)
    line = refused(["--context", "200000"], capsys)
    fits = int(line.split("Fix: --context ")[1].split()[0])
    assert 8 * 3 <= fits < 200000
    parser = cli_parser("demo", "")
    args = type("Args", (), dict(json=None, tp=1, seed=0, context=fits, quick=False, batch=3, steps=None,
                                 budgets=None))()
    assert demo.check_demo_args(parser, args, gpu=False)[0] == fits
    args.context = fits + 1
    with pytest.raises(SystemExit):
        demo.check_demo_args(parser, args, gpu=False)


def test_free_memory_is_positive_and_below_the_machine():
    free = demo.free_memory_bytes(gpu=False)
    assert 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- --budgets past the context
@pytest.mark.parametrize("argv", [["--quick", "--budgets", "512"], ["--context", "300", "--budgets", "64", "300"],
                                  ["--context", "1000"]])  # the default budgets reach 1024
def test_budgets_that_would_read_the_whole_context_are_refused(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(argv, capsys)
    assert "--budgets" in line and "dense" in line


# ---------------------------------------------------------------- --out that cannot be written, before any work
@pytest.mark.parametrize("main, argv", [(demo.main, []), (bench.main, ["topk", "--allow-cpu"])])
def test_an_out_folder_that_cannot_be_made_is_refused_before_any_work(main, argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", "/proc/no_such_folder/result.png"])  # /proc refuses root too
    assert info.value.code == 2
    out = capsys.readouterr()
    assert "--out" in out.err and "cannot write" in out.err and out.out == ""


def test_the_out_probe_leaves_no_folder_behind(tmp_path):
    from sparse_ref.cli import cli_output_file

    assert cli_output_file(str(tmp_path / "a" / "b" / "plot.png")) == tmp_path / "a" / "b" / "plot.png"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- torchrun: the line once, exit 2 on every rank
@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_bad_flag_under_torchrun_is_printed_by_rank_zero_only(rank, printed, capsys, monkeypatch):
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as info:
        demo.main(["--batch", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("--batch" in err) == printed and (err == "") != printed


def test_a_world_size_mismatch_is_printed_by_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert demo.main(["--tp", "2", "--quick"]) == 2
        assert ("WORLD_SIZE=3" in capsys.readouterr().err) == printed


# ---------------------------------------------------------------- the bench's summary in fixed columns
def test_the_bench_summary_keeps_long_names_in_their_columns():
    rows = [dict(op="offload_hit_rate", shape="bs=8 ctx=32768 budget=2048 buffer=4096", k=None,
                 distribution="planted", l2="cold", torch_us=float("nan"), ours_us=12.34, speedup=None, tbps=None,
                 pct_copy_bw=None),
            dict(op="topk", shape="64x65536", k=2048, distribution="randn", l2="cold", torch_us=105.83, ours_us=42.1,
                 speedup=2.513, tbps=3.1, pct_copy_bw=72.25)]
    lines = bench.summary_table(rows).splitlines()
    assert "nan" not in "\n".join(lines).lower()
    starts = [lines[0].index(h) for h in ("shape", "dist", "L2")]
    for line, row in zip(lines[1:], rows, strict=True):
        assert [line.index(row[key]) for key in ("shape", "distribution", "l2")] == starts, lines
        assert line[starts[0] - 2: starts[0]] == "  "  # the op never runs into the shape
    assert lines[2].split() == ["topk", "64x65536", "2048", "randn", "cold", "105.8", "42.1", "2.51", "3.10", "72.2"]


# ---------------------------------------------------------------- nothing printed that is not for the reader
def test_notebook_kernels_start_without_the_tcp_warning(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1 + 1)")])
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    quiet = make_variable("QUIET_KERNEL").strip('"')
    assert "log_level=ERROR" in quiet
    cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", quiet, "--output-dir",
           str(tmp_path / "out"), "--ExecutePreprocessor.kernel_name=python3", str(tmp_path / "tiny.ipynb")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    assert "$(QUIET_KERNEL)" in (REPO / "Makefile").read_text().split("\ntutorial:")[1].split("\n\n")[0]


NAN_LAUNCH = """
import torch, sparse_ref
from sparse_ref.kernels.decode_attention import paged_decode_attention
pool, q = torch.randn(48, 1, 8), torch.randn(1, 2, 8)  # 3 pages of 16
q[0, 1, 3] = float("nan")  # every logit of head 1 is NaN: numpy warns "invalid value" on NaN - NaN
out = paged_decode_attention(q, pool, pool, torch.tensor([[1, 2]], dtype=torch.int32),
                             torch.tensor([20], dtype=torch.int32), 16)
assert bool(out[0, 1].isnan().all()) and bool(out[0, 0].isfinite().all())
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's warnings")
def test_nan_inputs_through_the_interpreter_print_no_numpy_warning():
    """As a reader's script or notebook sees it (pytest keeps its own warning filters): a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TRITON_INTERPRET")}
    run = subprocess.run([sys.executable, "-c", NAN_LAUNCH], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    assert "Warning" not in run.stderr, run.stderr


# ---------------------------------------------------------------- first commands, first mistakes: one line each
def run_python(*args, env=None, cwd=REPO):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_the_package_and_the_tp_module_say_which_command_runs_them():
    package = run_python("-m", "sparse_ref")
    assert package.returncode == 1 and "python -m sparse_ref.demo" in package.stderr
    assert "Traceback" not in package.stderr
    tp = run_python("-m", "sparse_ref.demo_tp", "--tp", "2")  # (it once did nothing and exited 0)
    assert tp.returncode == 1 and "torchrun --standalone --nproc-per-node 2 -m sparse_ref.demo" in tp.stderr


def test_a_missing_notebook_for_the_student_copy_is_one_line(tmp_path):
    run = run_python(str(REPO / "scripts" / "student_copy.py"), "missing.ipynb", "--out", str(tmp_path / "out"),
                     cwd=tmp_path)
    assert run.returncode == 2 and "missing.ipynb" in run.stderr and "no such file" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_triton_imported_first_on_a_cpu_is_explained():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", "import triton, sparse_ref"], capture_output=True, text=True,
                         timeout=300, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1 and "import sparse_ref first" in run.stderr.splitlines()[-1], run.stderr
    show = "import sparse_ref, triton, os; print(os.environ['TRITON_INTERPRET'])"
    fine = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=300,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert fine.returncode == 0 and fine.stdout.strip() == "1", fine.stderr


@pytest.mark.parametrize("main, argv", [(demo.main, ["--quick"]), (bench.main, ["topk", "--allow-cpu"])])
@pytest.mark.parametrize("name, value", [("SPARSE_REF_FAST", "maybe"), ("SPARSE_REF_CAPABILITY", "eight")])
def test_a_bad_environment_switch_is_one_line_before_any_work(main, argv, name, value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert name in line and "Fix:" in line and out.out == "" and list(tmp_path.iterdir()) == []


def test_repeated_budgets_add_up(monkeypatch):
    seen = {}

    def check(parser, args, gpu):
        seen["budgets"] = args.budgets
        raise SystemExit(0)

    monkeypatch.setattr(demo, "check_demo_args", check)
    with pytest.raises(SystemExit):
        demo.main(["--budgets", "128", "--budgets", "256", "64"])
    assert seen["budgets"] == [128, 256, 64]


def test_an_out_path_through_a_missing_folder_and_back_makes_and_removes_nothing_else(tmp_path):
    """``a/missing/../b/x.json`` once made ``missing``, removed the existing empty ``a/b`` and ended in a traceback."""
    from sparse_ref.cli import cli_output_file

    (tmp_path / "a" / "b").mkdir(parents=True)
    assert cli_output_file(str(tmp_path / "a" / "missing" / ".." / "b" / "x.json")) == tmp_path / "a" / "b" / "x.json"
    assert cli_output_file(str(tmp_path / "a" / "missing" / ".." / "c" / "x.json")) == tmp_path / "a" / "c" / "x.json"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"] and not list((tmp_path / "a" / "b").iterdir())


@pytest.mark.parametrize("device", ["cuda:99", "mps", "xla"])
def test_a_device_torch_cannot_run_here_is_refused_at_the_entry_points(device):
    from sparse_ref.engine import DecodeEngine
    from sparse_ref.errors import ConfigError
    from sparse_ref.offload import HotBuffer
    from sparse_ref.workloads import PlantedEngineWorkload

    wl = PlantedEngineWorkload(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, seed=0)
    with pytest.raises(ConfigError, match="device"):
        DecodeEngine(wl, ["quest"], device=device)
    with pytest.raises(ConfigError, match="device"):
        HotBuffer(1, 1, 4, 1, 8, 16, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_with_the_fix():
    from sparse_ref.engine import DecodeEngine
    from sparse_ref.errors import ConfigError
    from sparse_ref.workloads import PlantedEngineWorkload

    wl = PlantedEngineWorkload(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, seed=0)
    with pytest.raises(ConfigError, match=r"device: expected a CUDA GPU torch can see \(0 here\).*device='cpu'"):
        DecodeEngine(wl, ["quest"], device="cuda")


def test_a_long_demo_says_how_long_is_left(monkeypatch):
    """``--steps 10000`` runs for hours: after the first run, each progress line says about how long is left."""
    clock = iter([0, 0, *range(90, 100_000, 90)])  # the start, then each run takes 90 s
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(demo, "run_one", lambda *args, **kwargs: None)
    lines = []
    demo.sweep([64, 128], context=512, batch=2, steps=10_000, progress=lines.append, workload=object())
    runs = len(lines)
    assert runs == 2 * len(demo.METHODS) and "left" not in lines[0]
    assert lines[1].endswith(f"about {90 * (runs - 1) / 60:.0f} min left)"), lines[1]
