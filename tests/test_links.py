"""What the course's links and images point at: every Colab, Binder, GitHub and raw link to this repository (README,
CONTRIBUTING, docs/, notebooks/, learner/ and the site's staged pages) has the form its service opens and names a
file that exists; every image is an image file (a github.com/.../blob/ link is an HTML page). The site's own
internal links are tests/test_site.py's (site.py check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_course import REF, ROOT, SLUG, course_links, learner_copies
from .test_site import course_site

COLAB = f"https://colab.research.google.com/github/{SLUG}/blob/{REF}/learner/00_tour.ipynb"
BINDER = f"https://mybinder.org/v2/gh/{SLUG}/{REF}?urlpath=lab/tree/learner/00_tour.ipynb"


def _markdown(path: Path) -> str:
    """A file's text, or a notebook's markdown cells."""
    if path.suffix != ".ipynb":
        return path.read_text(encoding="utf-8")
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _problems(paths: list[Path], root: Path) -> list[str]:
    found = []
    for path in paths:
        where = path.relative_to(root).as_posix()
        found += course_links.target_problems(_markdown(path), where, path.parent, SLUG, REF)
    return found


def test_every_link_to_the_repository_opens_and_every_image_is_an_image_in_the_repository_files():
    paths = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths += sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "learner").glob("*.ipynb"))
    assert len(paths) > 25
    assert _problems(paths, ROOT) == []


def test_every_link_and_image_of_the_sites_staged_pages_opens(tmp_path):
    staged = course_site.stage(tmp_path / "src")
    pages = sorted(staged.rglob("*.md")) + sorted(staged.rglob("*.ipynb"))
    assert len(pages) >= 16
    assert _problems(pages, staged) == []
    buttons = [course_site.launch_links(p.name) for p in sorted((staged / course_site.LESSONS).glob("*.ipynb"))]
    assert buttons and all(not course_links.url_problem(u, SLUG, REF) for pair in buttons for u in pair)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (COLAB, ""),
        (COLAB.replace("/blob/", "/"), "not a Colab notebook link"),  # Colab answers 404
        (COLAB.replace("00_tour", "99_none"), "no notebook learner/99_none.ipynb"),
        (COLAB.replace(f"/{REF}/", "/other-branch/"), "not a Colab notebook link"),
        (BINDER, ""),
        (BINDER.replace("?urlpath=lab/tree/", "?filepath="), "not a Binder link"),
        (BINDER.replace("00_tour", "99_none"), "no learner/99_none.ipynb"),
        (f"https://github.com/{SLUG}/blob/{REF}/docs/references.md#top", ""),
        (f"https://github.com/{SLUG}/blob/{REF}/docs/nothing.md", "no file docs/nothing.md"),
        (f"https://github.com/{SLUG}/tree/{REF}/docs", ""),
        (f"https://github.com/{SLUG}/tree/{REF}/README.md", "no folder README.md"),
        (f"https://raw.githubusercontent.com/{SLUG}/{REF}/README.md", ""),
        ("https://colab.research.google.com/assets/colab-badge.svg", ""),  # not the repository's: not followed
    ],
)
def test_a_link_to_the_repository_is_checked_for_its_form_and_its_file(url, why):
    found = course_links.url_problem(url, SLUG, REF)
    assert found.startswith(why) and bool(found) == bool(why), found


def test_an_image_is_an_image_file_not_a_github_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "fig.png").write_bytes(b"\x89PNG")
    raw = f"https://raw.githubusercontent.com/{SLUG}/{REF}/docs/fig.png"
    blob = f"https://github.com/{SLUG}/blob/{REF}/docs/fig.png"
    check = course_links.image_problem
    assert check(raw, SLUG, REF, tmp_path, root=tmp_path) == ""
    assert check(blob, SLUG, REF, tmp_path, root=tmp_path).startswith("a GitHub page, not an image")
    assert check("docs/fig.png", SLUG, REF, tmp_path) == "" and check("docs/no.png", SLUG, REF, tmp_path)
    assert check("https://example.org/page.html", SLUG, REF, tmp_path) == "not an image file"
    text = f"![a]({blob}) and <img src='{raw}'>"
    assert [p.split(": ")[1] for p in course_links.target_problems(text, "x.md", tmp_path, SLUG, REF, tmp_path)] == [
        blob
    ]


def _lesson_with_an_image(target: str) -> dict:
    return {
        "cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": [f"# T\n\n![a figure]({target})"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


@pytest.mark.parametrize("target", ["../docs/fig.png", "figures/fig.png"])
def test_a_lesson_image_stays_an_image_in_the_learner_copy_and_on_the_site(target):
    """A repository image in a lesson's markdown becomes the file itself (raw.githubusercontent.com) in learner/
    (which Colab opens alone) and on the site; never a github.com/.../blob/ page."""
    path = "docs/fig.png" if target.startswith("../") else "notebooks/figures/fig.png"
    raw = f"https://raw.githubusercontent.com/{SLUG}/{REF}/{path}"
    copy = learner_copies.learner_copy(_lesson_with_an_image(target), "99_x.ipynb", SLUG, REF)
    assert f"![a figure]({raw})" in "".join(copy["cells"][0]["source"])
    page = course_site.clean_notebook(_lesson_with_an_image(target), "99_x.ipynb")
    assert f"![a figure]({raw})" in "".join(c["source"] for c in page["cells"] if c["cell_type"] == "markdown")
