"""Without transformers (and peft) installed: the package imports and works, and ``predict --hf`` says how to add
them. Simulated in a fresh process where importing either raises ImportError, as on a machine without them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WITHOUT_HF = """
import json, sys
sys.modules["transformers"] = None  # import transformers (and transformers.x) now raises ImportError
sys.modules["peft"] = None
import importlib, pkgutil
import anatomy_helpers
names = sorted(m.name for m in pkgutil.walk_packages(anatomy_helpers.__path__, "anatomy_helpers."))
for name in names:  # every module, the Hugging Face ones included (they import transformers only when called)
    if not name.endswith("__main__"):
        importlib.import_module(name)
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.hf import hf_config
peak = dry_run_config(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=64, batch_size=2).peak().bytes
try:
    hf_config("gpt2")
    hint = None
except ImportError as e:
    hint = str(e)
from anatomy_helpers.cli.main import main
try:
    main(["predict", "--hf", "gpt2", "--seq-len", "16"])
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps(dict(modules=len(names), peak=peak, hint=hint, code=code, loaded="transformers" in sys.modules
    and sys.modules["transformers"] is not None)))
"""


def test_without_transformers_the_package_works_and_predict_hf_says_how_to_install_it():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", WITHOUT_HF], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["modules"] > 40 and r["peak"] > 0 and not r["loaded"]
    install = 'pip install "anatomy_helpers[hf]"'
    assert install in r["hint"]
    assert r["code"] == 2 and f"--hf gpt2: {r['hint']}" in out.stderr  # argparse's error: usage, then the message
