"""The repository's GitHub slug and branch live in one place, pyproject.toml's [tool.course]; check every copy.

    python scripts/course_links.py          # check: every Colab/Binder badge, install line and GitHub link agrees
    python scripts/course_links.py --write  # rewrite them all from [tool.course] (a fork: edit it, then run this)

Checked: README.md, CONTRIBUTING.md, docs/*.md, notebooks/*.ipynb, learner/*.ipynb, pyproject.toml, binder/*,
.github/workflows/*. After --write, regenerate nothing else: the learner copies are rewritten here too.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SEG = r"[A-Za-z0-9_.-]+"


def course_config(pyproject: Path = ROOT / "pyproject.toml") -> tuple[str, str]:
    """(slug, ref) from pyproject.toml's [tool.course]: "owner/name" and the branch or tag Colab installs from."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib

        data = tomllib.loads(text)["tool"]["course"]
    except ModuleNotFoundError:  # Python 3.10: the section holds plain `key = "value"` lines
        section = text.split("[tool.course]", 1)[1].split("\n[", 1)[0]
        data = dict(re.findall(r'^(\w+)\s*=\s*"([^"]*)"', section, re.M))
    return data["slug"], data["ref"]


def patterns(name: str) -> list[re.Pattern]:
    """Course links, each with a `slug` group and, where the link names one, a `ref` group."""
    return [
        re.compile(rf"colab\.research\.google\.com/github/(?P<slug>{SEG}/{SEG})/blob/(?P<ref>{SEG})/"),
        re.compile(rf"mybinder\.org/v2/gh/(?P<slug>{SEG}/{SEG})/(?P<ref>{SEG})\?"),
        re.compile(rf"git\+https://github\.com/(?P<slug>{SEG}/{SEG})@(?P<ref>{SEG})"),
        re.compile(rf"github\.com/(?P<slug>{SEG}/{re.escape(name)})/(?:blob|tree)/(?P<ref>{SEG})/"),
        re.compile(rf"github\.com/(?P<slug>{SEG}/{re.escape(name)})\b"),
    ]


UNPINNED = re.compile(rf"git\+https://github\.com/{SEG}/{SEG}(?![A-Za-z0-9_.@-])")


def files() -> list[Path]:
    globs = ["README.md", "CONTRIBUTING.md", "docs/*.md", "notebooks/*.ipynb", "learner/*.ipynb", "pyproject.toml",
             "binder/*", ".github/workflows/*"]  # fmt: skip
    return sorted({p for g in globs for p in ROOT.glob(g) if p.is_file()})


def fix(text: str, slug: str, ref: str) -> tuple[str, list[str]]:
    """``text`` with every course link pointing at ``slug``/``ref``, and what was wrong."""
    wrong: list[str] = []
    for pat in patterns(slug.split("/")[1]):

        def sub(m: re.Match, pat: re.Pattern = pat, text: str = text) -> str:
            out, last = [], m.start()
            for group, want in (("slug", slug), ("ref", ref)):
                if group in pat.groupindex and m.group(group) != want:
                    wrong.append(f"{m.group(0)!r}: {group} {m.group(group)!r}, expected {want!r}")
                    out += [text[last : m.start(group)], want]
                    last = m.end(group)
            return "".join(out) + text[last : m.end()]

        text = pat.sub(sub, text)
    return text, wrong


def check(slug: str, ref: str, write: bool = False) -> list[str]:
    """Problems found (file: what); with ``write``, the files are corrected and the problems still returned."""
    problems = []
    for path in files():
        text = path.read_text(encoding="utf-8")
        fixed, wrong = fix(text, slug, ref)
        rel = path.relative_to(ROOT).as_posix()
        problems += [f"{rel}: {w}" for w in dict.fromkeys(wrong)]
        problems += [f"{rel}: install line without @ref: {m.group(0)!r}" for m in UNPINNED.finditer(fixed)]
        if write and fixed != text:
            path.write_text(fixed, encoding="utf-8")
    return problems


IMAGE_TYPES = (".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp")
URL = re.compile(r"https?://[^\s)\"'<>\]\\]+")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)|<img\b[^>]*\bsrc=[\"']([^\"']+)")  # markdown and HTML images


def url_problem(url: str, slug: str, ref: str, root: Path = ROOT) -> str:
    """Why ``url`` would not open what it names ("" if it would, or if it is not a link to this repository):
    a Colab link is colab.research.google.com/github/<slug>/blob/<ref>/<notebook> (without /blob/ Colab answers
    404), a Binder link mybinder.org/v2/gh/<slug>/<ref>?urlpath=lab/tree/<path>, a GitHub or raw link names a file
    (blob, raw) or folder (tree) of this checkout."""
    url = url.split("#", 1)[0].rstrip(".,;:")
    colab, binder = "https://colab.research.google.com/github/", "https://mybinder.org/v2/gh/"
    github, raw = f"https://github.com/{slug}", f"https://raw.githubusercontent.com/{slug}/{ref}/"
    if url.startswith(colab):
        m = re.fullmatch(rf"{re.escape(colab + slug)}/blob/{re.escape(ref)}/(\S+\.ipynb)", url)
        if not m:
            return f"not a Colab notebook link (expected {colab}{slug}/blob/{ref}/<notebook>.ipynb)"
        return "" if (root / m.group(1)).is_file() else f"no notebook {m.group(1)} in the repository"
    if url.startswith(binder):
        m = re.fullmatch(rf"{re.escape(binder + slug)}/{re.escape(ref)}(?:\?urlpath=lab(?:/tree/(\S+))?)?", url)
        if not m:
            return f"not a Binder link (expected {binder}{slug}/{ref}?urlpath=lab/tree/<path>)"
        return "" if not m.group(1) or (root / m.group(1)).exists() else f"no {m.group(1)} in the repository"
    if url.startswith(raw):
        path = url[len(raw) :]
        return "" if (root / path).is_file() else f"no file {path} in the repository"
    m = re.fullmatch(rf"{re.escape(github)}/(blob|tree)/{re.escape(ref)}/(\S+)", url)
    if m:
        kind, path = m.groups()
        ok = (root / path).is_file() if kind == "blob" else (root / path).is_dir()
        return "" if ok else f"no {'file' if kind == 'blob' else 'folder'} {path} in the repository"
    return ""


def image_problem(src: str, slug: str, ref: str, base: Path, root: Path = ROOT) -> str:
    """Why the image ``src`` (a markdown or HTML image's target, in a file in folder ``base``) would not show an
    image ("" if it would): a relative path must be an image file; a link to this repository must be its raw file
    (a github.com/.../blob/ link is an HTML page, not an image); any other URL must name an image file."""
    path = src.split("#", 1)[0].split("?", 1)[0]
    if not path.lower().endswith(IMAGE_TYPES):
        if path.startswith(f"https://github.com/{slug}/blob/"):
            return "a GitHub page, not an image: an image of the repository is its raw.githubusercontent.com file"
        return "not an image file"
    if "://" in path:
        if path.startswith(f"https://github.com/{slug}/blob/"):
            return "a GitHub page, not an image: an image of the repository is its raw.githubusercontent.com file"
        return url_problem(path, slug, ref, root)
    return "" if (base / path).is_file() else f"no image {path} beside the file"


def target_problems(text: str, where: str, base: Path, slug: str, ref: str, root: Path = ROOT) -> list[str]:
    """Each link to this repository in ``text`` (of the file ``where``, in folder ``base``) that would not open,
    and each image that would not show: "where: target: why"."""
    found = [(u, url_problem(u, slug, ref, root)) for u in URL.findall(text)]
    images = [m.group(1) or m.group(2) for m in IMAGE.finditer(text)]
    found += [(s, image_problem(s, slug, ref, base, root)) for s in images]
    return [f"{where}: {t}: {why}" for t, why in dict.fromkeys(found) if why]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite every link from [tool.course]")
    args = parser.parse_args(argv)
    slug, ref = course_config()
    problems = check(slug, ref, write=args.write)
    for p in problems:
        print(("fixed " if args.write else "") + p)
    if problems and not args.write:
        print(f"{len(problems)} links disagree with pyproject.toml's [tool.course] ({slug} @ {ref}); fix with --write")
        return 1
    print(f"all course links point at {slug} @ {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
