"""The course site (scripts/site.py): what staging takes out of a lesson, the links it rewrites, and the built site
itself: it builds from this checkout, every internal link and image resolves, each lesson page shows its figures,
its launch buttons and the navigation, and one page opened in headless Chromium shows them (screenshot kept in
test-artifacts/site/)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("course_site", ROOT / "scripts" / "site.py")  # not stdlib's `site`
course_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(course_site)

NOTEBOOKS = course_site.lesson_notebooks()


def _nb(*cells):
    return {"cells": list(cells), "metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 5}


def _code(source, *outputs):
    return {"cell_type": "code", "source": source, "outputs": list(outputs), "metadata": {}, "execution_count": 1}


WIDGET = {"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "interactive(...)"}


def test_staging_takes_out_markers_stderr_and_widgets_and_leaves_a_note_for_a_panel():
    nb = _nb(
        {"cell_type": "markdown", "metadata": {},
         "source": "# 99 · A title\nSee [the references](../docs/references.md#top)."},
        _code("# NBVAL_IGNORE_OUTPUT\nx = 1\nprint(x)",
              {"output_type": "stream", "name": "stdout", "text": "1\n"},
              {"output_type": "stream", "name": "stderr", "text": "a warning\n"}),
        _code("for _ in progress(range(3)): pass", {"output_type": "display_data", "data": WIDGET, "metadata": {}}),
        _code("slider_panel(fn, a=(1, 2))", {"output_type": "execute_result", "data": WIDGET, "metadata": {}}),
    )  # fmt: skip
    before = json.dumps(nb)
    out = course_site.clean_notebook(nb, "99_title.ipynb")
    assert json.dumps(nb) == before, "the committed notebook's copy must not change"
    title, buttons, rest, marked, progress, panel = out["cells"]
    assert "widgets" not in out["metadata"]
    assert title["source"] == "# 99 · A title\n"  # the header right under the title line, in the first screen
    assert "](../references.md#top)" in rest["source"]
    colab, binder = course_site.launch_links("99_title.ipynb")
    assert f"]({colab})" in buttons["source"] and f"]({binder})" in buttons["source"]
    assert "learner/99_title.ipynb" in colab and "learner/99_title.ipynb" in binder
    assert marked["source"] == "x = 1\nprint(x)"
    assert [o.get("name") for o in marked["outputs"]] == ["stdout"]
    assert progress["outputs"] == []
    assert [o["data"] for o in panel["outputs"]] == [{"text/markdown": course_site.PANEL_NOTE}]
    assert all(cell["id"] for cell in out["cells"])


@pytest.mark.parametrize(
    ("source", "page", "text", "expected"),
    [
        ("docs/instructor_guide.md", "instructor_guide.md", "[05](../notebooks/05_checkpointing.ipynb)",
         "[05](learner/05_checkpointing.ipynb)"),
        ("docs/instructor_guide.md", "instructor_guide.md", "[key](answer_key.md#lesson-01)",
         "[key](answer_key.md#lesson-01)"),
        ("notebooks/01_forward.ipynb", "learner/01_forward.ipynb", "[tour](00_tour.ipynb)", "[tour](00_tour.ipynb)"),
        ("notebooks/01_forward.ipynb", "learner/01_forward.ipynb", "[refs](../docs/references.md)",
         "[refs](../references.md)"),
        ("docs/references.md", "references.md", "[the model](../anatomy_helpers/core/model.py)",
         "[the model](https://github.com/{slug}/blob/{ref}/anatomy_helpers/core/model.py)"),
        ("docs/references.md", "references.md", "[torch](https://pytorch.org/docs)", "[torch](https://pytorch.org/docs)"),
        ("docs/references.md", "references.md", "[here](#sources)", "[here](#sources)"),
    ],
)  # fmt: skip
def test_links_point_at_the_pages_they_become_or_at_github(source, page, text, expected):
    slug, ref = course_site.course_config()
    assert course_site.rewrite_links(text, source, page) == expected.format(slug=slug, ref=ref)


def _page_images(html: str) -> list[str]:
    return re.findall(r'<img[^>]+src="(\.\./_images/[^"]+)"', html)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "_site"
    seconds = course_site.build(out, staging=out.parent / "src")
    print(f"\n[site test] built in {seconds:.0f} s")
    return out


@pytest.mark.delivery
def test_the_site_builds_whole_from_this_checkout(built):
    assert course_site.check(built) == []
    for path in NOTEBOOKS:
        page = (built / course_site.LESSONS / f"{path.stem}.html").read_text(encoding="utf-8")
        nb = json.loads(path.read_text(encoding="utf-8"))
        figures = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
        assert len(_page_images(page)) == figures, f"{path.name}: every figure of the notebook is on its page"
        colab, binder = course_site.launch_links(path.name)
        assert colab in page and binder.replace("&", "&amp;") in page
        assert "NBVAL" not in page and "stderr" not in page, path.name
        panels = sum("slider_panel(" in "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert page.count("The live panel runs in a kernel") == panels, path.name
        assert "answer_key" not in page, f"{path.name}: the answer key is not linked from a lesson"
    index = (built / "index.html").read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        assert f'href="{course_site.LESSONS}/{path.stem}.html"' in index
    assert (built / "answer_key.html").exists() and (built / "search.html").exists()
    assert "answer_key.html" in (built / "instructor_guide.html").read_text(encoding="utf-8")


def _search_index(built: Path) -> dict:
    text = (built / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1 : text.rindex(")")])  # Search.setIndex({...})


def _docs_in(value) -> set[int]:
    """The document numbers a search-index entry points at (a number, a list of them, or [doc, anchor] pairs)."""
    if isinstance(value, int):
        return {value}
    if isinstance(value, dict):
        return set().union(*map(_docs_in, value.values())) if value else set()
    if isinstance(value, list):
        return {v[0] if isinstance(v, list) else v for v in value if isinstance(v, (int, list))}
    return set()


@pytest.mark.delivery
def test_the_answer_key_is_in_no_navigation_and_no_search_only_the_instructor_guide_links_it(built):
    """Searching "LoRA" showed "Answer key" second with an exercise's answer in the snippet: its words, title and
    headings are out of the index, and no page but the instructor guide links to it."""
    index = _search_index(built)
    key = index["docnames"].index("answer_key")
    assert index["titles"][key] == ""
    for part in ("terms", "titleterms"):
        assert not [w for w, docs in index[part].items() if key in _docs_in(docs)], part
    assert not [t for t, docs in index["alltitles"].items() if key in _docs_in(docs)]
    assert "LoRA" in (built / "answer_key.html").read_text(encoding="utf-8")  # the page itself is whole
    assert [w for w in ("lora",) if w in index["terms"]], "the lessons' own words are still indexed"
    for page in built.rglob("*.html"):
        if page.name not in ("answer_key.html", "instructor_guide.html") and "_static" not in page.parts:
            assert "answer_key" not in page.read_text(encoding="utf-8"), page.relative_to(built)


@pytest.mark.delivery
def test_a_lesson_page_in_chromium_shows_its_title_a_figure_and_the_navigation(built):
    sys.path.insert(0, str(ROOT / "scripts"))
    import browser_check

    chromium, why = browser_check.ensure_browser(log=lambda m: print(f"\n[site test] {m}", flush=True))
    if chromium is None:
        pytest.skip(f"NOT TESTED: {why}")
    shots = Path(os.environ.get("COURSE_ARTIFACTS", ROOT / "test-artifacts")) / "site"
    shots.mkdir(parents=True, exist_ok=True)
    # in a thread of its own: playwright's sync API refuses a thread whose asyncio loop is running, and the browser
    # test's open Chromium (same xdist worker, module-scoped) runs one in this thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_open_a_lesson_page, built, chromium, shots).result()


JS_LESSON_PAGE = r"""() => {
  const visible = (e) => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0 &&
                           getComputedStyle(e).visibility !== 'hidden'; };
  const article = document.querySelector('article');
  const first = (text) => [...article.querySelectorAll('a')].find(a => a.textContent.trim() === text);
  const inFirstScreen = (a) => !!a && a.getBoundingClientRect().bottom <= window.innerHeight;
  const header = [...(document.querySelector('.bd-header-article') || document).querySelectorAll('a')];
  const has = (sel) => !!document.querySelector(sel);
  const launch = ['Open in Colab', 'Launch Binder', 'Download the notebook'];
  return {
    sideways: Math.max(0, document.documentElement.scrollWidth - window.innerWidth),
    searchBoxes: [...document.querySelectorAll('.search-button-field, input[type=search]')].filter(visible).length,
    launchInFirstScreen: launch.every(t => inFirstScreen(first(t))),
    headerButtons: has('.bd-header-article a[href*="colab.research.google.com/github/"]')
      && has('.bd-header-article a[href*="mybinder.org/v2/gh/"]')
      && header.some(a => a.href.includes('/issues/new'))
      && header.some(a => /github\.com\/[^/]+\/[^/]+\/?$/.test(a.href)),
  };
}"""


def _open_a_lesson_page(built: Path, chromium: str, shots: Path) -> None:
    from playwright.sync_api import sync_playwright

    lesson = NOTEBOOKS[1]
    title = course_site.title_of(json.loads(lesson.read_text(encoding="utf-8")))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((built / course_site.LESSONS / f"{lesson.stem}.html").as_uri())
            page.wait_for_load_state("load")
            assert page.locator("h1").first.inner_text().strip().rstrip("#").strip() == title
            figure = page.locator("img[src*='_images/']").first
            figure.scroll_into_view_if_needed()
            assert figure.evaluate("img => img.complete && img.naturalWidth > 0"), "the first figure is drawn"
            assert page.locator("a.left-prev").get_attribute("href") == f"{NOTEBOOKS[0].stem}.html"
            assert page.locator("a.right-next").get_attribute("href") == f"{NOTEBOOKS[2].stem}.html"
            page.screenshot(path=str(shots / f"{lesson.stem}.png"))
            page.goto((built / "index.html").as_uri())
            page.screenshot(path=str(shots / "index.png"))
            assert page.locator(f"a[href='{course_site.LESSONS}/{lesson.stem}.html']").count() >= 1
            for nb in NOTEBOOKS:  # every lesson page, as a reader opens it in a laptop's window
                page.goto((built / course_site.LESSONS / f"{nb.stem}.html").as_uri())
                page.wait_for_load_state("load")
                assert page.evaluate(JS_LESSON_PAGE) == {
                    "sideways": 0,  # the page never scrolls sideways: wide outputs and tables scroll in their box
                    "searchBoxes": 1,  # one search box (the theme's sidebar held a second)
                    "launchInFirstScreen": True,  # Colab, Binder and the download under the title, not below
                    "headerButtons": True,  # and in the theme's header, with the repository and issue buttons
                }, nb.name
        finally:
            browser.close()


def test_the_link_check_finds_a_missing_page_image_and_anchor(tmp_path):
    (tmp_path / "lessons").mkdir()
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "fig.png").write_bytes(b"png")
    (tmp_path / "index.html").write_text(
        '<a href="lessons/a.html#goal">a</a> <a href="https://example.org/x">out</a> <a href="#top" id="top">top</a>'
    )
    (tmp_path / "lessons" / "a.html").write_text(
        '<h1 id="goal">A</h1><img src="../_images/fig.png"><a href="../index.html">home</a>'
    )
    assert course_site.check(tmp_path) == []
    (tmp_path / "lessons" / "b.html").write_text(
        '<img src="../_images/gone.png"><a href="a.html#nowhere">x</a><a href="c.html">y</a>'
    )
    problems = course_site.check(tmp_path)
    assert len(problems) == 3
    assert [("gone.png" in p, "nowhere" in p, "c.html" in p) for p in problems] == [
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_each_panel_follows_a_figure_of_its_default_state(path):
    """The site cannot run a slider panel; the figure in the code cell before it shows its default state (rule 6
    of CONTRIBUTING's "Adding a lesson"), and the note under the panel says so."""
    code = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    for before, cell in zip(code, code[1:]):
        if "slider_panel(" in "".join(cell["source"]):
            assert any("image/png" in o.get("data", {}) for o in before["outputs"]), "".join(cell["source"])


def test_a_lesson_header_gives_its_time_prerequisites_launch_links_source_issue_and_date():
    header = course_site.lesson_header("09_finetune.ipynb")
    minutes = course_site.guide_minutes()
    assert set(minutes) == {p.name[:2] for p in NOTEBOOKS}  # the instructor guide's table (lesson_times.py)
    assert f"**About {minutes['09']} min** in a room" in header
    # the earlier lessons it cites (section 5 cites 05's checkpointing; 10, a later one, is not a prerequisite)
    assert "lessons [05](05_checkpointing.ipynb), [06](06_prediction.ipynb), [08](08_scaling.ipynb)" in header
    colab, binder = course_site.launch_links("09_finetune.ipynb")
    slug, ref = course_site.course_config()
    for url in (colab, binder, f"https://raw.githubusercontent.com/{slug}/{ref}/learner/09_finetune.ipynb",
                f"https://github.com/{slug}/blob/{ref}/notebooks/09_finetune.ipynb",
                f"https://github.com/{slug}/issues/new?title=Lesson%2009%3A%20"):  # fmt: skip
        assert f"]({url})" in header, url
    assert f"version {course_site.version()}" in header and re.search(r"last updated \d{4}-\d\d-\d\d", header)
    assert "lessons" not in course_site.lesson_header("00_tour.ipynb")  # the tour cites no earlier lesson


def test_build_without_sphinx_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    real = course_site.importlib.util.find_spec
    monkeypatch.setattr(course_site.importlib.util, "find_spec", lambda m: None if m == "sphinx" else real(m))
    assert course_site.main(["build", "--out", str(tmp_path / "_site")]) == 2
    err = capsys.readouterr().err
    assert "needs Sphinx" in err and "-m pip install -r site/requirements.txt" in err
    assert not (tmp_path / "_site").exists()
