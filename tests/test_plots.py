import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from anatomy_helpers import CATEGORY_COLORS, make_model, make_optimizer, plot_module_bars, plot_timeline, track_steps
from anatomy_helpers.tracker import CATEGORIES

from .conftest import SMALL


@pytest.fixture(scope="module")
def trace():
    model = make_model(device="cpu", **SMALL)
    return track_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=2)


def test_timeline_is_labelled_with_units_and_categories(trace):
    fig = plot_timeline(trace)
    ax = fig.axes[0]
    assert "MiB" in ax.get_ylabel() and ax.get_xlabel() and ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [c.replace("_", " ") for c in CATEGORIES]
    texts = {t.get_text().strip() for t in ax.texts}
    assert {"step 1", "step 2", "fwd", "bwd", "opt"} <= texts
    assert any(t.startswith("peak ") for t in texts)
    assert fig._repr_png_()[:4] == b"\x89PNG"


def test_time_axis_and_bad_axis(trace):
    assert "ms" in plot_timeline(trace, x="time").axes[0].get_xlabel()
    with pytest.raises(ValueError, match="x must be"):
        plot_timeline(trace, x="bytes")


def test_module_bars_use_category_colours(trace):
    fig = plot_module_bars(trace, step=1, phase="forward")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:3] == ["tok_emb", "pos_emb", "blocks.0"]
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"parameters", "activations"} <= legend
    colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches}
    assert colours <= {c.lower() for c in CATEGORY_COLORS.values()}
    with pytest.raises(ValueError, match="no 'backward' phase"):
        plot_module_bars(trace, step=9, phase="backward")


def test_plots_leave_no_pyplot_figures_open(trace):
    plt.close("all")
    plot_timeline(trace)
    plot_module_bars(trace)
    assert plt.get_fignums() == []


def test_slider_panel_shows_the_returned_figure():
    import ipywidgets as w

    from anatomy_helpers.widgets import slider_panel

    def fn(a: int = 2, b: str = "x", c: int = 5):
        return f"{a}{b}{c}"

    panel = slider_panel(fn, a=(1, 4, 1), b=["x", "y"])
    assert panel.auto_display  # the return value is displayed, not only what fn prints
    sliders = [c for c in panel.children if isinstance(c, w.IntSlider)]
    assert sliders[0].value == 2 and not sliders[0].continuous_update
    assert panel.result == "2x5"  # c keeps its default
    with pytest.raises(ValueError, match="not a parameter"):
        slider_panel(fn, d=(1, 2, 1))
