"""Shared test set-up: hypothesis profiles, the device under test, the GPU and knobs markers, and the launch recorder.

A test that runs a kernel at launch knobs other than its family's defaults (``TUNING``) is marked ``knobs``: the
CPU suite runs it through the interpreter, and the sm_90 compile check compiles what it launched; the GPU check
(``scripts/gpu_check.sh``) leaves it out, so the GPU compiles each default variant once. The mark is held: a test
that sets a knob to another value without it fails (``knobs_are_marked``), unless it is a ``gpu`` test.

Under Triton's interpreter every kernel launch of the session (tests and, through an IPython start-up
file, notebooks run by nbmake) is recorded (``launch_recorder.py``), and ``test_aot_compile.py`` runs
last, so that it compiles every recorded launch for sm_90 beside the GPU-shape variants.
"""

import os
import shutil
from pathlib import Path

import launch_recorder
import pytest
import torch
from hypothesis import HealthCheck, settings

import sparse_ref  # noqa: F401  (configures Triton's interpreter before any kernel import)
from sparse_ref.kernels import Knobs

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile(  # the GPU check: a few compiled examples (the CPU suite draws 40 per property)
    "gpu", max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Parallel workers (pytest-xdist) share the cores: each takes its share of torch's threads, not all of them.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


RUN_TIME_KNOBS = {("decode_attention", "num_splits")}  # a run-time argument of the kernel: no new compiled variant
KNOB_DEFAULTS: dict[tuple[str, str], object] = {}  # (family, knob) -> its default, read when a table is first set
KNOBS_SET: list[str] = []  # the knobs the running test set to another value than their default
_set_knob = Knobs.__setitem__


def _recording_set_knob(table, name, value):
    KNOB_DEFAULTS.setdefault((table.family, name), table.get(name, value))
    _set_knob(table, name, value)
    if value != KNOB_DEFAULTS[table.family, name] and (table.family, name) not in RUN_TIME_KNOBS:
        KNOBS_SET.append(f"{table.family}.{name}={value!r}")


Knobs.__setitem__ = _recording_set_knob


@pytest.fixture(autouse=True)
def knobs_are_marked(request):
    """A test (its fixtures included) that sets a launch knob to a value other than its default is marked ``knobs``
    (or ``gpu``): the GPU check selects tests by that mark."""
    KNOBS_SET.clear()
    yield
    marks = {m.name for m in request.node.iter_markers()}
    if KNOBS_SET and not marks & {"knobs", "gpu"}:
        pytest.fail(f"{request.node.nodeid} sets launch knobs ({', '.join(sorted(set(KNOBS_SET)))}) but is not "
                    "marked knobs. Fix: @pytest.mark.knobs (or pytest.param(..., marks=pytest.mark.knobs)).",
                    pytrace=False)


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (kernels then run through Triton's interpreter)."""
    return sparse_ref.default_device()


STARTUP = """import sys
sys.path.insert(0, {tests!r})
import launch_recorder
launch_recorder.install()
"""


def pytest_configure(config):
    """Give the notebook kernels this session starts a profile of their own (``IPYTHONDIR``): quiet start-up
    logs (ipykernel warns that its local TCP sockets are unencrypted, which nbmake would print for each
    notebook). Under the interpreter, also record this session's launches into a fresh file
    (``SPARSE_REF_RECORD_LAUNCHES``, or one under build/aot/), here and in every kernel (a start-up file)."""
    profile = Path(config.rootpath, "build", "aot", f"ipython-{os.getpid()}", "profile_default")
    (profile / "startup").mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text('c.IPKernelApp.log_level = "ERROR"\n')
    os.environ["IPYTHONDIR"] = str(profile.parent)
    if os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        return
    out = Path(os.environ.get(launch_recorder.ENV) or profile.parents[1] / f"launches-{os.getpid()}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.environ.get(launch_recorder.ENV):
        out.write_text("")  # a fresh file of this session's own (a file the caller names is added to)
    os.environ[launch_recorder.ENV] = str(out.resolve())
    (profile / "startup" / "00-record-launches.py").write_text(STARTUP.format(tests=str(Path(__file__).parent)))
    launch_recorder.install()


def pytest_unconfigure(config):
    """Remove this session's kernel profile and its own record file (one named by SPARSE_REF_RECORD_LAUNCHES
    is kept)."""
    aot = Path(config.rootpath, "build", "aot")
    shutil.rmtree(aot / f"ipython-{os.getpid()}", ignore_errors=True)
    path = Path(os.environ.get(launch_recorder.ENV, ""))
    if path.name == f"launches-{os.getpid()}.jsonl":
        path.unlink(missing_ok=True)


def pytest_collection_modifyitems(config, items):
    compile_last = [item for item in items if item.name.startswith("test_recorded_launches_compile")]
    items[:] = [item for item in items if item not in compile_last] + compile_last  # after every launch
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker sees only its own share of the launches
        later = pytest.mark.skip(reason="compiles every worker's launches, so it runs after them, on its own "
                                        "(make test does: pytest tests/test_aot_compile.py -k recorded)")
        for item in compile_last:
            item.add_marker(later)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
