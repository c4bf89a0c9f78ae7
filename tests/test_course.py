"""The course as a whole: README links, notebook conventions, the slug in one place, the learner copies."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def load_script(name: str):
    """A module of scripts/ (they are not a package), imported by path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


course_links = load_script("course_links")
learner_copies = load_script("learner_copies")
SLUG, REF = course_links.course_config()


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_tour.ipynb"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_readme_links_the_notebook_to_read_and_its_learner_copy_on_colab_and_binder(nb):
    readme = (ROOT / "README.md").read_text()
    assert f"(notebooks/{nb.name})" in readme  # to read: executed, every output
    assert f"colab.research.google.com/github/{SLUG}/blob/{REF}/learner/{nb.name})" in readme
    assert f"mybinder.org/v2/gh/{SLUG}/{REF}?urlpath=lab/tree/learner/{nb.name})" in readme


def test_readme_badges_open_the_tour():
    readme = (ROOT / "README.md").read_text()
    head = readme.split("## ", 1)[0]
    assert f"github.com/{SLUG}/actions/workflows/ci.yml/badge.svg" in head
    assert f"colab.research.google.com/github/{SLUG}/blob/{REF}/learner/00_tour.ipynb" in head
    assert f"mybinder.org/v2/gh/{SLUG}/{REF}?urlpath=lab/tree/learner/00_tour.ipynb" in head  # JupyterLab, the tour
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_every_course_link_agrees_with_the_slug_in_pyproject():
    assert course_links.check(SLUG, REF) == []


def test_the_slug_check_finds_and_fixes_a_stale_link():
    stale = "[![c](x)](https://colab.research.google.com/github/someone/training-step-anatomy/blob/dev/learner/a.ipynb)"
    text = f'{stale}\n"git+https://github.com/someone/training-step-anatomy@dev"\nhttps://github.com/pytorch/pytorch\n'
    fixed, wrong = course_links.fix(text, "me/training-step-anatomy", "main")
    assert len(wrong) == 4  # two slugs, two refs; pytorch/pytorch is not a course link
    assert fixed.count("me/training-step-anatomy") == 2 and "@main" in fixed and "/blob/main/" in fixed
    assert "https://github.com/pytorch/pytorch" in fixed
    assert course_links.UNPINNED.search('"git+https://github.com/me/training-step-anatomy"')
    assert not course_links.UNPINNED.search('"git+https://github.com/me/training-step-anatomy@v1.0"')


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_installs_like_colab_and_picks_the_device(nb):
    first = "".join(code_cells(nb)[0]["source"])
    install = f'COURSE = "git+https://github.com/{SLUG}@{REF}"'
    assert install in first  # pinned to the branch the badges open
    colab = first.split('if "google.colab" in sys.modules:', 1)[1].split("\n\n", 1)[0]
    assert '"pip", "install", "-q", f"anatomy_helpers @ {COURSE}"' in colab  # not editable (-e), not torch
    assert "torch" not in colab and "-e" not in colab.split(",") and "--upgrade" not in colab
    assert "device = pick_device()" in first and 'print(f"Using device: {device}")' in first
    assert "Change runtime type" in first  # a CPU runtime on Colab is told how to get the GPU
    policy = 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")'  # OpenMP threads sleep, not spin, on a busy laptop
    before = first.split(policy)[0] if policy in first else pytest.fail(f"the first cell lacks {policy}")
    assert not re.search(r"^(import|from) (torch|anatomy_helpers)", before, re.M)  # libgomp reads it as torch loads
    meta = json.loads(nb.read_text())["metadata"]
    assert meta["accelerator"] == "GPU" and meta["colab"]["gpuType"] == "T4"  # Colab opens it on a GPU runtime


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_clean(nb):
    for cell in code_cells(nb):
        assert cell["execution_count"] is not None or not cell["outputs"], "outputs without execution count"
        for out in cell["outputs"]:
            assert out["output_type"] != "error", "stored error output"
            assert out.get("name") != "stderr" or "NBVAL_IGNORE_OUTPUT" in "".join(cell["source"]), (
                f"stderr in a compared cell: {''.join(out.get('text', ''))[:200]}"
            )


def test_learner_copies_are_in_sync_with_the_notebooks():
    assert learner_copies.problems() == [], "run `python scripts/learner_copies.py` and commit learner/"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_learner_copy_has_no_outputs_and_the_same_code(nb):
    copy = json.loads((ROOT / "learner" / nb.name).read_text())
    assert all(not c["outputs"] and c["execution_count"] is None for c in copy["cells"] if c["cell_type"] == "code")
    assert "widgets" not in copy["metadata"]
    # the same code but for nbval's marker lines, which mean nothing to a learner (#46)
    learner_code = ["".join(c["source"]) for c in copy["cells"] if c["cell_type"] == "code"]
    unmarked = [
        "".join(line for line in "".join(c["source"]).splitlines(keepends=True) if not line.startswith("# NBVAL_"))
        for c in code_cells(nb)
    ]
    assert learner_code == unmarked
    text = json.dumps(copy)
    assert "NBVAL" not in text
    assert "](../" not in text.replace("](../notebooks/", "").replace("](../learner/", "")  # no repo-relative links


def test_learner_copy_generation(tmp_path):
    nb = {
        "cells": [
            {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# T\n", "see [refs](../docs/r.md)"]},
            {"cell_type": "code", "id": "b", "metadata": {"execution": {"x": 1}}, "source": ["1"],
             "execution_count": 3, "outputs": [{"output_type": "stream", "name": "stdout", "text": ["1"]}]},
        ],
        "metadata": {"widgets": {"state": {}}, "kernelspec": {}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }  # fmt: skip
    out = learner_copies.learner_copy(nb, "09_x.ipynb", "me/repo", "main")
    assert [c["id"] for c in out["cells"]] == ["a", learner_copies.NOTE_ID, "b"]
    assert out["cells"][0]["source"] == ["# T\n", "see [refs](https://github.com/me/repo/blob/main/docs/r.md)"]
    assert "https://github.com/me/repo/blob/main/notebooks/09_x.ipynb" in "".join(out["cells"][1]["source"])
    assert out["cells"][2] == {"cell_type": "code", "id": "b", "metadata": {}, "source": ["1"],
                               "execution_count": None, "outputs": []}  # fmt: skip
    assert out["metadata"] == {"kernelspec": {}}
    assert nb["cells"][1]["outputs"]  # the executed notebook is left alone


def exercise_ids(nb: Path) -> list[str]:
    """The answer-key anchors a notebook needs: one per exercise cell (a `my_... = None` to fill in) and per panel."""
    num, ids, k = nb.name[:2], [], 0
    for cell in code_cells(nb):
        src = "".join(cell["source"])
        if re.search(r"^my_\w+ = None", src, re.M):
            k += 1
            ids.append(f"{num}-exercise-{k}")
        for fn in re.findall(r"slider_panel\(\s*(\w+)", src):
            ids.append(f"{num}-panel-{fn}")
    return ids


def test_answer_key_has_every_exercise_and_slider_prompt():
    key = (ROOT / "docs" / "answer_key.md").read_text()
    wanted = [i for nb in NOTEBOOKS for i in exercise_ids(nb)]
    assert "00-panel-track_and_plot" in wanted and "01-exercise-1" in wanted
    assert [i for i in wanted if f"<!-- {i} -->" not in key] == [], "add these to docs/answer_key.md"
    assert [i for i in re.findall(r"<!-- (\d\d-\w+-\w+) -->", key) if i not in wanted] == []  # none left behind


def test_instructor_guide_covers_every_notebook_and_the_plan_fits_three_hours():
    guide = (ROOT / "docs" / "instructor_guide.md").read_text()
    for nb in NOTEBOOKS:
        assert f"(../notebooks/{nb.name})" in guide and f"### {nb.name[:2]} · " in guide, nb.name
    plan = guide.split("## The 3-hour plan", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in plan.splitlines() if re.match(r"\| \d:\d\d \|", line)]
    assert sum(int(r[-2]) for r in rows) <= 180 and "first cell" in rows[0][2]  # setup included
    in_plan = {m for r in rows for m in re.findall(r"notebooks/(\d\d)_", r[2])}
    assert {"00", "01", "02", "03", "04"} <= in_plan


def test_instructor_guide_links_the_recorded_gpu_outputs_or_says_there_are_none():
    guide = (ROOT / "docs" / "instructor_guide.md").read_text()
    section = guide.split("## Pre-recorded GPU outputs", 1)[1]
    recorded = sorted((ROOT / "docs" / "gpu_outputs").glob("*.ipynb"))
    if recorded:
        assert all(f"(gpu_outputs/{p.name})" in section for p in recorded)
    else:
        assert "Not recorded yet" in section


def _output_text(output) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    return "".join(output.get("data", {}).get("text/plain", ""))


def answer_spellings(measured: float, unit: str) -> list[str]:
    """How a cell would print an exercise's answer: 2 decimals in the unit (alone, as in a table, or with the unit),
    and for byte answers the whole number of bytes with thousands separators."""
    if unit in ("x", "count"):
        return [f"{measured:.2f}x", f"{measured:,.0f}"] if unit == "count" else [f"{measured:.2f}x"]
    spellings = [f"{measured:.2f}"]
    factor = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    nbytes = round(measured * factor)
    if nbytes >= 10_000:
        spellings.append(f"{nbytes:,}")
    return spellings


#: Exercises whose answer is, by design or by coincidence, a number the lesson printed earlier as something else.
GIVEN_EARLIER = {
    ("03_optimizer", "SGD-with-momentum state after step 1"): "one copy of the parameter bytes (prompt)",
    ("04_first_step", "new segments in step 3"): "a count of 0: the digit is in any output",
    ("08_scaling", "rank 0's optimizer state, 4 ranks"): "0.79 MiB is also the 2-rank parameters (Ψ/2 = 2Ψ/4)",
}


def answers_shown_early(nb: Path) -> list[str]:
    """Exercises of ``nb`` whose measured answer an earlier output already prints (a number bounded by non-digits)."""
    from anatomy_helpers.ui.exercises import METADATA_KEY

    earlier, found, asked = [], [], 0
    for cell in code_cells(nb):
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get(METADATA_KEY)
            if meta is not None:
                asked += 1
                if (nb.stem, meta["name"]) in GIVEN_EARLIER:
                    continue
                shown = "\n".join(earlier)
                for spelling in answer_spellings(meta["measured"], meta["unit"]):
                    if re.search(rf"(?<![\d.,]){re.escape(spelling)}(?![\d]|\.\d|,\d)", shown):
                        found.append(f"{nb.stem}: {meta['name']!r} ({spelling}) is printed before it is asked")
        earlier.extend(_output_text(o) for o in cell.get("outputs", []))
    sources = ["".join(c["source"]) for c in code_cells(nb)]
    numeric = sum(bool(re.search(r"^my_\w+ = None", src, re.M)) and "check_prediction(" in src for src in sources)
    assert asked == numeric, f"{nb.stem}: {numeric} numeric exercises but {asked} outputs record their answer"
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_output_gives_an_exercises_answer_away_before_it_is_asked(nb):
    assert answers_shown_early(nb) == []


def prediction_stops(nb: Path) -> list[str]:
    """Exercise cells of ``nb`` that do not stop Run All at once: after `my_x = None`, the next statement must be
    `require_prediction(my_x, ...)` (ui/exercises.py), before anything that could reveal the answer."""
    missing = []
    for cell in code_cells(nb):
        lines = [ln for ln in "".join(cell["source"]).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        m = re.match(r"(my_\w+) = None$", lines[0]) if lines else None
        if m and not (len(lines) > 1 and lines[1].startswith(f"require_prediction({m.group(1)}, ")):
            missing.append(f"{nb.stem}: {lines[0]!r} is not followed by require_prediction({m.group(1)}, ...)")
    return missing


#: Lessons whose exercises stop Run All (#46); any other notebook that uses require_prediction must use it throughout.
STOPPING = {"00", "01", "02", "03", "04", "05"}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_stops_run_all_until_it_has_a_prediction(nb):
    if nb.name[:2] in STOPPING or "require_prediction(" in nb.read_text(encoding="utf-8"):
        assert prediction_stops(nb) == []


def test_the_stop_check_finds_an_exercise_that_does_not_stop(tmp_path):
    def code(src):
        return {"cell_type": "code", "source": src, "outputs": [], "metadata": {}, "execution_count": None}

    nb = tmp_path / "99_x.ipynb"
    for src, found in (
        ('my_x = None\nrequire_prediction(my_x, "peak")\ncheck_prediction("peak", my_x, m)', False),
        ('my_x = None\n# a comment\nrequire_prediction(my_x, "peak")', False),
        ('my_x = None\nm = measure()\nrequire_prediction(my_x, "peak")', True),
        ('my_x = None\ncheck_prediction("peak", my_x, m)', True),
    ):
        nb.write_text(json.dumps({"cells": [code(src)]}))
        assert bool(prediction_stops(nb)) == found, src


def test_the_early_answer_check_finds_a_planted_answer(tmp_path):
    from anatomy_helpers.ui.exercises import METADATA_KEY

    def cell(text, meta=None, source="x"):
        out = {"output_type": "display_data", "data": {"text/plain": text}, "metadata": meta or {}}
        return {"cell_type": "code", "source": source, "outputs": [out], "metadata": {}, "execution_count": 1}

    meta = {METADATA_KEY: {"name": "peak", "measured": 4.0, "unit": "MiB"}}
    ask = cell("no prediction yet", meta, 'my_x = None\ncheck_prediction("peak", my_x, m)')
    nb = tmp_path / "99_x.ipynb"
    for before, flagged in (("largest 4.00 MiB (fc)", True), ("grads 4,194,304 bytes", True), ("14.00 MiB", False)):
        nb.write_text(json.dumps({"cells": [cell(before), ask]}))
        assert bool(answers_shown_early(nb)) == flagged, before


lesson_times = load_script("lesson_times")


def guide_timing_rows() -> dict[str, list[str]]:
    """The per-lesson timing table of the instructor guide, by lesson number."""
    guide = (ROOT / "docs" / "instructor_guide.md").read_text()
    section = guide.split("## How long each lesson takes", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if re.match(r"\| \d\d \|", line)]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {r[0]: r for r in rows}


def test_lesson_times_skip_the_folded_deep_dives(tmp_path):
    """Words inside an "Under the hood" <details> block are optional reading: not in the room's estimate."""
    md = {"cell_type": "markdown", "metadata": {}}
    cells = [
        {
            **md,
            "source": "one two three\n<details>\n<summary>Under the hood</summary>\n\nfour five six seven\n</details>",
        },
        {**md, "source": "eight"},
    ]
    nb = tmp_path / "99_x.ipynb"
    nb.write_text(json.dumps({"cells": cells}))
    assert lesson_times.counts(nb).words == 4


def test_the_guides_lesson_times_count_what_the_notebooks_hold():
    rows = guide_timing_rows()
    assert sorted(rows) == [nb.name[:2] for nb in NOTEBOOKS]
    for nb in NOTEBOOKS:
        number, words, _, code, exercises, panels, seconds, estimate = rows[nb.name[:2]]
        now = lesson_times.counts(nb, float(seconds))
        assert (int(words.replace(",", "")), int(code), int(exercises), int(panels)) == (
            now.words,
            now.code_cells,
            now.exercises,
            now.panels,
        ), f"{nb.name}: run `python scripts/lesson_times.py --execute` and update the guide's table"
        assert int(estimate) == round(now.estimate_min), nb.name


def test_every_slot_of_the_guides_plans_holds_its_lessons_estimate_and_the_day_has_a_buffer():
    guide = (ROOT / "docs" / "instructor_guide.md").read_text()
    estimates = {n: int(r[-1]) for n, r in guide_timing_rows().items()}
    plan = guide.split("## The 3-hour plan", 1)[1].split("\n## ", 1)[0]
    slots = []
    for line in plan.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        lessons = re.findall(r"notebooks/(\d\d)_", line)
        if len(lessons) == 1 and cells[-1].isdigit():
            slots.append((lessons[0], int(cells[-1])))
    assert {n for n, _ in slots} >= {"00", "01", "02", "03", "04"} and len(slots) == len(NOTEBOOKS)
    assert [(n, m) for n, m in slots if m < estimates[n]] == [], "a slot shorter than its lesson's estimate"
    buffer = re.search(r"\| \d:\d\d \| Buffer[^|]*\| (\d+) \|", plan)
    assert buffer and int(buffer.group(1)) >= 10, "the 3-hour plan needs a buffer of 10 minutes or more"
