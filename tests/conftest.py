"""Shared test set-up: hypothesis profiles, the device under test, a GPU marker, and the launch recorder.

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

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
    """Record this session's launches into a fresh file (``SPARSE_REF_RECORD_LAUNCHES``, or one under build/aot/),
    in this process and in every notebook kernel it starts (an IPython start-up file under ``IPYTHONDIR``)."""
    if os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        return
    out = Path(os.environ.get(launch_recorder.ENV) or Path(config.rootpath, "build", "aot",
                                                            f"launches-{os.getpid()}.jsonl"))  # (one per session)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.environ.get(launch_recorder.ENV):
        out.write_text("")  # a fresh file of this session's own (a file the caller names is added to)
    os.environ[launch_recorder.ENV] = str(out.resolve())
    startup = out.parent / f"ipython-{os.getpid()}" / "profile_default" / "startup" / "00-record-launches.py"
    startup.parent.mkdir(parents=True, exist_ok=True)
    startup.write_text(STARTUP.format(tests=str(Path(__file__).parent)))
    os.environ["IPYTHONDIR"] = str(startup.parents[2])
    launch_recorder.install()


def pytest_unconfigure(config):
    """Remove this session's own record file (one named by the caller's SPARSE_REF_RECORD_LAUNCHES is kept)."""
    path = Path(os.environ.get(launch_recorder.ENV, ""))
    if path.name == f"launches-{os.getpid()}.jsonl":
        path.unlink(missing_ok=True)
        shutil.rmtree(path.parent / f"ipython-{os.getpid()}", ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    compile_last = [item for item in items if item.path.name == "test_aot_compile.py"]
    items[:] = [item for item in items if item not in compile_last] + compile_last  # after every launch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
