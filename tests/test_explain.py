"""explain: a recording of a plain training script in the course's terms (prediction/explain.py).

(a) a simulated snapshot of a tracked trace gives back the trace's phases and categories; (b) the shipped H200
snapshot gives back what was measured when it was recorded (first_steps.json) and what notebook 07 says of it;
(c) a CPU profile of a plain loop agrees with the tracker on the same steps (course GPT, a tiny Hugging Face model,
a small CNN); (d) bad input is refused naming the file, the CLI exits 2.
"""

import copy
import dataclasses
import gzip
import json
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from anatomy_helpers import make_model
from anatomy_helpers.cli.main import main
from anatomy_helpers.core.units import MiB
from anatomy_helpers.prediction import explain_read
from anatomy_helpers.prediction.cuda_rules import CUBLAS_WORKSPACE_SM90
from anatomy_helpers.prediction.explain import (
    EXPLAIN_CATEGORIES,
    UNCLASSIFIED,
    NoStepsError,
    cut_steps,
    explain,
    explain_events,
)
from anatomy_helpers.prediction.explain_read import (
    BWD,
    FWD,
    IDLE,
    OPT,
    RECOMPUTE,
    UNKNOWN,
    ZERO_GRAD,
    RecordingError,
    frame_label,
    snapshot_events,
)
from anatomy_helpers.prediction.snapshot import GPU_REFERENCE, snapshot_from_replay
from anatomy_helpers.tracking.profiler import quiet_profiler
from anatomy_helpers.tracking.tracker import StepTracker
from tests.conftest import SMALL, storage_bytes

TORCH = "/site-packages/torch/"


def frame(file, name):
    return {"filename": file, "name": name, "line": 1}


# ---- rules ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, expected",
    [
        ([], (UNKNOWN, 0)),
        ([frame("train.py", "main")], (IDLE, 0)),
        ([frame(TORCH + "nn/functional.py", "linear"), frame(TORCH + "nn/modules/module.py", "_call_impl")], (FWD, 0)),
        ([frame(TORCH + "_tensor.py", "backward"), frame("train.py", "main")], (BWD, 0)),
        ([frame("?", "torch::autograd::Engine::thread_main()")], (BWD, 0)),
        ([frame(TORCH + "optim/adam.py", "_multi_tensor_adam"), frame("train.py", "main")], (OPT, 0)),
        ([frame(TORCH + "optim/optimizer.py", "zero_grad")], (OPT, ZERO_GRAD)),
        (  # checkpointing's recomputation runs module code inside backward
            [frame(TORCH + "nn/modules/module.py", "_call_impl"), frame(TORCH + "utils/checkpoint.py", "unpack_hook")],
            (BWD, RECOMPUTE),
        ),
    ],
)
def test_frame_label(frames, expected):
    assert frame_label(frames) == expected


def test_steps_are_cut_at_each_forward_after_backward_and_data_loading_joins_its_step():
    labels = np.array([IDLE, FWD, IDLE, BWD, UNKNOWN, OPT, IDLE, IDLE, FWD, BWD, OPT, OPT], dtype=np.int8)
    step, phase = cut_steps(labels)
    assert step.tolist() == [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert phase.tolist() == [0, 1, 1, 2, 2, 3, 0, 0, 1, 2, 3, 3]  # idle, forward, backward, optimizer


# ---- (a) a simulated snapshot of a tracked trace ----------------------------------------------------------------


def sim_snapshot(trace):
    return snapshot_from_replay(trace.allocation_record(), trace=trace, phases=True)


def test_a_simulated_snapshot_gives_back_the_traces_phases_and_categories(small_trace, tmp_path):
    path = tmp_path / "sim.pickle"
    path.write_bytes(pickle.dumps(sim_snapshot(small_trace)))
    answer = explain(path, "t4")
    ex = explain_events(snapshot_events(pickle.loads(path.read_bytes()), str(path)))
    assert ex.trace.training_steps() == small_trace.training_steps() == [1, 2, 3]
    rows = {(r.step, r.phase): r for r in answer.phases}
    for ph in small_trace.phases():
        if ph.phase == "idle":
            continue
        row = rows[ph.step, ph.phase]
        assert row.peak == ph.peak.bytes  # the tracker's bytes, replayed as requested sizes
        moved = {c: row.breakdown[c] - ph.peak.breakdown.get(c, 0) for c in EXPLAIN_CATEGORIES}
        # Lifetimes cannot see one thing the tracker does: a 4-byte scalar made in forward and freed in backward
        # without autograd saving it (the tracker: temporaries; its lifetime: activations).
        assert all(abs(v) <= 4 for v in moved.values()) and sum(moved.values()) == 0, (ph.step, ph.phase, moved)
        assert row.breakdown[UNCLASSIFIED] == 0
    state_after_1 = small_trace.phase(1, "optimizer").at_end["optimizer_state"]
    assert [s.state_made for s in answer.steps] == [state_after_1, 0, 0]


def test_a_recording_whose_start_fell_out_of_the_ring_buffer_says_so(small_trace):
    snap = sim_snapshot(small_trace)
    trace = snap["device_traces"][0]
    first_fwd_2 = next(i for i, e in enumerate(trace) if e["frames"] and e["frames"][-1]["name"] == "step 2 forward")
    snap["device_traces"][0] = trace[first_fwd_2 - 40 :]  # as if max_entries had kept only the last events
    ex = explain_events(snapshot_events(snap, "cut"))
    assert any("ring buffer" in n for n in ex.events.notes)
    assert ex.trace.training_steps()[0] == 1  # the first whole step is numbered 1
    assert ex.trace.timeline.total.min() >= 0


# ---- (b) the shipped H200 snapshot ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h200():
    meta = json.loads(GPU_REFERENCE.with_suffix(".json").read_text())
    return explain(GPU_REFERENCE, "h200"), meta


def test_the_h200_snapshot_steps_and_reserved_memory_are_what_torch_measured(h200):
    answer, meta = h200
    assert [s.step for s in answer.steps] == [p["step"] for p in meta["peaks"]] == [1, 2, 3]
    for s, p in zip(answer.steps, meta["peaks"]):
        assert s.peak_phase == "backward"
        assert s.reserved_max == p["max_reserved"]  # torch.cuda.max_memory_reserved, recorded per step
        # the events record requested bytes; max_memory_allocated counts whole blocks (512-byte rounding and
        # large blocks left unsplit): a few MiB more, never less
        assert p["max_allocated"] - 4 * MiB <= s.peak <= p["max_allocated"]
    growth = [s.reserved_growth for s in answer.steps]
    assert growth[0] > growth[1] > 0 == growth[2]  # segments: most in step 1, some in step 2, none after


def test_the_h200_snapshot_categories(h200):
    answer, _ = h200
    model = make_model()  # the recorded model: make_model() defaults (first_steps.json)
    params = storage_bytes(model.parameters())
    buffers = storage_bytes(model.buffers())
    peak = answer.peak
    assert peak.breakdown["parameters"] == params + buffers  # alive before the recording began
    assert [s.state_made for s in answer.steps] == [2 * params, 0, 0]  # AdamW's two moments, made in step 1
    # notebook 07: "64 MiB of that are the two cuBLAS workspaces, 32 MiB each on this compute capability (9.0),
    # one for the forward's thread and one for autograd's backward thread"
    workspaces = {why: b for why, b in answer.unclassified_at_peak.items() if "cuBLAS workspace" in why}
    assert sorted(workspaces.values()) == [CUBLAS_WORKSPACE_SM90] * 2
    assert {"forward" in w for w in workspaces} == {True, False}
    assert answer.runs_out_first.step == 2 and answer.fits and answer.dominant == "activations"
    assert any(name.startswith("checkpoint") for name, _, _ in answer.levers)


# ---- (c) a CPU profile of a plain loop against the tracker ------------------------------------------------------


def plain_loop(model, opt, make_batch, loss_fn, steps=2):
    """A training loop with no course code in it."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = make_batch(gen)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def profiled_and_tracked(model, make_batch, loss_fn, tmp_path):
    """(explained profile, tracker trace) of two steps of the same loop on two copies of ``model``."""
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        plain_loop(model, opt, make_batch, loss_fn)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    opt2 = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    with StepTracker(twin, opt2) as tracker:
        plain_loop(twin, opt2, make_batch, loss_fn)
    return explain(tmp_path / "trace.json"), tracker.trace


# What the two may differ by, per phase peak (bytes): scalars of a few bytes that the tracker does not count or
# files elsewhere (Adam's step counters, saved scalars), and which moment of a flat stretch is the peak.
TOLERANCE = 1024


def agreement(answer, trace):
    """Per (step, phase): (tracker total minus what was alive before the recording, explained total, the largest
    per-category difference), temporaries and kernel scratch taken together (the profile has no kernel scratch)."""
    rows = {}
    before = sum(trace.baseline.values())
    for r in answer.phases:
        pk = trace.phase(r.step, r.phase).peak
        ours = dict(pk.breakdown, parameters=pk.breakdown["parameters"] - trace.baseline["parameters"])
        theirs = dict(r.breakdown)
        for d in (ours, theirs):
            d["temporaries"] += d.pop("kernel_scratch")
        diff = {c: theirs[c] - ours.get(c, 0) for c in theirs if theirs[c] != ours.get(c, 0)}
        rows[r.step, r.phase] = (pk.bytes - before, r.peak, diff)
    return rows


def course_gpt():
    return make_model(device="cpu", **SMALL), lambda g: (torch.randint(0, 59, (4, 32), generator=g),) * 2


def small_cnn():
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    return cnn, lambda g: (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))


def tiny_hf():
    pytest.importorskip("transformers")
    from anatomy_helpers.prediction.hf import build_model, hf_config, tiny_config

    torch.manual_seed(0)
    return build_model(
        tiny_config(hf_config("qwen2.5-0.5b"))
    ), lambda g: (torch.randint(0, 256, (2, 16), generator=g),) * 2


LOSSES = {
    "course GPT": (course_gpt, lambda m, x, y: m(x, y)[1]),
    "small CNN": (small_cnn, lambda m, x, y: nn.functional.cross_entropy(m(x), y)),
    "tiny Qwen2.5": (tiny_hf, lambda m, x, y: m(input_ids=x, labels=y).loss),
}
# Named differences beyond TOLERANCE: (model, category) -> why.
NAMED = {
    # convolution_backward's weight gradient is freed inside backward once AccumulateGrad has summed it into a new
    # .grad: by lifetime a temporary; the tracker (whose dispatch mode makes autograd sum out of place,
    # tracker.py) files the storage as the gradient
    ("small CNN", "gradients"): 32 * 16 * 9 * 4 + 32 * 4,
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_cpu_profile_of_a_plain_loop_agrees_with_the_tracker(name, tmp_path):
    build, loss_fn = LOSSES[name]
    model, make_batch = build()
    answer, trace = profiled_and_tracked(model, make_batch, loss_fn, tmp_path)
    assert [s.step for s in answer.steps] == trace.training_steps() == [1, 2]
    assert any("before profiling began" in n for n in answer.notes)  # the parameters are not in a CPU profile
    rows = agreement(answer, trace)
    for (s, ph), (ours, theirs, diff) in rows.items():
        assert abs(theirs - ours) <= TOLERANCE, (s, ph)
        for cat, d in diff.items():
            named = NAMED.get((name, cat)) or NAMED.get((name, "gradients" if cat == "temporaries" else cat))
            assert abs(d) <= TOLERANCE or (named is not None and abs(d) == named), (s, ph, cat, d)


# ---- (d) bad input ----------------------------------------------------------------------------------------------


def write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


class Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("empty.pickle", b"", "empty"),
        ("notes.txt", b"hello", "neither a memory snapshot"),
        ("list.pickle", pickle.dumps([1, 2, 3]), "not a memory snapshot"),
        ("code.pickle", pickle.dumps(Boom()), "holds no classes"),
        ("notrace.pickle", pickle.dumps({"segments": [], "device_traces": [[]]}), "without a trace"),
        (
            "half.pickle",
            pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}] * 50]})[:-30],
            "truncated",
        ),
        ("timeline.json", json.dumps([[1, 2], [[0] * 9] * 2]).encode(), "no phases"),
        ("other.json", b'{"a": 1}', "neither a chrome trace"),
        ("cut.json", b'{"traceEvents": [', "truncated"),
        (
            "nomem.json",
            json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1}]}).encode(),
            "profile_memory",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_file(tmp_path, name, data, message, capsys):
    path = write(tmp_path, name, data)
    with pytest.raises(RecordingError, match=message) as e:
        explain(path)
    assert str(path) in str(e.value)
    assert "this must never run" not in capsys.readouterr().out


def test_a_recording_without_a_training_step_is_refused(small_trace, tmp_path):
    snap = sim_snapshot(small_trace)
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if "forward" in e["frames"][-1]["name"]]
    path = write(tmp_path, "inference.pickle", pickle.dumps(snap))
    with pytest.raises(NoStepsError, match="no training step") as e:
        explain(path)
    assert str(path) in str(e.value)


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = write(tmp_path, "big.pickle", b"\x80" + bytes(4096))
    monkeypatch.setattr(explain_read, "MAX_FILE_BYTES", 1024)
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("read a file over the limit"))
    with pytest.raises(RecordingError, match="more than explain reads"):
        explain(path)


# ---- the CLI ----------------------------------------------------------------------------------------------------


def test_cli_explains_the_h200_snapshot_as_text_and_json(capsys):
    assert main(["explain", str(GPU_REFERENCE), "--device", "h200"]) == 0
    text = capsys.readouterr().out
    assert "step 1: peak" in text and "optimizer state" in text and "runs out first" in text
    assert main(["explain", str(GPU_REFERENCE), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in answer["steps"]] == [1, 2, 3] and answer["device"] == "T4"
    assert answer["runs_out_first"]["fits"] is True


def test_the_table_names_the_file_and_leaves_the_spans_out_on_request(h200):
    """A notebook compares the table from run to run: no wall-clock spans (times=False), no machine's path."""
    answer, _ = h200
    timed, plain = answer.table().splitlines(), answer.table(times=False).splitlines()
    assert timed[0] == plain[0] == f"CUDA memory snapshot: {GPU_REFERENCE.name}"
    assert "ms" in timed[1].split() and "ms" not in plain[1].split()
    rows = len(answer.phases)
    for t, p in zip(timed[3 : 3 + rows], plain[3 : 3 + rows]):  # each phase's row: the same but for its span
        assert t.split()[:2] + t.split()[3:] == p.split()
    assert timed[3 + rows :] == plain[3 + rows :]


@pytest.mark.parametrize("args, message", [(["nowhere.pickle"], "no such file"), (["--device", "x1"], "device")])
def test_cli_bad_input_exits_2_with_a_message_and_no_traceback(args, message, capsys):
    argv = ["explain", *(args if args[0] != "--device" else [str(GPU_REFERENCE), *args])]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


# ---- scripts/explain_check.py's checks, on the shipped real snapshot -----------------------------------------------


def load_script(name):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_checks_pass_on_the_h200_snapshot_and_catch_a_wrong_figure(h200):
    answer, meta = h200
    model = make_model()
    params = storage_bytes(model.parameters())
    meta = dict(meta, param_bytes=params)
    mine = dict(answer.peak.breakdown, parameters=params)  # the plain script's model has no buffers
    answer = dataclasses.replace(answer, peak=dataclasses.replace(answer.peak, breakdown=mine))
    explain_check = load_script("explain_check")
    assert explain_check.check(answer, meta) == []
    wrong = dict(meta, peaks=[dict(p, max_reserved=p["max_reserved"] + 512) for p in meta["peaks"]])
    assert len(explain_check.check(answer, wrong)) == 3
    assert explain_check.check(answer, dict(meta, param_bytes=params + 4))  # parameters and the state both differ


def test_the_figure_draws_the_categories_the_unclassified_bytes_and_reserved(h200):
    from anatomy_helpers.ui.explain_plot import plot_explained

    ex = explain_events(snapshot_events(pickle.loads(GPU_REFERENCE.read_bytes()), "h200"))
    ax = plot_explained(ex).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert {"parameters", "optimizer state", "activations", UNCLASSIFIED, "reserved"} <= set(labels)
    reserved = next(line for line in ax.get_lines() if line.get_label() == "reserved")
    assert reserved.get_ydata().max() == pytest.approx(ex.trace.timeline.cuda_reserved.max() / MiB)


def test_a_cuda_profile_by_hand_sum_before_unclassified_reserved_from_the_trace(tmp_path):
    """A chrome trace written by hand as torch.profiler writes one on a GPU: two steps; each memory event names its
    address, bytes and the allocator's totals (the first event's Total Allocated minus its Bytes: alive before)."""
    phases = (
        ("python_function", "nn.Module: Sequential_0", 10, 20),
        ("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 30, 40),
        ("user_annotation", "Optimizer.step#AdamW.step", 50, 60),
        ("user_annotation", "Optimizer.zero_grad#AdamW.zero_grad", 61, 62),
    )  # forward (a module), backward (autograd's ops), the optimizer's step, zero_grad
    ranges = [{"ph": "X", "cat": c, "name": n, "ts": t0 + a, "dur": b - a} for t0 in (0, 100) for c, n, a, b in phases]
    # the GPU's copy of step 1's optimizer range, run late on the device: it overlaps step 2's forward on the host
    ranges.append({"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 105, "dur": 20})
    before, mib = 5000, 2**20
    moves = [  # (time, address, bytes): + allocated, - freed
        (11, 1, 1000), (15, 2, 100), (16, 2, -100), (31, 1, -1000), (32, 3, 400),  # activation, temporary, gradient
        (51, 4, 800), (52, 5, 50), (53, 5, -50), (61.5, 3, -400),  # AdamW's state, a temporary, zero_grad
        (111, 6, 1000), (131, 6, -1000), (132, 7, 400), (152, 8, 50), (153, 8, -50), (161.5, 7, -400),
    ]  # fmt: skip
    total, memory = before, []
    for t, addr, nbytes in moves:
        total += nbytes
        reserved = 4 * mib if t > 50 else 2 * mib
        args = {"Addr": addr, "Bytes": nbytes, "Total Allocated": total, "Total Reserved": reserved, "Device Type": 1}
        memory.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": t, "args": args})
    path = write(tmp_path, "cuda.json", json.dumps({"traceEvents": ranges + memory}).encode())
    answer = explain(path)
    assert [(s.step, s.state_made, s.reserved_max) for s in answer.steps] == [(1, 800, 4 * mib), (2, 0, 4 * mib)]
    rows = {(r.step, r.phase): r for r in answer.phases}
    one = rows[1, "forward"].breakdown
    assert (one["activations"], one["temporaries"], one[UNCLASSIFIED]) == (1000, 100, before)
    opt = rows[1, "optimizer"].breakdown
    assert (opt["optimizer_state"], opt["gradients"], opt["temporaries"], opt["parameters"]) == (800, 400, 50, 0)
    assert rows[2, "forward"].peak == before + 800 + 1000
    assert any("a profile gives only their sum" in why for why in answer.unclassified_at_peak)
    gz = write(tmp_path, "cuda.json.gz", gzip.compress(path.read_bytes()))  # export_chrome_trace("....json.gz")
    assert explain(gz).to_dict()["phases"] == answer.to_dict()["phases"]


def test_the_explained_figure_draws_each_categorys_bytes_the_unclassified_rest_and_reserved():
    """Against the recording's own timeline: each category's layer, the unclassified band from the classified bytes
    up to every byte alive, and the reserved line, event by event."""
    from anatomy_helpers.prediction.explain import UNCLASSIFIED
    from anatomy_helpers.ui.explain_plot import plot_explained

    from .figure_data import areas, assert_stack_is_the_trace, bands, line, unit_bytes

    ex = explain_events(snapshot_events(pickle.loads(GPU_REFERENCE.read_bytes()), "h200"))
    ax = plot_explained(ex).axes[0]
    tl = ex.trace.timeline
    assert_stack_is_the_trace(ax, ex.trace, also=(UNCLASSIFIED, "reserved"))
    scale = unit_bytes(ax.get_ylabel())
    bottom, top = bands(areas(ax)[UNCLASSIFIED], np.arange(len(tl) - 1) + 0.5)
    np.testing.assert_allclose(bottom * scale, tl.bytes.sum(axis=1)[:-1], atol=1e-3)
    np.testing.assert_allclose(top * scale, tl.total[:-1], atol=1e-3)
    assert (tl.total > tl.bytes.sum(axis=1)).any()  # something is unclassified: the band is not empty
    np.testing.assert_allclose(line(ax, "reserved").get_ydata() * scale, tl.cuda_reserved)
