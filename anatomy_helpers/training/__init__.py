"""One training step (step.py), the optimizers and the loops that run it (train.py), and a memory
budget on CPU (budget.py)."""
