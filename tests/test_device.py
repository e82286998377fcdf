"""Tests for sparse_ref.device: TRITON_INTERPRET set before kernels load, fast mode parsing, describe_run.

Import-time behaviour is tested in subprocesses with a clean environment, since this process
has imported sparse_ref already.
"""

import os
import subprocess
import sys

import pytest
import torch

import sparse_ref
from sparse_ref import ConfigError, device

NO_GPU = not torch.cuda.is_available()


def run_clean(code: str, **env) -> str:
    """Run ``code`` in a fresh interpreter whose environment has no TRITON_*/SPARSE_REF_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "SPARSE_REF_"))}
    clean.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# Imports the kernels subpackage first: sparse_ref/__init__ still runs before it and configures Triton.
PROBE = (
    "import os, sparse_ref.kernels, sparse_ref; "
    "print(repr(os.environ.get('TRITON_INTERPRET'))); print(sparse_ref.default_device().type); "
    "print(sparse_ref.fast_mode()); print(sparse_ref.describe_run())"
)


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
def test_no_gpu_sets_interpreter_before_kernels():
    interp, dev, fast, line = run_clean(PROBE).splitlines()
    assert interp == "'1'" and dev == "cpu" and fast == "True"
    assert line.startswith("CPU: Triton interpreter")
    assert "fast mode: on (no GPU, so small sizes; SPARSE_REF_FAST=0 forces realistic ones)" in line  # says why


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
@pytest.mark.parametrize("value", ["0", "false"])
def test_user_setting_of_triton_interpret_is_kept(value):
    interp, dev, fast, line = run_clean(PROBE, TRITON_INTERPRET=value).splitlines()
    assert interp == repr(value) and dev == "cpu" and fast == "True"
    assert "no Triton interpreter (TRITON_INTERPRET off)" in line


@pytest.mark.skipif(NO_GPU, reason="checks the GPU path")
def test_gpu_leaves_triton_interpret_unset():
    interp, dev, fast, line = run_clean(PROBE).splitlines()
    assert interp == "None" and dev == "cuda" and fast == "False" and line.startswith("GPU: ")


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("ON", True), (" yes ", True),
                                        ("0", False), ("False", False), ("off", False), ("NO", False)])
def test_fast_mode_parsing(monkeypatch, value, want):
    monkeypatch.setenv("SPARSE_REF_FAST", value)
    assert sparse_ref.fast_mode() is want
    assert ("fast mode: on" if want else "fast mode: off") in sparse_ref.describe_run()


@pytest.mark.parametrize("value", [None, ""])
def test_fast_mode_default_follows_the_device(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SPARSE_REF_FAST", raising=False)
    else:
        monkeypatch.setenv("SPARSE_REF_FAST", value)
    assert sparse_ref.fast_mode() is (sparse_ref.default_device().type == "cpu")


@pytest.mark.parametrize("value", ["2", "maybe", "fast"])
def test_fast_mode_rejects_garbage(monkeypatch, value):
    monkeypatch.setenv("SPARSE_REF_FAST", value)
    with pytest.raises(ConfigError, match=rf"SPARSE_REF_FAST: expected one of .* got '{value}'\. Fix: export"):
        sparse_ref.fast_mode()


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("On", True), ("yes", True),
                                        ("0", False), ("", False), ("false", False), ("off", False), ("2", False)])
def test_triton_interpreted_reads_the_variable_like_triton(monkeypatch, value, want):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert device.triton_interpreted() is want


def test_interpreter_forces_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert sparse_ref.default_device().type == "cpu"
    assert sparse_ref.execution_mode().startswith("CPU: Triton interpreter, torch ")


def test_describe_run_format(monkeypatch):
    monkeypatch.setenv("SPARSE_REF_FAST", "1")
    line = sparse_ref.describe_run()
    assert line == f"{sparse_ref.execution_mode()} | fast mode: on (SPARSE_REF_FAST=1)"
    monkeypatch.setenv("SPARSE_REF_FAST", " off ")
    assert sparse_ref.describe_run().endswith("| fast mode: off (SPARSE_REF_FAST=off)")
    assert torch.__version__ in line
    assert sparse_ref.has_gpu() is torch.cuda.is_available()
