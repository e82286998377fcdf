"""``python -m sparse_ref.bench``: refuses CPU runs unless asked, labels them, writes the JSON the notebooks read."""

import json

import pytest
import torch

import sparse_ref
from sparse_ref import bench


@pytest.mark.skipif(sparse_ref.default_device().type == "cuda", reason="checks the CPU refusal")
def test_refuses_cpu_without_allow_cpu(tmp_path):
    with pytest.raises(SystemExit, match="--allow-cpu"):
        bench.main(["topk", "--quick", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


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
    randn = bench.make_distribution("randn", 2, 4096, "cpu")
    indexer = bench.make_distribution("indexer", 2, 4096, "cpu")
    clustered = bench.make_distribution("clustered", 2, 4096, "cpu")
    assert randn.unique().numel() > 8000  # distinct values
    assert indexer.min() >= 0 and indexer.unique().numel() < 0.5 * indexer.numel()  # ReLU sums, many ties
    assert clustered.unique().numel() <= 8 * 64  # a few clusters
    assert all(t.dtype == torch.float32 and t.shape == (2, 4096) for t in (randn, indexer, clustered))
    with pytest.raises(ValueError):
        bench.make_distribution("uniform", 1, 8, "cpu")


@pytest.mark.gpu
def test_gpu_bench_quick_select(tmp_path):
    result = bench.main(["select", "--quick", "--out", str(tmp_path / "g.json")])
    assert not result["cpu_only"] and result["copy_bandwidth_tbps"] > 0.5
    assert all(r["ours_us"] > 0 for r in result["rows"])
