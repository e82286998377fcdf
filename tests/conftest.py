"""Shared test set-up: hypothesis profiles, the device under test, a GPU marker."""

import os

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
