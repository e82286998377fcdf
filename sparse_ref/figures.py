"""Show a matplotlib figure in a notebook with alternative text, for screen readers and the HTML export.

``plt.show()`` in a notebook emits a bare PNG, which nbconvert's HTML export writes as an ``<img>``
without ``alt`` (and warns: "Alternative text is missing"). ``show_figure(fig, alt)`` replaces it:

    show_figure(fig, "Bar chart of the 16 page scores; the kept pages are coloured.")

It displays one output carrying the PNG (with ``alt`` in its metadata, which nbconvert's classic
template reads) and an HTML ``<img alt=...>`` of the same PNG (which JupyterLab and nbconvert's
default template show), then closes the figure so it is not drawn twice. Without ``alt`` the
figure's titles are used. Outside IPython it falls back to ``plt.show()``.

matplotlib and IPython are imported only when a figure is shown: neither is a run-time dependency.
"""

from __future__ import annotations

import base64
import html
import io

from sparse_ref.errors import SparseRefError


def figure_titles(fig) -> str:
    """The figure's suptitle and axes titles, joined with "; " (empty when it has none)."""
    titles = [fig._suptitle.get_text()] if getattr(fig, "_suptitle", None) is not None else []
    titles += [ax.get_title() for ax in fig.axes]
    return "; ".join(t.strip() for t in titles if t and t.strip())


def show_figure(fig, alt: str | None = None) -> None:
    """Display ``fig`` with alternative text ``alt`` (default: its titles), then close it."""
    import matplotlib.pyplot as plt

    text = (alt if alt is not None else figure_titles(fig)).strip()
    if not text:
        raise SparseRefError("show_figure: expected alt text or a figure with a title, got neither. "
                             "Fix: pass alt='what the figure shows', or give it a title (ax.set_title).")
    display = _ipython_display()
    if display is None:
        plt.show()
        return
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")  # what the inline backend draws
    png = base64.b64encode(buffer.getvalue()).decode("ascii")
    bundle = {
        "image/png": png,
        "text/html": f'<img src="data:image/png;base64,{png}" alt="{html.escape(text, quote=True)}">',
        "text/plain": f"<Figure: {text}>",
    }
    display(bundle, raw=True, metadata={"image/png": {"alt": text}})
    plt.close(fig)


def _ipython_display():
    """IPython's ``display`` when running under IPython (a notebook kernel), else None."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python without IPython
        return None
    return display if get_ipython() is not None else None
