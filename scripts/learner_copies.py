"""Learner copies of the notebooks: learner/NN_topic.ipynb, the same cells with every output cleared.

    python scripts/learner_copies.py             # (re)write every learner copy from notebooks/
    python scripts/learner_copies.py --check     # exit 1 if a copy is missing, stale or has no notebook (CI)
    python scripts/learner_copies.py --reset 02  # put learner/02_*.ipynb (and my-work/02_*) back to unexecuted

notebooks/ keeps the executed notebooks (CI compares their outputs; they are the version to read). The stored
outputs would give the exercises away (a prediction is worth making only before the number is on the screen), so
the Colab and Binder badges open these copies instead. A copy differs from its notebook only in: no outputs or
execution counts, no widget state, a note under the title, no `# NBVAL_...` marker lines (they are for the tests,
which compare notebooks/, never these copies), and links to other files of the repository (../docs/...) pointing at
GitHub, since on Colab the notebook sits alone. Standard library only: learners run --reset too.

`lab` (scripts/course.py) opens copies of learner/ in my-work/ (:func:`workspace`: made on first launch, a new
lesson's added later, never overwritten), which git ignores: a learner's runs and edits never dirty the checkout.
"""

from __future__ import annotations

import argparse
import copy
import json
import posixpath
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from course_links import course_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
LEARNER = ROOT / "learner"
NOTE_ID = "learner-copy-note"
NBVAL_MARKER = re.compile(r"^# NBVAL_[A-Z_]+[ \t]*\n?", re.M)  # a whole comment line that tells nbval what to do
REPO_LINK = re.compile(r"\]\(\.\./(?!notebooks/|learner/)([^)\s]+)\)")  # markdown links to files outside notebooks/
LOCAL_IMAGE = re.compile(r"(!\[[^\]]*\]\()(?![a-z]+:|/)([^)\s]+)\)")  # a markdown image of a repository file


def raw_images(text: str, slug: str, ref: str) -> str:
    """Markdown ``text`` of a notebook in notebooks/ with each image of a repository file pointing at the file
    itself (raw.githubusercontent.com): in learner/ and on Colab the relative path leads nowhere, and a
    github.com/.../blob/ link is an HTML page, not an image."""

    def fix(m: re.Match) -> str:
        path = posixpath.normpath(posixpath.join("notebooks", m.group(2)))
        return f"{m.group(1)}https://raw.githubusercontent.com/{slug}/{ref}/{path})"

    return LOCAL_IMAGE.sub(fix, text)


def note(name: str, slug: str, ref: str) -> dict:
    url = f"https://github.com/{slug}/blob/{ref}/notebooks/{name}"
    text = (
        "> **Learner copy.** Run the cells in order (or *Run → Run All Cells*). The outputs are cleared so that "
        "the exercises don't give their answers away, and *Run All* stops at each exercise until you have put your "
        "prediction in its cell: then run that cell and carry on with *Run → Run Selected Cell and All Below*. "
        f"The same notebook with every output, to read or to check against afterwards: [notebooks/{name}]"
        f"({url}). To start over: *Edit → Clear Outputs of All Cells*, then *Kernel → Restart Kernel* (in a clone, "
        f"`python scripts/learner_copies.py --reset {name[:2]}` also undoes your edits)."
    )
    return {"cell_type": "markdown", "id": NOTE_ID, "metadata": {"tags": ["learner-copy"]}, "source": text}


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def learner_copy(nb: dict, name: str, slug: str, ref: str) -> dict:
    """The learner copy of the executed notebook ``nb`` (a dict as json.load gives it), named ``name``."""
    out = copy.deepcopy(nb)
    out["metadata"].pop("widgets", None)
    for cell in out["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
            cell["source"] = lines(NBVAL_MARKER.sub("", "".join(cell["source"])))
        elif cell["cell_type"] == "markdown":
            src = raw_images("".join(cell["source"]), slug, ref)
            cell["source"] = lines(REPO_LINK.sub(rf"](https://github.com/{slug}/blob/{ref}/\1)", src))
    cells = out["cells"]
    at = 1 if cells and cells[0]["cell_type"] == "markdown" else 0  # under the title cell
    n = note(name, slug, ref)
    n["source"] = lines(n["source"])
    if "id" not in cells[0]:  # nbformat < 4.5 has no cell ids
        del n["id"]
    cells.insert(at, n)
    return out


def dumps(nb: dict) -> str:
    """JSON as Jupyter writes it (nbformat's layout), so that saving a copy in JupyterLab changes little."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def expected() -> dict[Path, str]:
    slug, ref = course_config()
    want = {}
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        want[LEARNER / path.name] = dumps(learner_copy(nb, path.name, slug, ref))
    return want


def problems() -> list[str]:
    want = expected()
    found = []
    for path, text in want.items():
        if not path.exists():
            found.append(f"missing: {path.relative_to(ROOT)}")
        elif path.read_text(encoding="utf-8") != text:
            found.append(f"stale: {path.relative_to(ROOT)}")
    for path in sorted(LEARNER.glob("*.ipynb")):
        if path not in want:
            found.append(f"no notebook for: {path.relative_to(ROOT)}")
    return found


def write(only: list[str] | None = None) -> list[Path]:
    """Write the learner copies (``only``: those whose names start so; then the learner's own copy in
    :data:`WORK` too, where there is one: --reset undoes their edits)."""
    LEARNER.mkdir(exist_ok=True)
    written = []
    for path, text in expected().items():
        if only and not any(path.name.startswith(o) for o in only):
            continue
        path.write_text(text, encoding="utf-8")
        written.append(path)
        if only and (WORK / path.name).exists():
            (WORK / path.name).write_text(text, encoding="utf-8")
            written.append(WORK / path.name)
    if only and not written:
        sys.exit(f"no notebook matches {only}")
    return written


#: Where `lab` opens the learner's notebooks: copies of learner/ that git ignores (.gitignore), so running and
#: saving them leaves the repository clean and `git pull` never conflicts with a learner's work.
WORK = ROOT / "my-work"


def workspace(dest: Path | None = None) -> list[Path]:
    """Copy each learner notebook into ``dest`` (default :data:`WORK`) that is not there yet; never overwrite one
    (it holds the learner's work). Returns the copies made."""
    dest = WORK if dest is None else dest
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    for path in sorted(LEARNER.glob("[0-9][0-9]_*.ipynb")):
        if not (dest / path.name).exists():
            shutil.copyfile(path, dest / path.name)
            made.append(dest / path.name)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="only check that learner/ is in sync")
    group.add_argument("--reset", nargs="+", metavar="NN", help="rewrite only these learner copies")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        for p in found:
            print(p)
        if found:
            print("learner/ is out of sync with notebooks/: run `python scripts/learner_copies.py` and commit learner/")
            return 1
        print(f"learner/ is in sync with notebooks/ ({len(expected())} notebooks)")
        return 0
    for path in write(args.reset):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
