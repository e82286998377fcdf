"""The algorithm registry: known names, the unknown-name error, lazy DSA."""

import pytest

from sparse_ref import SparseConfig, SparseRefError, UnknownAlgorithmError
from sparse_ref.algorithms import QuestAlgorithm, SparseAlgorithm, create_sparse_algorithm, known_algorithms


def test_known_names():
    assert {"quest", "deepseek_dsa"} <= set(known_algorithms())


def test_create_quest():
    cfg = SparseConfig(page_budget=3)
    algo = create_sparse_algorithm("quest", cfg, "cpu")
    assert isinstance(algo, QuestAlgorithm) and isinstance(algo, SparseAlgorithm)
    assert algo.config is cfg and algo.device.type == "cpu"


@pytest.mark.parametrize("name", ["Quest", "nsa", "", None])
def test_unknown_name(name):
    with pytest.raises(UnknownAlgorithmError) as info:
        create_sparse_algorithm(name, SparseConfig(), "cpu")
    msg = str(info.value)
    assert msg.startswith(f"Unknown sparse algorithm: {name}")
    assert "quest" in msg and "deepseek_dsa" in msg
    assert isinstance(info.value, SparseRefError)


def test_create_deepseek_dsa_lazily():
    dsa = pytest.importorskip("sparse_ref.algorithms.dsa")
    algo = create_sparse_algorithm("deepseek_dsa", SparseConfig(), "cpu")
    assert isinstance(algo, dsa.DSAAlgorithm)


def test_config_type_is_checked():
    with pytest.raises(SparseRefError, match="config: expected a SparseConfig"):
        create_sparse_algorithm("quest", {"page_budget": 3}, "cpu")


def test_selection_backend_is_checked():
    with pytest.raises(SparseRefError, match="backend: expected one of"):
        create_sparse_algorithm("quest", SparseConfig(), "cpu", backend="cuda")
    assert create_sparse_algorithm("quest", None, "cpu", backend="torch").backend.name == "torch"
