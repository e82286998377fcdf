"""``python -m sparse_ref.demo --quick`` runs, prints its table and saves the plot; the numbers are seeded."""

import subprocess
import sys

from sparse_ref import demo


def test_demo_quick_mode_runs_and_saves_a_plot(tmp_path):
    out = tmp_path / "demo.png"
    proc = subprocess.run([sys.executable, "-m", "sparse_ref.demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for label, *_ in demo.METHODS:
        assert label in text
    assert "[6/6]" in text and "mass kept" in text and "plot saved to" in text
    assert out.is_file() and out.stat().st_size > 10_000


def test_demo_numbers_reproduce_and_full_budget_is_dense():
    kwargs = dict(context=160, batch=2, steps=1, progress=lambda line: None)
    small = demo.PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=1)
    a = demo.sweep([32, 256], workload=small, **kwargs)
    b = demo.sweep([32, 256], workload=small, **kwargs)
    assert [(r.recall, r.mass_kept, r.output_error) for r in a] == [(r.recall, r.mass_kept, r.output_error) for r in b]
    for r in a:
        if r.budget == 256:  # more than the context: every method reads everything
            assert r.mass_kept > 1 - 1e-5 and r.output_error < 1e-4, r
        else:
            assert r.mass_kept < 1 and r.output_error > 1e-3, r
