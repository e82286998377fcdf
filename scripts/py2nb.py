"""Build a clean .ipynb from a percent-format Python script (``# %%`` code cells, ``# %% [markdown]``).

    python scripts/py2nb.py source.py notebooks/NN_name.ipynb

The notebook is written with no outputs and kernel name ``python3``, as the repository keeps them.
Markdown cells are written as comment lines (``# text``) under a ``# %% [markdown]`` marker.
"""

from __future__ import annotations

import sys

import nbformat


def convert(text: str) -> nbformat.NotebookNode:
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif body.strip():
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        nb = convert(f.read())
    nbformat.validate(nb)
    nbformat.write(nb, dst)
    print(f"wrote {dst} ({len(nb.cells)} cells)")
