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
