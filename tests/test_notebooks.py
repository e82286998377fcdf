"""The committed notebooks are clean: no outputs, no execution counts, kernel python3, numbered names,
and a first code cell that reads the fast mode and prints where the notebook runs.

Executing them is nbmake's job (``pytest --nbmake notebooks``); this file only reads them.
"""

import ast
import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a dev dependency; GPU images may lack it

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
NAME = re.compile(r"^\d\d_[a-z0-9]+(_[a-z0-9]+)*\.ipynb$")


def ids(paths):
    return [p.name for p in paths]


def test_notebooks_exist():
    if not NOTEBOOK_DIR.is_dir():
        pytest.skip("no notebooks/ next to the tests (installed tests run without the tutorial)")
    names = [p.name for p in NOTEBOOKS]
    assert "00_overview.ipynb" in names and "01_req_to_token_pool.ipynb" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_notebook_name_is_numbered(path):
    assert NAME.match(path.name), f"{path.name}: expected NN_name.ipynb (two digits, lower_snake_case)"


def test_notebook_numbers_are_unique():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert len(numbers) == len(set(numbers)), f"two notebooks share a number: {sorted(numbers)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_notebook_is_committed_clean(path):
    missing = [i for i, cell in enumerate(json.loads(path.read_text())["cells"]) if "id" not in cell]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat 4.5 wants one per cell)"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{path.name}: kernel name must be python3"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name} cell {i}: outputs must be cleared"
        assert cell.get("execution_count") is None, f"{path.name} cell {i}: execution_count must be null"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_notebook_is_in_the_exact_form_clean_notebooks_writes(path):
    """``make clean-notebooks`` (nbconvert --clear-output) on a fresh clone changes nothing: the committed file
    is byte for byte what it writes (key order, indentation, the final newline)."""
    from nbconvert.preprocessors import ClearOutputPreprocessor

    nb = nbformat.read(path, as_version=4)
    nb, _ = ClearOutputPreprocessor().preprocess(nb, {})
    assert nbformat.writes(nb) + "\n" == path.read_text(encoding="utf-8"), (
        f"{path.name} differs from what make clean-notebooks writes. Fix: make clean-notebooks")


def _calls(source: str) -> set[str]:
    """Dotted names of every function called in ``source`` (e.g. 'sparse_ref.fast_mode', 'print')."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            names.add(".".join(reversed(parts)))
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_first_code_cell_is_the_parameters_cell(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name}: no code cells"
    first = code[0].source
    calls = _calls(first)
    assert "sparse_ref.fast_mode" in calls, f"{path.name}: first code cell must call sparse_ref.fast_mode()"
    assert "print" in calls and calls & {"sparse_ref.describe_run", "sparse_ref.execution_mode"}, (
        f"{path.name}: first code cell must print sparse_ref.describe_run() (the mode it runs in)"
    )
    assert re.search(r"^\s*FAST\s*=\s*sparse_ref\.fast_mode\(\)", first, re.M), f"{path.name}: set FAST there"


# Notebooks whose figures still go through plt.show() (no alt text). Convert them with
# show_figure(fig, "what the figure shows") and drop them from this set (the xfail is strict).
WITHOUT_ALT_TEXT: set[str] = set()
PLT_SHOW = re.compile(r"\b(plt|pyplot)\.show\(")


def _alt_text_params(paths):
    marks = pytest.mark.xfail(strict=True, reason="figures without alt text; see WITHOUT_ALT_TEXT")
    return [pytest.param(p, marks=marks) if p.name in WITHOUT_ALT_TEXT else p for p in paths]


@pytest.mark.parametrize("path", _alt_text_params(NOTEBOOKS), ids=ids(NOTEBOOKS))
def test_figures_carry_alt_text(path):
    """``plt.show()`` emits an image without alt text (nbconvert's HTML export warns); ``show_figure`` does not."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not PLT_SHOW.search(cell.source), (
                f"{path.name} cell {i}: plt.show() gives the figure no alt text. Fix: end the cell with "
                'show_figure(fig, "what the figure shows") (from sparse_ref.figures import show_figure).'
            )


def test_the_checks_reject_a_dirty_notebook(tmp_path):
    """The checks above can fail: a notebook with an output and a wrong kernel is caught."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[0].execution_count = 1
    nb.metadata["kernelspec"] = {"name": "venv", "display_name": "venv", "language": "python"}
    bad = tmp_path / "1_Bad.ipynb"
    nbformat.write(nb, bad)
    with pytest.raises(AssertionError):
        test_notebook_name_is_numbered(bad)
    with pytest.raises(AssertionError, match="kernel name"):
        test_notebook_is_committed_clean(bad)
    nb.metadata["kernelspec"]["name"] = "python3"
    nbformat.write(nb, bad)
    with pytest.raises(AssertionError, match="outputs must be cleared"):
        test_notebook_is_committed_clean(bad)
    with pytest.raises(AssertionError, match="sparse_ref.fast_mode"):
        test_first_code_cell_is_the_parameters_cell(bad)
    nb.cells[0].source = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"
    nbformat.write(nb, bad)
    with pytest.raises(AssertionError, match="show_figure"):
        test_figures_carry_alt_text(bad)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_code_cells_are_short_and_figures_carry_alt_text(path):
    """A lesson cell holds the lesson: at most 30 lines (drawing lives in notebooks/drawing.py), and every
    figure goes through show_figure (title and alt text), never a bare plt.show()."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        assert len(lines) <= 30, f"{path.name} cell {i}: {len(lines)} lines (split it, or move drawing out)"
        assert "plt.show()" not in cell.source, f"{path.name} cell {i}: use show_figure(fig, alt) instead"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids(NOTEBOOKS))
def test_every_notebook_opens_and_closes_in_the_same_places(path):
    """After the parameters cell: three "After this notebook you can" lines, then 00's picture with this notebook's
    stages marked. Last: the recap, a three-question check whose answers open under each question, and the
    sources (links only). No other recap heading anywhere."""
    cells = nbformat.read(path, as_version=4).cells
    number = path.name[:2]
    outcomes = cells[2].source
    assert cells[2].cell_type == "markdown" and outcomes.startswith("**After this notebook you can:**"), path.name
    assert len(re.findall(r"^\* ", outcomes, re.M)) == 3, f"{path.name}: three outcomes"
    assert cells[3].cell_type == "code" and f'drawing.you_are_here("{number}")' in cells[3].source, path.name
    recap, check, sources = (c.source for c in cells[-3:])
    assert recap.startswith("## Recap\n") and check.startswith("## Check yourself\n"), path.name
    assert len(re.findall(r"^\d\. ", check, re.M)) == 3 and check.count("<details><summary>Answer</summary>") == 3
    assert sources.startswith("## Sources\n"), path.name
    links = re.findall(r"^\* \[[^\]]+\]\((https://[^)\s]+)\)$", sources, re.M)
    assert len(links) >= 2 and len(links) == len(re.findall(r"^\* ", sources, re.M)), f"{path.name}: links only"
    others = [i for i, c in enumerate(cells[:-3]) if c.cell_type == "markdown" and
              re.search(r"^#+ (What we built|Summary|Recap|Takeaways)|\*\*Takeaways", c.source, re.M)]
    assert not others, f"{path.name}: a recap outside the closing (cells {others})"

