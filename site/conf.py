"""Sphinx configuration of the course site (``python scripts/site.py build``).

The pages are the executed notebooks as committed (MyST-NB with execution off: the site shows what CI checked) and
the docs; scripts/site.py stages them into a folder beside this file's copy and runs Sphinx there.
"""

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
    "use_download_button": False,
}
html_show_sourcelink = False
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # the slider panels' widget views: replaced by a note
