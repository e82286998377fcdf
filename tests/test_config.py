"""Tests for SparseConfig: every bad value names the field, the value and the allowed range."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import ConfigError, SparseConfig, SparseRefError


def test_defaults():
    c = SparseConfig()
    assert c.keep_ratio == 0.25 and c.page_budget is None
    assert c.num_recent_pages == 4 and c.num_sink_pages == 0 and c.min_sparse_seq_len == 0
    assert c.gqa_mode == "mean"
    assert SparseConfig(page_budget=3).keep_ratio is None
    assert isinstance(SparseConfig(keep_ratio=1).keep_ratio, float)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5", [0.5]])
def test_keep_ratio_bad_values(bad):
    with pytest.raises(ConfigError) as e:
        SparseConfig(keep_ratio=bad)
    msg = str(e.value)
    assert "SparseConfig.keep_ratio" in msg and "(0, 1]" in msg and repr(bad) in msg


@pytest.mark.parametrize(
    "field,low,bad",
    [
        ("page_budget", 1, 0), ("page_budget", 1, -3), ("page_budget", 1, 2.0), ("page_budget", 1, True),
        ("num_recent_pages", 1, 0), ("num_recent_pages", 1, -1), ("num_recent_pages", 1, 1.5),
        ("num_sink_pages", 0, -1), ("num_sink_pages", 0, "2"), ("num_sink_pages", 0, False),
        ("min_sparse_seq_len", 0, -5), ("min_sparse_seq_len", 0, None), ("min_sparse_seq_len", 0, 3.0),
    ],
)
def test_integer_fields_bad_values(field, low, bad):
    with pytest.raises(ConfigError) as e:
        SparseConfig(**{field: bad})
    msg = str(e.value)
    assert f"SparseConfig.{field}" in msg, msg
    is_int = isinstance(bad, int) and not isinstance(bad, bool)
    assert (f"an int in [{low}, " if is_int else "expected an int, got") in msg, msg
    assert repr(bad) in msg, msg


def test_num_recent_pages_explains_why():
    with pytest.raises(ConfigError, match="last page holds the token being decoded"):
        SparseConfig(num_recent_pages=0)


def test_gqa_mode():
    assert SparseConfig(gqa_mode="per_kv_head").gqa_mode == "per_kv_head"
    with pytest.raises(ConfigError, match=r"SparseConfig.gqa_mode: expected one of \('mean', 'per_kv_head'\), "
                                          r"got 'sum'"):
        SparseConfig(gqa_mode="sum")


def test_both_budgets_rejected():
    with pytest.raises(ConfigError, match=r"keep_ratio=0.5 and page_budget=3 were both given"):
        SparseConfig(keep_ratio=0.5, page_budget=3)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        SparseConfig(num_sink_pages=-1)
    assert issubclass(ConfigError, SparseRefError)


@given(history=st.integers(-3, 10_000), ratio=st.floats(1e-6, 1.0, allow_nan=False))
def test_history_budget_keep_ratio(history, ratio):
    k = SparseConfig(keep_ratio=ratio).history_budget(history)
    if history <= 0:
        assert k == 0
    else:
        assert k == min(max(math.floor(history * ratio), 1), history)
        assert 1 <= k <= history


@given(history=st.integers(-3, 10_000), budget=st.integers(1, 5000))
def test_history_budget_page_budget(history, budget):
    k = SparseConfig(page_budget=budget).history_budget(history)
    assert k == (0 if history <= 0 else min(budget, history))


@pytest.mark.parametrize("history,ratio,want", [(1, 0.25, 1), (4, 0.25, 1), (7, 0.25, 1), (8, 0.25, 2),
                                                (10, 1.0, 10), (3, 0.5, 1), (0, 0.5, 0)])
def test_history_budget_examples(history, ratio, want):
    assert SparseConfig(keep_ratio=ratio).history_budget(history) == want


def test_config_is_frozen_and_replace_validates():
    import dataclasses

    c = SparseConfig(page_budget=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_budget = 0
    with pytest.raises(ConfigError, match="SparseConfig.page_budget"):
        dataclasses.replace(c, page_budget=0)
    assert dataclasses.replace(c, page_budget=3).page_budget == 3


@pytest.mark.parametrize("field", ["page_budget", "num_recent_pages", "num_sink_pages", "min_sparse_seq_len"])
def test_integer_fields_must_fit_int32(field):
    with pytest.raises(ConfigError, match=rf"SparseConfig.{field}: expected an int in \[\d, 2147483647\]"):
        SparseConfig(**{field: 2**31})
