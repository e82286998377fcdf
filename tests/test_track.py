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
