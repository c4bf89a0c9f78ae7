"""One module per notebook: what only that lesson uses (its own tables, figures and slider panels).

``forward`` is notebook 01, ``backward`` 02, ``optimizer`` 03, ``first_step`` 04. A helper that a second
lesson needs moves to the core package (see CONTRIBUTING.md).
"""
