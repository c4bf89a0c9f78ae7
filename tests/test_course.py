"""The course as a whole: README links, notebook conventions."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SLUG = "training-step-anatomy/training-step-anatomy"


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_tour.ipynb"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_readme_links_the_notebook_on_colab_and_binder(nb):
    readme = (ROOT / "README.md").read_text()
    assert f"(notebooks/{nb.name})" in readme
    assert f"colab.research.google.com/github/{SLUG}/blob/main/notebooks/{nb.name}" in readme
    assert f"mybinder.org/v2/gh/{SLUG}/main?urlpath=lab/tree/notebooks/{nb.name}" in readme


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_sets_up_colab_and_device(nb):
    first = "".join(code_cells(nb)[0]["source"])
    assert '"google.colab" in sys.modules' in first
    assert f"git+https://github.com/{SLUG}" in first
    assert "torch" not in first.split("google.colab")[1].split("import")[0]  # never reinstalls torch
    assert "pick_device()" in first


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_clean(nb):
    for cell in code_cells(nb):
        assert cell["execution_count"] is not None or not cell["outputs"], "outputs without execution count"
        for out in cell["outputs"]:
            assert out["output_type"] != "error", "stored error output"
            assert out.get("name") != "stderr" or "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]), (
                f"stderr in a compared cell: {''.join(out.get('text', ''))[:200]}"
            )
