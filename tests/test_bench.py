"""``python -m sparse_ref.bench``: refuses CPU runs unless asked, labels them, writes the JSON the notebooks read."""

import json
from pathlib import Path

import pytest
import torch

import sparse_ref
from sparse_ref import bench
from sparse_ref.workloads import make_distribution


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="checks the CPU refusal")
def test_refuses_cpu_without_allow_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["topk", "--quick", "--out", str(tmp_path / "new" / "x.json")])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, naming the flag
    assert "--allow-cpu" in line
    assert not (tmp_path / "new").exists(), "a refused run creates no folder"


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="the CPU smoke run")
def test_cpu_smoke_run_is_labelled(tmp_path):
    out = tmp_path / "cpu.json"
    result = bench.main(["topk", "--quick", "--allow-cpu", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["cpu_only"] is True and "NOT GPU" in saved["gpu"]
    assert {"command", "gpu", "torch", "triton", "date", "copy_bandwidth_tbps", "rows"} <= saved.keys()
    row = saved["rows"][0]
    assert {"shape", "k", "distribution", "l2", "torch_us", "ours_us", "speedup", "tbps", "pct_copy_bw"} <= row.keys()
    assert row["ours_us"] > 0 and row["torch_us"] > 0


def test_distributions_are_hard_in_the_intended_way():
    randn = make_distribution("randn", 2, 4096, "cpu")
    indexer = make_distribution("indexer", 2, 4096, "cpu")
    clustered = make_distribution("clustered", 2, 4096, "cpu")
    assert randn.unique().numel() > 8000  # distinct values
    assert indexer.min() >= 0 and indexer.unique().numel() < 0.5 * indexer.numel()  # ReLU sums, many ties
    assert clustered.unique().numel() <= 8 * 64  # a few clusters
    assert all(t.dtype == torch.float32 and t.shape == (2, 4096) for t in (randn, indexer, clustered))
    with pytest.raises(ValueError):
        make_distribution("uniform", 1, 8, "cpu")


@pytest.mark.gpu
def test_gpu_bench_quick_select(tmp_path):
    result = bench.main(["select", "--quick", "--out", str(tmp_path / "g.json")])
    assert not result["cpu_only"] and result["copy_bandwidth_tbps"] > 0.5
    assert all(r["ours_us"] > 0 for r in result["rows"])


REPO_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def test_help_shows_the_default_out(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "default: build/bench/<suites>-<gpu|cpu>.json" in text


def test_default_out_is_a_build_path_never_the_results():
    assert bench.default_out(["topk"], on_cpu=True) == Path("build/bench/topk-cpu.json")
    gpu_out = bench.default_out(["quest", "retrieve", "quest"], on_cpu=False)
    assert gpu_out == Path("build/bench/quest+retrieve-gpu.json")
    for suites in (["all"], ["topk", "select"]):
        for on_cpu in (True, False):
            assert not bench._in_results_dir(bench.default_out(suites, on_cpu))
    assert bench._in_results_dir(Path("benchmarks/results/h200.json"))
    assert bench._in_results_dir(REPO_RESULTS / "sub" / "x.json")
    assert not bench._in_results_dir(Path("benchmarks/resultsx.json"))


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="checks where a CPU run writes")
def test_cpu_run_without_out_writes_the_build_path(tmp_path, monkeypatch):
    committed = {p: p.read_bytes() for p in REPO_RESULTS.glob("*.json")}
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # as if run from a checkout's root
    bench.main(["topk", "--quick", "--allow-cpu"])
    written = tmp_path / "build" / "bench" / "topk-cpu.json"
    assert json.loads(written.read_text())["cpu_only"] is True
    assert list((tmp_path / "benchmarks" / "results").iterdir()) == []
    assert {p: p.read_bytes() for p in REPO_RESULTS.glob("*.json")} == committed


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="checks the CPU refusal")
@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_cpu_run_refuses_to_write_into_benchmarks_results(tmp_path, where, capsys):
    target = REPO_RESULTS / "h200.json" if where == "repo" else tmp_path / "benchmarks" / "results" / "cpu.json"
    before = target.read_bytes() if target.exists() else None
    with pytest.raises(SystemExit) as info:
        bench.main(["topk", "--quick", "--allow-cpu", "--out", str(target)])
    assert info.value.code == 2
    assert "committed GPU results" in capsys.readouterr().err
    assert (target.read_bytes() if target.exists() else None) == before


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="cuDNN refuses CPU tensors only on CPU")
def test_sdpa_baseline_falls_through_to_a_backend_that_runs(monkeypatch):
    """The dense baseline a user would pick: torch SDPA, the first backend that runs the shape (GQA included);
    a backend that refuses it is recorded, not fatal."""
    from sparse_ref.bench import decode
    from sparse_ref.bench.timing import Timer

    monkeypatch.setattr(decode, "SDPA_BACKENDS", ("CUDNN_ATTENTION", "MATH"))
    got = decode.sdpa_baseline(Timer(torch.device("cpu"), reps=2), 2, 4, 2, 16, 40, torch.device("cpu"))
    assert got["sdpa_backend"] == "MATH" and got["sdpa_us"] > 0
    assert list(got["sdpa_not_run"]) == ["CUDNN_ATTENTION"] and got["sdpa_not_run"]["CUDNN_ATTENTION"]


def test_bench_json_is_strict_json():
    """A NaN or infinity in a row is written as null: a bare NaN is not JSON, and strict parsers refuse the file."""
    from sparse_ref.cli import json_safe

    row = {"speedup": float("nan"), "tbps": float("inf"), "parts": [1.0, float("-inf")], "ok": 2.5}
    text = json.dumps(json_safe(row), allow_nan=False)
    assert json.loads(text) == {"speedup": None, "tbps": None, "parts": [1.0, None], "ok": 2.5}
    with pytest.raises(ValueError):
        json.dumps(row, allow_nan=False)


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="the CPU smoke run")
def test_offload_suite_reports_hit_rates_bytes_and_both_sides(tmp_path):
    """The offload suite's rows: per-step hit rates in [0, 1] that start cold, bytes moved that match
    (1 - hit rate) x tokens read x bytes per token, and each timed row beside its baseline."""
    bench.main(["offload", "--quick", "--allow-cpu", "--out", str(tmp_path / "o.json")])
    saved = json.loads((tmp_path / "o.json").read_text())
    hits = [r for r in saved["rows"] if r["op"] == "offload_hit_rate"]
    assert {(r["algorithm"], r["distribution"].split()[0]) for r in hits} == {
        (a, d) for a in ("quest", "deepseek_dsa") for d in ("planted", "drift")}
    for r in hits:
        per_step = r["hit_rate_per_step"]
        assert all(0 <= h <= 1 for h in per_step) and per_step[0] < r["hit_rate_steady"]
        assert r["bytes_per_step"][0] > 0 and all(
            abs(b - f) <= 1 for b, f in zip(r["bytes_per_step"], r["formula_bytes_per_step"], strict=True))
    swaps = {r["distribution"]: r for r in saved["rows"] if r["op"] == "offload_swap_in"}
    assert set(swaps) == {"from pinned host", "from device"} and swaps["from pinned host"]["torch_us"] > 0
    (step,) = [r for r in saved["rows"] if r["op"] == "offload_step"]
    assert step["torch_us"] > 0 and step["ours_us"] > 0 and step["misses_per_replay"] >= 0
    assert set(step["parts_us"]) == {"device", "offload"} and "swap-in (both launches)" in step["parts_us"]["offload"]
    assert all(v > 0 for p in step["parts_us"].values() for v in p.values())


def test_a_missing_peer_is_null_with_its_reason(monkeypatch, tmp_path):
    """The production peers: on CPU each is None with "needs a CUDA GPU"; a library path that does not exist, or
    that is not set, gives its reason instead of a number (the row records no made-up time)."""
    from sparse_ref.bench import peers

    rows = peers.time_peers(bench.Timer(torch.device("cpu"), 3), [torch.randn(2, 64)], 8)
    assert rows["sglang fast_topk"] is None and rows["flashinfer top_k"] is None
    assert rows["sglang fast_topk (why not)"] == "needs a CUDA GPU"
    (tmp_path / "garbage.so").write_bytes(b"not a library")
    for value, why in (("", "is not set"), (str(tmp_path / "none.so"), "no such file"),
                       (str(tmp_path / "garbage.so"), "failed: OSError")):
        monkeypatch.setattr(peers, "_LOADED", {})  # (a peer is looked for once a process)
        monkeypatch.setenv(peers.SGL_LIB_ENV, value)
        ops, reason = peers.sglang_ops()
        assert ops is None and why in reason


def test_a_peers_ids_are_exact_in_any_order_and_any_tie_rule_but_not_wrong():
    """A peer's ids are compared by the scores they select: its own order and tie rule pass, a wrong id does not."""
    from sparse_ref.bench.peers import exact
    from sparse_ref.selection import topk_reference

    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0]])
    want = topk_reference(x, 2, order="index")  # ids 0 and 2: ties to the lower id
    assert exact(want, x, 2) and exact(want.flip(1), x, 2)
    assert exact(torch.tensor([[4, 2]]), x, 2), "another two of the tied 3.0s: a valid top-2"
    assert not exact(torch.tensor([[0, 3]]), x, 2), "2.0 is not among the top 2"
    assert not exact(torch.tensor([[0, 6]]), x, 2) and not exact(torch.tensor([[0, -1]]), x, 2), "ids out of range"
