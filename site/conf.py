"""Sphinx configuration of the course site (``python scripts/site.py build``).

The pages are the executed notebooks as committed (MyST-NB with execution off: the site shows what CI checked) and
the docs; scripts/site.py stages them into a folder beside this file's copy and runs Sphinx there, with
``course.json`` (the repository's slug and branch from pyproject's [tool.course], the package version, the last
commit's date) beside it.
"""

import json
from pathlib import Path

course = json.loads((Path(__file__).parent / "course.json").read_text(encoding="utf-8"))

project = "Training Step Anatomy"
author = "the Training Step Anatomy maintainers"
copyright = "the Training Step Anatomy maintainers, MIT licence"

extensions = ["myst_nb"]
nb_execution_mode = "off"  # never re-execute: the committed outputs are the ones nbval compares
nb_merge_streams = True  # one block per cell for its printed lines
myst_enable_extensions = ["dollarmath", "amsmath"]  # $...$ and $$...$$ rendered by MathJax
myst_heading_anchors = 3  # links to "page.md#a-heading" resolve

html_theme = "sphinx_book_theme"
html_title = project
html_theme_options = {
    "show_navbar_depth": 1,
    "show_prev_next": True,  # "previous" / "next" at the bottom of each lesson
    # the header's buttons: the repository, an issue, the page's notebook to download, and launching it; the lesson
    # pages are staged as learner/NN_topic.ipynb, so Colab and Binder open the learner copy of the same path
    "repository_url": f"https://github.com/{course['slug']}",
    "repository_branch": course["ref"],
    "path_to_docs": "",
    "use_repository_button": True,
    "use_issues_button": True,
    "use_download_button": True,
    "launch_buttons": {
        "colab_url": "https://colab.research.google.com",
        "binderhub_url": "https://mybinder.org",
        "notebook_interface": "jupyterlab",
    },
    "extra_footer": f"Training Step Anatomy {course['version']}, last updated {course['updated']}",
}
# one search box: the header's (the theme's default sidebar holds a second one)
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
html_static_path = ["_static"]
html_css_files = ["course.css"]  # wide outputs and tables scroll inside their own box
version = release = course["version"]
html_show_sourcelink = False
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # the slider panels' widget views: replaced by a note
