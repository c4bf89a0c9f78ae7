"""What a learner sees: figures (plots.py), slider panels (widgets.py) and prediction checks (exercises.py)."""
