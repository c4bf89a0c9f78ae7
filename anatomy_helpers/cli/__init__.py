"""The command line: ``python -m anatomy_helpers predict ...`` (main.py), its Hugging Face path (hf.py) and
the options both share (common.py)."""
