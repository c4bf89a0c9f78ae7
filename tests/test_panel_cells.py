"""Which cells the browser test runs before it moves a panel's controls (scripts/browser_check.py's panel_cells):
every cell a panel needs, found from the names the cells bind and read, and none it does not."""

import json

from .test_course import load_script

browser_check = load_script("browser_check")


def cells(*sources):
    return [{"cell_type": "code", "source": s} for s in sources]


def test_the_setup_the_panel_and_what_it_reads_transitively_but_nothing_else():
    nb = cells(
        "import os\nfrom x import panel, slider_panel",  # 0: setup, always
        "model = make()",  # 1: read by 3, which the panel reads
        "unrelated = 1\nprint(unrelated)",  # 2
        "budget = between(model)",  # 3
        "model = other()",  # 4: rebinds model after 3 used it, and nothing reads it later
        "slider_panel(panel, start=budget)",  # 5
        "after = 2",  # 6
    )
    assert browser_check.panel_cells(nb) == [0, 1, 3, 5]


def test_a_change_to_an_object_counts_as_binding_it():
    nb = cells("x = f()", "x.limit = 3", "y[0] = 1", "slider_panel(p, x=x)")
    assert browser_check.panel_cells(nb) == [0, 1, 3]


def test_markdown_is_left_out_and_a_cell_that_is_not_python_keeps_every_cell():
    nb = [{"cell_type": "markdown", "source": "# title"}, *cells("import a", "x = 1", "slider_panel(a.f)")]
    assert browser_check.panel_cells(nb) == [1, 3]
    magic = [*nb[:2], *cells("%timeit x = 1", "slider_panel(a.f)")]
    assert browser_check.panel_cells(magic) == [1, 2, 3]


def test_every_panel_notebook_keeps_its_setup_cell_and_every_panel_cell():
    for path in browser_check.panel_notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))["cells"]
        kept = browser_check.panel_cells(nb)
        code = [i for i, c in enumerate(nb) if c["cell_type"] == "code"]
        panels = [i for i in code if "slider_panel(" in "".join(nb[i]["source"])]
        assert panels and kept[0] == code[0] and set(panels) <= set(kept) < set(code), path.name
