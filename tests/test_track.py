"""The README's 55-minute track (``scripts/track.py``): its cells are where it says, and its minutes fit.

The counts are read from the committed notebooks (no notebook runs here); ``scripts/track.py`` without
``--no-run`` also executes the notebooks and adds the cells' run time, for the README's table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import track  # noqa: E402


@pytest.mark.parametrize("row", track.TRACK, ids=lambda r: r.notebook)
def test_each_row_starts_at_its_anchor(row):
    nb = track.load(row.notebook)
    assert max(row.cells) < len(nb.cells)
    assert row.anchor in nb.cells[row.cells[0]].source, f"{row.notebook} c{row.cells[0]}: the track's cells moved"
    assert "# solution" not in "".join(nb.cells[i].source for i in row.cells)  # exercises are homework


def test_track_fits_its_budget_with_room_to_run_the_cells():
    minutes = sum(track.row_counts(row)["minutes"] for row in track.TRACK)
    assert minutes <= track.BUDGET_MIN - 3, f"{minutes:.1f} min of reading leaves no time to run the cells"


def test_track_has_a_top_k_and_a_dsa_moment():
    notebooks = [row.notebook for row in track.TRACK]
    assert "05_triton_topk" in notebooks and "04_dsa_indexer" in notebooks


def test_estimate_counts_what_is_read():
    class Cell:
        def __init__(self, cell_type, source):
            self.cell_type, self.source = cell_type, source

    prose = track.estimate(Cell("markdown", "word " * 130))
    assert prose["minutes"] == pytest.approx(1.0)
    code = track.estimate(Cell("code", "a = 1\nb = 2\n# a comment\n\nc = 3\nd = 4\ne = 5\nf = 6\n"))
    assert code["torch"] == 6 and code["minutes"] == pytest.approx(1.0)
    shown = track.estimate(Cell("code", "from radix_topk import walk_from_top\n\ndrawing.show_lesson(walk_from_top)"))
    assert shown["triton"] >= 6 and shown["minutes"] >= 2  # the lesson's lines, at the kernel pace
    figure = track.estimate(Cell("code", "fig, ax = plt.subplots()\nax.plot([1])\nshow_figure(fig, 'alt')"))
    assert figure["figures"] == 1 and figure["torch"] == 0


def shown_lessons(row) -> dict:
    """The lesson functions the row's cells print (``drawing.show_lesson``), by name, with their modules."""
    import ast
    import importlib

    sys.path[:0] = [str(ROOT / "kernels")]
    nb, shown = track.load(row.notebook), {}
    for i in row.cells:
        if nb.cells[i].cell_type != "code":
            continue
        tree = ast.parse("\n".join(s for s in nb.cells[i].source.splitlines() if not s.startswith(("%", "!"))))
        imported = {a.asname or a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "drawing.show_lesson":
                for arg in node.args:
                    shown[arg.id] = importlib.import_module(imported[arg.id])
    return shown


@pytest.mark.parametrize("row", track.TRACK, ids=lambda r: f"{r.notebook} c{r.cells[0]}")
def test_every_lesson_helper_a_shown_kernel_calls_is_shown_too(row):
    """A kernel on the screen calls only helpers the audience has seen in the same row (the radix select's
    ``sortable_key`` and ``walk_from_top`` before its kernel)."""
    import ast
    import inspect

    shown = shown_lessons(row)
    for name, module in shown.items():
        fn = getattr(module, name)
        while hasattr(fn, "fn"):
            fn = fn.fn
        calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(inspect.getsource(fn))) if isinstance(n, ast.Call)}
        helpers = {c for c in calls if hasattr(getattr(module, c, None), "fn")}  # the module's own jit helpers
        assert helpers <= set(shown), f"{row.notebook}: {name} calls {sorted(helpers - set(shown))}, not shown"


def test_the_track_tells_the_story_in_order():
    """The stale row before the first seed error; the indexer's formula before the top-k; the radix select with its
    helpers; the decode kernels' picture; the close on offload's memory against bandwidth."""
    rows = [(r.notebook, r.cells) for r in track.TRACK]
    order = [n for n, _ in rows]
    assert order.index("02_retrieval_contract") < order.index("05_triton_topk")
    stale, first_error = 7, 12  # 02: the stale row (c7-c9) comes before the seed error (c12)
    cells_02 = dict(rows)["02_retrieval_contract"]
    assert stale in cells_02 and first_error in cells_02 and cells_02.index(stale) < cells_02.index(first_error)
    dsa = [i for i, (n, c) in enumerate(rows) if n == "04_dsa_indexer" and 0 in c]
    assert dsa and dsa[0] < order.index("05_triton_topk"), "the indexer's formula comes before the top-k"
    assert {"sortable_key", "walk_from_top", "radix_topk_kernel"} <= set(shown_lessons(track.TRACK[order.index(
        "05_triton_topk")]))
    assert "split_softmax_mass" in "".join(track.load("09_decode_kernels").cells[i].source
                                           for i in dict(rows)["09_decode_kernels"])
    close = track.load("10_offload")
    assert order[-1] == "10_offload" and "memory_and_bandwidth" in "".join(close.cells[i].source for i in rows[-1][1])
    assert "hot buffer" in close.cells[rows[-1][1][0]].source  # its premise, shown before the picture


@pytest.mark.parametrize("row", track.TRACK, ids=lambda r: f"{r.notebook} c{r.cells[0]}")
def test_a_track_cell_explains_what_it_uses_from_a_cell_it_skips(row):
    """A function a track cell calls, defined in a code cell the track skips (it runs, the audience does not see
    it), is named in a comment of that cell that says what it is and "not on the track" (05's ``torch_keys``; "from
    the cell above" pointed at a cell the audience never saw); a track cell never
    needs an earlier row's premise that comes later (the second seed error after the indexer it names)."""
    import ast

    nb = track.load(row.notebook)
    shown = {i for r in track.TRACK if r.notebook == row.notebook for i in r.cells}
    skipped = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and i not in shown and i < max(row.cells):
            tree = ast.parse("\n".join(s for s in cell.source.splitlines() if not s.startswith(("%", "!"))))
            skipped.update({node.name: i for node in tree.body if isinstance(node, ast.FunctionDef)})
    for i in row.cells:
        cell = nb.cells[i]
        if cell.cell_type != "code":
            continue
        tree = ast.parse("\n".join(s for s in cell.source.splitlines() if not s.startswith(("%", "!"))))
        comments = " ".join(line.split("#", 1)[1] for line in cell.source.splitlines() if "#" in line)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in skipped:
                name = node.func.id
                assert name in comments and "not on the track" in comments, (
                    f"{row.notebook} c{i} calls {name} (c{skipped[name]}, not on the track) without a comment that "
                    "says what it is and that the track skips it")
    order = [(r.notebook, r.anchor) for r in track.TRACK]
    assert order.index(("04_dsa_indexer", "## The second seed error")) > \
        order.index(("04_dsa_indexer", "# 04 · The DeepSeek DSA lightning indexer"))

