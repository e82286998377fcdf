"""``show_figure``: a notebook figure carries alternative text, so nbconvert's HTML export has an ``alt``."""

import base64
import html

import pytest

matplotlib = pytest.importorskip("matplotlib")  # a dev dependency
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sparse_ref import SparseRefError, figures  # noqa: E402
from sparse_ref.figures import figure_titles, show_figure  # noqa: E402


def test_plain_python_has_no_ipython_display():
    assert figures._ipython_display() is None  # pytest is not an IPython shell


@pytest.fixture
def shown(monkeypatch):
    """Pretend to run inside IPython; collect what show_figure displays."""
    calls = []
    monkeypatch.setattr(figures, "_ipython_display", lambda: lambda obj, **kw: calls.append((obj, kw)))
    return calls


def test_alt_text_reaches_the_html_and_the_png_metadata(shown):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    alt = 'A falling line; "quotes" & <tags> are escaped'
    show_figure(fig, alt)
    ((bundle, kw),) = shown
    assert kw["raw"] is True and kw["metadata"] == {"image/png": {"alt": alt}}
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert f'alt="{html.escape(alt, quote=True)}"' in bundle["text/html"]
    assert bundle["image/png"] in bundle["text/html"]
    assert not plt.fignum_exists(fig.number), "the figure is closed, so the inline backend does not draw it again"


def test_titles_are_the_default_alt_text(shown):
    fig, (a, b) = plt.subplots(1, 2)
    fig.suptitle("Recall")
    a.set_title("mean")
    b.set_title(" per head ")
    assert figure_titles(fig) == "Recall; mean; per head"
    show_figure(fig)
    assert shown[0][1]["metadata"]["image/png"]["alt"] == "Recall; mean; per head"


def test_a_figure_without_title_or_alt_is_refused(shown):
    fig, _ = plt.subplots()
    with pytest.raises(SparseRefError, match="alt"):
        show_figure(fig)
    with pytest.raises(SparseRefError, match="alt"):
        show_figure(fig, "   ")
    assert shown == []
    plt.close(fig)


def test_outside_ipython_it_falls_back_to_plt_show(monkeypatch):
    seen = []
    monkeypatch.setattr(figures, "_ipython_display", lambda: None)
    monkeypatch.setattr(plt, "show", lambda: seen.append("show"))
    fig, ax = plt.subplots()
    ax.set_title("t")
    show_figure(fig)
    assert seen == ["show"]
    plt.close(fig)
