"""The course site: every lesson readable in a browser with its figures, built from the executed notebooks.

    python scripts/site.py build [--out _site]   # stage the pages, then Sphinx + MyST-NB into _site/
    python scripts/site.py check [--out _site]   # every internal link, anchor and image of the built pages resolves

The notebooks are **not re-executed**: the site shows the outputs committed in ``notebooks/``, the ones nbval
compares in CI. Staging (``_build/site-src/``) copies each lesson with what a reader should not see taken out:
the ``# NBVAL_...`` marker lines, stderr, progress bars; a slider panel's live widget (it needs a kernel) becomes
a line saying where it runs live (the figure of its default state is the cell above it, CONTRIBUTING's rule for
panels); right under the title line go its time and prerequisites (scripts/lesson_times.py), links that open the
lesson's learner copy in Colab or Binder or download it, its source, an issue link, the version and the date it
last changed (:func:`lesson_header`). The theme's header carries the same launch buttons, the repository and issue
buttons and the one search box (``site/conf.py``); ``site/_static/course.css`` keeps wide outputs and tables
scrolling inside their own box. Links between the
docs and the notebooks are rewritten to the pages they become; a link to any other file of the repository goes to
it on GitHub. ``site/conf.py`` and ``site/index.md`` are the Sphinx configuration and the landing page; the lesson
list is filled in from ``notebooks/`` and README's table. The answer key is built but left out of the navigation
and the search index: only the instructor guide links to it.

Needs ``sphinx``, ``myst-nb`` and ``sphinx-book-theme`` (``site/requirements.txt``; pure Python from PyPI, no
node, no browser download); not torch. Without them ``build`` says how to install them and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import html.parser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from course_links import course_config  # noqa: E402
from lesson_times import builds_on, guide_minutes  # noqa: E402

SITE = ROOT / "site"
STAGE = ROOT / "_build" / "site-src"
DOCS = ("references.md", "instructor_guide.md", "answer_key.md")  # docs/ pages, staged at the top level
LESSONS = "learner"  # the staged folder of the lesson pages: the theme's Colab/Binder buttons open learner/NN there
NEEDS = ("Sphinx", "myst_nb", "sphinx_book_theme")  # what `build` imports: site/requirements.txt installs them
LINK = re.compile(r"(\]\()([^)\s]+)(\))")  # a markdown link's target
PANEL_NOTE = (
    "*The live panel runs in a kernel: open this lesson in Colab or Binder (buttons at the top), or locally with "
    "`bash scripts/lab.sh`, and move its controls. The figure above is its default state.*"
)


def lesson_notebooks() -> list[Path]:
    """The executed lessons, in order: notebooks/NN_topic.ipynb."""
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def readme_blurbs() -> dict[str, str]:
    """{notebook file name: README's one-line description}, from the table of notebooks."""
    table_row = r"^\| \d\d \| \[[^\]]+\]\(notebooks/([^)]+\.ipynb)\):? ?([^|]*)\|"
    rows = re.findall(table_row, (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    return {name: blurb.strip() for name, blurb in rows}


def launch_links(name: str) -> tuple[str, str]:
    """(Colab URL, Binder URL) of the learner copy of notebook ``name``, from pyproject's [tool.course]."""
    slug, ref = course_config()
    return (
        f"https://colab.research.google.com/github/{slug}/blob/{ref}/learner/{name}",
        f"https://mybinder.org/v2/gh/{slug}/{ref}?urlpath=lab/tree/learner/{name}",
    )


def last_updated(path: Path) -> str:
    """The date (YYYY-MM-DD) of the last commit that changed ``path``, or of the checkout's last commit; "" outside
    git."""
    for args in (["--", str(path)], []):
        done = subprocess.run(["git", "log", "-1", "--format=%cs", *args], cwd=ROOT, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return ""


def version() -> str:
    """The course package's version, from pyproject.toml."""
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)


def lesson_header(name: str) -> str:
    """What goes under a lesson's title, in its first screen: the time it takes in a room (the instructor guide's
    estimate, scripts/lesson_times.py) and what it builds on; the launch links (Colab and Binder open the learner
    copy; the learner notebook to download); the source and an issue link; the version and last-updated line."""
    slug, ref = course_config()
    colab, binder = launch_links(name)
    minutes = guide_minutes().get(name[:2])
    earlier = builds_on(ROOT / "notebooks" / name) if (ROOT / "notebooks" / name).exists() else []
    names = {p.name[:2]: p.name for p in lesson_notebooks()}
    prior = ", ".join(f"[{n}]({names[n]})" for n in earlier if n in names)
    needs = "**Prerequisites:** training a model in PyTorch" + (f"; lessons {prior}" if prior else "")
    when = f"**About {minutes} min** in a room (reading, exercises, panels, running it) · " if minutes else ""
    issue = f"https://github.com/{slug}/issues/new?title=" + quote(f"Lesson {name[:2]}: ")
    updated = last_updated(ROOT / "notebooks" / name)
    return (
        f"{when}{needs}\n\n"
        f"**Run it yourself:** [Open in Colab]({colab}) · [Launch Binder]({binder}) · "
        f"[Download the notebook](https://raw.githubusercontent.com/{slug}/{ref}/learner/{name}) · or locally, "
        "`bash scripts/lab.sh` in a clone of the repository\n\n"
        f"[Source on GitHub](https://github.com/{slug}/blob/{ref}/notebooks/{name}) · [Open an issue]({issue}) · "
        f"version {version()}" + (f", last updated {updated}" if updated else "")
    )


def page_of(repo_path: str) -> str | None:
    """The staged page a repository file becomes (relative to the site's root), or None if it is not a page."""
    folder, _, name = repo_path.rpartition("/")
    if folder in ("notebooks", "learner") and re.match(r"\d\d_.*\.ipynb$", name):
        return f"{LESSONS}/{name}"
    if folder == "docs" and name in DOCS:
        return name
    return None


def rewrite_links(text: str, source: str, page: str) -> str:
    """Markdown ``text`` of the repository file ``source``, staged as ``page``: each relative link points at the
    page its target becomes, or at the file on GitHub; each relative image at the file itself
    (raw.githubusercontent.com)."""
    slug, ref = course_config()

    def fix(m: re.Match) -> str:
        target = m.group(2)
        parts = urlsplit(target)
        if parts.scheme or target.startswith("#"):
            return m.group(0)
        path = os.path.normpath(os.path.join(os.path.dirname(source), unquote(parts.path))).replace(os.sep, "/")
        anchor = f"#{parts.fragment}" if parts.fragment else ""
        staged = page_of(path)
        opening = text.rfind("[", 0, m.start())
        if opening > 0 and text[opening - 1] == "!":  # an image: the file itself (a blob link is an HTML page)
            return f"{m.group(1)}https://raw.githubusercontent.com/{slug}/{ref}/{path}{m.group(3)}"
        if staged is None:
            kind = "tree" if (ROOT / path).is_dir() else "blob"
            return f"{m.group(1)}https://github.com/{slug}/{kind}/{ref}/{path}{anchor}{m.group(3)}"
        return f"{m.group(1)}{os.path.relpath(staged, os.path.dirname(page) or '.')}{anchor}{m.group(3)}"

    return LINK.sub(fix, text)


def _is_widget(output: dict) -> bool:
    return "application/vnd.jupyter.widget-view+json" in output.get("data", {})


def clean_notebook(nb: dict, name: str) -> dict:
    """What a reader sees of the executed lesson ``name`` (see the module docstring); ``nb`` is left unchanged."""
    nb = copy.deepcopy(nb)
    nb["metadata"].pop("widgets", None)
    page = f"{LESSONS}/{name}"
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            cell["source"] = rewrite_links(source, f"notebooks/{name}", page)
            continue
        if cell["cell_type"] != "code":
            continue
        cell["source"] = "\n".join(line for line in source.split("\n") if not line.startswith("# NBVAL_"))
        outputs = []
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and out["name"] == "stderr":
                continue
            if _is_widget(out):
                if "slider_panel(" in source:  # the live panel; a progress bar is simply dropped
                    note = {"text/markdown": PANEL_NOTE}
                    outputs.append({"output_type": "display_data", "metadata": {}, "data": note})
                continue
            outputs.append(out)
        cell["outputs"] = outputs
    header = {"cell_type": "markdown", "metadata": {}, "source": lesson_header(name)}
    for i, cell in enumerate(nb["cells"]):  # right under the title line, in the first screen: the title cell split
        m = re.search(r"^#\s+.+$\n?", cell["source"], re.M) if cell["cell_type"] == "markdown" else None
        if m:
            rest = {**cell, "source": cell["source"][m.end() :]}
            if "id" in cell:  # cell ids are unique in a notebook
                rest["id"], header["id"] = f"{cell['id']}-rest", f"{cell['id']}-header"
            nb["cells"][i : i + 1] = [{**cell, "source": cell["source"][: m.end()]}, header] + (
                [rest] if rest["source"].strip() else []
            )
            break
    else:
        nb["cells"].insert(0, header)
    for i, cell in enumerate(nb["cells"]):
        cell.setdefault("id", f"cell-{i}")  # nbformat 4.5 wants an id on every cell
    return nb


def title_of(nb: dict) -> str:
    """The lesson's title: its first markdown heading."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^#\s+(.+)$", "".join(cell["source"]), re.M)
            if m:
                return m.group(1).strip()
    raise ValueError("a lesson notebook needs a '# title' in a markdown cell")


def stage(dest: Path = STAGE) -> Path:
    """Write the site's sources into ``dest`` (emptied first) and return it."""
    shutil.rmtree(dest, ignore_errors=True)
    (dest / LESSONS).mkdir(parents=True)
    shutil.copy(SITE / "conf.py", dest / "conf.py")
    shutil.copytree(SITE / "_static", dest / "_static")
    slug, ref = course_config()
    about = {"slug": slug, "ref": ref, "version": version(), "updated": last_updated(ROOT)}
    (dest / "course.json").write_text(json.dumps(about), encoding="utf-8")  # conf.py reads it
    blurbs, items, toc = readme_blurbs(), [], []
    for path in lesson_notebooks():
        nb = json.loads(path.read_text(encoding="utf-8"))
        (dest / LESSONS / path.name).write_text(json.dumps(clean_notebook(nb, path.name), indent=1), encoding="utf-8")
        blurb = blurbs.get(path.name, "")
        items.append(f"- [{title_of(nb)}]({LESSONS}/{path.name})" + (f": {blurb}" if blurb else ""))
        toc.append(f"{LESSONS}/{path.stem}")
    for name in DOCS:
        text = rewrite_links((ROOT / "docs" / name).read_text(encoding="utf-8"), f"docs/{name}", name)
        if name == "answer_key.md":
            # built, but in no navigation (orphan) and not in the search index (nosearch: its words and title are
            # left out, so searching "LoRA" does not show the answers): only the instructor guide links to it
            text = "---\norphan: true\nnosearch: true\n---\n\n" + text
        (dest / name).write_text(text, encoding="utf-8")
    index = (SITE / "index.md").read_text(encoding="utf-8")
    index = index.replace("{lesson_list}", "\n".join(items)).replace("{lesson_toc}", "\n".join(toc))
    index = index.replace("{repo_link}", f"[the repository](https://github.com/{slug}/tree/{ref})")
    (dest / "index.md").write_text(index, encoding="utf-8")
    return dest


def build(out: Path, staging: Path = STAGE) -> float:
    """Stage the pages into ``staging`` and build the site into ``out``; Sphinx warnings are errors. Returns the
    wall time in seconds."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m.lower()) is None]
    if missing:
        raise SiteError(
            f"building the site needs {', '.join(missing)}, not installed in {sys.executable}: "
            f"`{sys.executable} -m pip install -r site/requirements.txt` (pure Python from PyPI; not torch)"
        )
    t0 = time.perf_counter()
    src = stage(staging)
    html = src / "_build" / "html"  # then moved to ``out``: MyST-NB writes its images beside Sphinx's output folder
    doctrees = src / "_build" / "doctrees"
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-b",
        "html",
        "-q",
        "-W",
        "--keep-going",
        "-d",
        str(doctrees),
        str(src),
        str(html),
    ]
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"sphinx-build failed (exit {done.returncode}); its messages are above")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(html, out)
    (out / ".nojekyll").touch()  # GitHub Pages: serve _static/ and _images/ as they are
    return time.perf_counter() - t0


class SiteError(Exception):
    """Why the site cannot be built here (`site.py` prints it and exits 2)."""


class _Refs(html.parser.HTMLParser):
    """The ids and the local href/src targets of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str]] = []  # (attribute, value)

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)
            if key in ("href", "src") and value:
                self.refs.append((key, value))


def check(out: Path) -> list[str]:
    """Every internal link, anchor and image of the built pages under ``out`` that does not resolve (external
    links are not followed). An empty list means the site is whole."""
    pages = {p: _Refs() for p in out.rglob("*.html") if "_static" not in p.relative_to(out).parts}  # theme templates
    for path, refs in pages.items():
        refs.feed(path.read_text(encoding="utf-8"))
    problems = []
    for path, refs in pages.items():
        for attr, value in refs.refs:
            parts = urlsplit(value)
            if parts.scheme or value.startswith(("//", "mailto:", "javascript:")):
                continue
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{path.relative_to(out)}: {attr}={value!r}"
            if not target.exists():
                problems.append(f"{where} -> missing {target}")
            elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
                problems.append(f"{where} -> no id {parts.fragment!r} on that page")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "check"])
    parser.add_argument("--out", type=Path, default=ROOT / "_site", help="the built site's folder (default: _site)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if args.command == "build":
        try:
            seconds = build(out)
        except SiteError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"built {len(list(out.rglob('*.html')))} pages into {out} in {seconds:.0f} s")
    problems = check(out)
    for p in problems:
        print(p)
    print(
        f"{len(problems)} broken internal link(s) or image(s)" if problems else "every internal link and image resolves"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
