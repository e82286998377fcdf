"""Every launch knob of every kernel family has a declared range, checked whenever it is set.

A knob out of range (``pair_rank=5`` once indexed past a scratch buffer inside the kernel; others gave a
RuntimeError, a ZeroDivisionError or a TypeError deep in a launch) raises a ``ConfigError`` naming the
knob, the range and the value, before anything is set or launched.
"""

from __future__ import annotations

import pytest

from sparse_ref.errors import ConfigError
from sparse_ref.kernels import Knob, Knobs, decode_attention, dsa, page_select, quest, quest_bounds, tuning
from sparse_ref.kernels import topk as topk_module

TABLES = {"topk": topk_module.TUNING, "decode_attention": decode_attention.TUNING, "dsa": dsa.TUNING,
          "quest": quest.TUNING, "quest_bounds": quest_bounds.TUNING, "page_select": page_select.TUNING}


def bad_values(knob: Knob) -> list:
    """Values the knob must refuse: wrong types, just outside the range, a non-power of two, None where not allowed."""
    values = ["4", 2.0, [1]]
    if knob.flag:
        return [*values, 0, 1, "True"] + ([] if knob.none else [None])
    values += [True, knob.high + 1, -1] + ([] if knob.none else [None]) + ([] if knob.zero else [0])
    if knob.low > 1:
        values.append(knob.low - 1)
    if knob.pow2:
        values.append(knob.low + 1 if knob.low > 1 else 3)
    return values


@pytest.mark.parametrize("family", TABLES)
def test_every_knob_has_a_range_and_its_default_is_in_it(family):
    table = TABLES[family]
    assert isinstance(table, Knobs) and set(table) == set(table.ranges)
    for name, value in table.items():
        assert table.ranges[name].check(name, value) == value


@pytest.mark.parametrize("family", TABLES)
def test_every_knob_refuses_values_outside_its_range(family):
    table = TABLES[family]
    before = dict(table)
    for name, knob in table.ranges.items():
        for value in bad_values(knob):
            with pytest.raises(ConfigError, match=rf"{name}.*expected .*got {repr(value)[:8]}".replace("[", r"\[")):
                with tuning(table, **{name: value}):
                    pass
            with pytest.raises(ConfigError):
                table[name] = value
    assert dict(table) == before, "a refused knob changes nothing"


def test_a_refused_update_sets_nothing():
    before = dict(topk_module.TUNING)
    with pytest.raises(ConfigError, match="pair_rank"):
        topk_module.TUNING.update(chunk=128, pair_rank=5)  # the first is fine, the second is not
    assert dict(topk_module.TUNING) == before


def test_pair_rank_five_is_refused_before_any_launch():
    with pytest.raises(ConfigError, match=r"pair_rank.*a power of two in \[16, 256\] or 0"):
        with tuning(topk_module.TUNING, pair_rank=5):
            pass


def test_tuning_needs_a_table_and_known_knobs():
    with pytest.raises(ConfigError, match="tuning\\(table\\).*TUNING table"):
        with tuning(None, pair_rank=16):
            pass
    with pytest.raises(ConfigError, match="knobs of this table"):
        with tuning(quest.TUNING, block=4):
            pass
    with pytest.raises(ConfigError, match="a knob of this table"):
        quest.TUNING["block"] = 4


@pytest.mark.knobs
def test_in_range_values_are_set_and_restored():
    with tuning(topk_module.TUNING, pair_rank=0, slots=2, reverse_rows=False) as table:
        assert table["pair_rank"] == 0 and table["slots"] == 2 and table["reverse_rows"] is False
    assert topk_module.TUNING["pair_rank"] == 128 and topk_module.TUNING["slots"] == 0
    with tuning(decode_attention.TUNING, num_splits=None, use_dot=False):
        assert decode_attention.TUNING["use_dot"] is False


# ---------------------------------------------------------------- every way of changing a table goes through its check
@pytest.mark.parametrize("family", TABLES)
def test_the_in_place_union_is_checked_like_update(family):
    """``table |= {...}`` once skipped the ranges (dict's own merge); now it is ``update``: all checked first."""
    table, before = TABLES[family], dict(TABLES[family])
    name, knob = next(iter(table.ranges.items()))
    with pytest.raises(ConfigError, match=name):
        table |= {name: bad_values(knob)[0]}
    assert dict(table) == before
    table |= {name: before[name]}  # an in-range value is set (the default here): the same table object
    assert dict(table) == before and isinstance(table, Knobs)


@pytest.mark.parametrize("family", TABLES)
@pytest.mark.parametrize("remove", [lambda t, n: t.pop(n), lambda t, n: t.__delitem__(n), lambda t, n: t.popitem(),
                                    lambda t, n: t.clear(), lambda t, n: t.pop(n, None)])
def test_no_knob_can_be_removed(family, remove):
    """A removed knob gave a raw KeyError at the next launch; removing is refused and the table is unchanged."""
    table, before = TABLES[family], dict(TABLES[family])
    with pytest.raises(ConfigError, match="every knob kept"):
        remove(table, next(iter(table)))
    assert dict(table) == before


@pytest.mark.knobs
def test_tuning_restores_every_knob_after_an_error_inside_the_block():
    before = dict(quest.TUNING)
    with pytest.raises(RuntimeError, match="inside"), tuning(quest.TUNING, block_p=4, num_warps=8):
        raise RuntimeError("inside")
    assert dict(quest.TUNING) == before
