"""torch.compile'd code is refused by the tracker and the dry run (tracking/compiled.py), never measured as eager.

Before the refusal, a dry run of a compiled model in a fresh process died of a segmentation fault inside inductor's
code (Dynamo compiled the tracker's __torch_dispatch__ on fake tensors), and a tracked compiled step reported the
eager step's memory while Dynamo recompiled __torch_dispatch__ up to its limit. The dry runs run in a subprocess, so
a crash fails the test instead of killing pytest.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from anatomy_helpers.prediction.dryrun import DryRunError, dry_run
from anatomy_helpers.tracking.compiled import CompiledCodeError, compiled_modules
from anatomy_helpers.tracking.tracker import StepTracker

ROOT = Path(__file__).resolve().parent.parent

# The model: an embedding, a linear, ten pointwise ops, a linear; `how` compiles it (or a part of it).
MODEL = """
import json, sys, torch, torch.nn as nn
BACKEND, HOWS = sys.argv[1], sys.argv[2:]

def pointwise(h):
    for _ in range(10):
        h = torch.sin(h) * 1.01
    return h

compiled_pointwise = torch.compile(pointwise, backend=BACKEND)

class Net(nn.Module):
    def __init__(self, function=pointwise):
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(100, 64), nn.Linear(64, 256), nn.Linear(256, 100)
        self.function = function

    def forward(self, x):
        return self.l2(self.function(self.l1(self.emb(x))))

def build(how):
    if how == "compiled_function":
        return Net(compiled_pointwise)
    net = Net()
    if how == "torch.compile(model)":
        return torch.compile(net, backend=BACKEND)
    if how == "model.compile()":
        net.compile(backend=BACKEND)
    elif how == "torch.compile(submodule)":
        net.l1 = torch.compile(net.l1, backend=BACKEND)
    return net

def batch(step):
    return torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long)

def loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
"""

HOWS = ["torch.compile(model)", "model.compile()", "torch.compile(submodule)", "compiled_function"]
NAMED = {  # what the refusal names
    "torch.compile(model)": "the model (Net, by torch.compile(module))",
    "model.compile()": "the model (Net, by module.compile())",
    "torch.compile(submodule)": "l1 (Linear, by torch.compile(module))",
    "compiled_function": "function pointwise (",
}


def run_fresh(code: str, backend: str) -> subprocess.CompletedProcess:
    """``code`` after MODEL in a fresh Python, compiling with ``backend``."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-c", MODEL + code, backend, *HOWS]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_a_dry_run_of_compiled_code_in_a_fresh_process_is_refused_naming_it():
    code = """
from anatomy_helpers.prediction.dryrun import DryRunError, dry_run
out = {}
for how in HOWS:
    try:
        dry_run(lambda: build(how), batch, loss)
        out[how] = "accepted"
    except DryRunError as e:
        out[how] = str(e)
print(json.dumps(out))
"""
    done = run_fresh(code, "inductor")  # the default backend, whose code crashed
    assert done.returncode == 0, done.stderr[-3000:]  # -11 was the segmentation fault
    out = json.loads(done.stdout.splitlines()[-1])
    for how in HOWS:
        assert out[how].startswith(NAMED[how]), (how, out[how])
        assert "fake tensors follow the eager kernels" in out[how]
    assert "recompile" not in done.stderr


def test_a_tracked_step_refuses_a_compiled_model_and_a_compiled_function_it_calls():
    """The tracker: a compiled model when it is made, a compiled function when the step calls it (real tensors,
    after real compiled steps, so Dynamo's cache holds the function); no recompiling of __torch_dispatch__."""
    code = """
from anatomy_helpers.tracking.compiled import CompiledCodeError
from anatomy_helpers.tracking.tracker import StepTracker
out = {}
for how in HOWS:
    torch.manual_seed(0)
    model = build(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def step():
        loss(model, batch(0)).backward()
        opt.step()
        opt.zero_grad()
    step()  # compiled for real first
    try:
        with StepTracker(model, opt, kernel_scratch=False):
            step()
        out[how] = "accepted"
    except CompiledCodeError as e:
        out[how] = str(e)
print(json.dumps(out))
"""
    done = run_fresh(code, "eager")  # Dynamo's cache and guards are the backend's whatever it is; eager is quick
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    for how in HOWS:
        assert out[how].startswith(NAMED[how]), (how, out[how])
        assert "not the fused kernels torch.compile makes" in out[how]
    assert "recompile" not in done.stderr


class Small(nn.Module):
    def __init__(self, function=torch.tanh):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.function = function

    def forward(self, x):
        return self.function(self.lin(x))


def test_compiled_modules_names_each_compiled_module_and_nothing_else():
    plain = nn.Sequential(Small(), Small())
    assert compiled_modules(plain) == []
    plain[1].lin.compile()
    assert compiled_modules(plain) == ["1.lin (Linear, by module.compile())"]
    assert compiled_modules(torch.compile(Small(), backend="eager")) == ["the model (Small, by torch.compile(module))"]


def test_the_tracker_leaves_compiling_as_it_found_it():
    """Outside the tracker's block a compiled function compiles and runs again (the refusal is undone), also after
    a block that was refused."""

    def doubled_tanh(t):
        return torch.tanh(t) * 2

    compiled = torch.compile(doubled_tanh, backend="eager")
    model = Small(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CompiledCodeError, match=r"^function doubled_tanh \(.*not the fused kernels"):
        with StepTracker(model, opt, kernel_scratch=False):
            model(torch.ones(2, 4)).sum().backward()
    x = torch.randn(3)
    assert torch.equal(compiled(x), doubled_tanh(x))


def test_a_dry_run_refuses_a_compiled_model_before_it_runs_anything():
    ran = []

    def loss(model, batch):
        ran.append(True)
        return model(batch[0]).sum()

    with pytest.raises(DryRunError, match=r"^the model \(Small, by torch.compile\(module\)\).*eager kernels"):
        dry_run(lambda: torch.compile(Small(), backend="eager"), lambda step: (torch.zeros(2, 4),), loss)
    assert ran == []
