"""torch.profiler's view next to the tracker: the core readers (anatomy_helpers.tracking.profiler) and lesson 07's
helpers."""

import importlib.util
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from anatomy_helpers import load_text, make_model, make_optimizer, track_steps
from anatomy_helpers.lessons.lesson07_profiling import (
    check_answer,
    event_counts,
    format_step_peaks,
    format_top_ops,
    in_one_op_rows,
    load_gpu_reference,
    memory_viz_html,
    op_count_changes,
    phase_ops,
    profile_steps,
    scratch_rows,
    step_peaks,
    step_time_table,
    top_ops,
    unknown_split,
)
from anatomy_helpers.tracking.events import CATEGORIES, PHASES
from anatomy_helpers.tracking.profiler import (
    COURSE_CATEGORY,
    PROFILER_CATEGORIES,
    PhaseSpan,
    ProfilerTimeline,
    load_memory_timeline,
    profiler_trace,
    quiet_profiler,
    sample_phases,
)

from .conftest import SMALL, THREADS

ROOT = Path(__file__).resolve().parent.parent


# ---- the memory timeline JSON ----------------------------------------------------------------------------------


def test_profiler_categories_are_torchs_columns_in_order():
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = [None] * len(_CATEGORY_TO_INDEX)
    for cat, i in _CATEGORY_TO_INDEX.items():
        names[i] = "UNKNOWN" if cat is None else cat.name
    assert tuple(names) == PROFILER_CATEGORIES


def test_every_profiler_category_is_drawn_as_a_course_category():
    assert set(COURSE_CATEGORY) == set(PROFILER_CATEGORIES)
    assert set(COURSE_CATEGORY.values()) <= set(CATEGORIES)
    # a tensor born and freed inside one op is the course's kernel scratch, where the tracker has that category
    assert COURSE_CATEGORY["TEMPORARY"] == ("kernel_scratch" if "kernel_scratch" in CATEGORIES else "temporaries")
    assert COURSE_CATEGORY["AUTOGRAD_DETAIL"] == "temporaries"


def _write_timeline(path, times, rows):
    path.write_text(json.dumps([times, [[0, *r] for r in rows]]))
    return path


def test_load_memory_timeline_names_the_columns(tmp_path):
    rows = [[100, 0, 8, 0, 0, 0, 0, 0], [100, 0, 8, 4, 50, 0, 0, 0], [100, 200, 8, 0, 50, 30, 7, 3]]
    tl = load_memory_timeline(_write_timeline(tmp_path / "t.json", [10, 11, 15], rows))
    assert len(tl) == 3 and tl.time_us.tolist() == [10, 11, 15]
    assert tl.total.tolist() == [sum(r) for r in rows]
    assert tl.category("ACTIVATION").tolist() == [0, 50, 50]
    assert tl.at(2) == dict(zip(PROFILER_CATEGORIES, rows[2]))
    course = tl.course_bytes()
    assert course.shape == (3, len(CATEGORIES)) and course.sum(axis=1).tolist() == tl.total.tolist()
    expected = dict.fromkeys(CATEGORIES, 0)  # the last row, summed by hand through the mapping
    for name, b in zip(PROFILER_CATEGORIES, rows[2]):
        expected[COURSE_CATEGORY[name]] += b
    assert dict(zip(CATEGORIES, course[2].tolist())) == expected
    with pytest.raises(ValueError, match="category must be one of"):
        tl.category("activations")


def test_load_memory_timeline_refuses_another_layout(tmp_path):
    short = tmp_path / "short.json"
    short.write_text(json.dumps([[1], [[0, 1, 2, 3]]]))
    with pytest.raises(ValueError, match="expected rows of 0 followed by 8 categories"):
        load_memory_timeline(short)
    shifted = tmp_path / "shifted.json"
    shifted.write_text(json.dumps([[1], [[5, 0, 0, 0, 0, 0, 0, 0, 0]]]))
    with pytest.raises(ValueError, match="expected rows"):
        load_memory_timeline(shifted)
    with pytest.raises(ValueError, match="bytes must be"):
        ProfilerTimeline(np.array([1, 2]), np.zeros((2, 3), dtype=np.int64))


# ---- phases ----------------------------------------------------------------------------------------------------

SPANS = [
    PhaseSpan(1, "forward", 10, 20),
    PhaseSpan(1, "backward", 21, 30),
    PhaseSpan(1, "optimizer", 31, 35),
    PhaseSpan(2, "forward", 40, 50),
    PhaseSpan(2, "backward", 51, 60),
    PhaseSpan(2, "optimizer", 61, 65),
]


def test_sample_phases_inside_between_and_outside_the_spans():
    step, phase = sample_phases(np.array([5, 10, 20, 20.5, 36, 45, 65, 99]), SPANS)
    assert step.tolist() == [1, 1, 1, 1, 1, 2, 2, 2]
    assert [PHASES[p] for p in phase] == ["idle", "forward", "forward", "idle", "idle", "forward", "optimizer", "idle"]
    with pytest.raises(ValueError, match="record_function"):
        sample_phases(np.array([1.0]), [])


def test_profiler_trace_answers_the_trace_queries(tmp_path):
    times = [5, 12, 25, 33, 36, 45, 55, 62]
    act = [0, 40, 10, 0, 0, 40, 10, 0]
    grads = [0, 0, 20, 20, 0, 0, 20, 20]
    state = [0, 0, 0, 30, 30, 30, 30, 30]
    rows = [[100, s, 0, 0, a, g, 0, 0] for a, g, s in zip(act, grads, state)]
    tl = load_memory_timeline(_write_timeline(tmp_path / "t.json", times, rows))
    tr = profiler_trace(tl, SPANS)
    assert tr.training_steps() == [1, 2]
    assert tr.peak(step=1).bytes == 150 and tr.peak(step=1).phase == "optimizer"
    assert tr.peak(step=2).bytes == 170 and tr.peak(step=2).phase == "forward"
    assert tr.phase(2, "backward").start == tr.phase(2, "backward").end == 6
    assert tr.at(6)["gradients"] == 20 and tr.at(6)["activations"] == 10
    assert [(p.step, p.phase) for p in tr.phases() if p.phase != "idle"] == [
        (1, "forward"),
        (1, "backward"),
        (1, "optimizer"),
        (2, "forward"),
        (2, "backward"),
        (2, "optimizer"),
    ]
    assert tr.timeline.time_s[-1] == pytest.approx(57e-6) and tr.duration_s == pytest.approx(57e-6)


def test_step_time_table_adds_up_each_step():
    text = step_time_table(SPANS)
    assert "ms of wall time" in text
    step1 = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    assert step1.split()[-1] == f"{(10 + 9 + 4) / 1e3:.0f}"  # 23 us: 0 ms


# ---- the quiet profiler ------------------------------------------------------------------------------------------


def test_quiet_profiler_drops_the_chatter_and_keeps_other_lines(capfd):
    with quiet_profiler():
        os.write(2, b"USDT:2026-12-02 14:41:59 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error\n")
        os.write(2, b"USDT:2026-12-02 14:42:13 1:1 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
        os.write(2, b"ERROR:2026-12-04 16:46:11 1:1 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"ERROR:2026-12-04 16:46:11 1:1 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 2\n")
    assert capfd.readouterr().err == (
        "a real error\nERROR:2026-12-04 16:46:11 1:1 DeviceProperties.cpp:48] gpuGetDeviceCount failed with code 2\n"
    )


def test_quiet_profiler_hides_the_one_cycle_warning_and_no_other():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_profiler():  # torch 2.11's words, on every scheduled profile
            warnings.warn("Warning: Profiler clears events at the end of each cycle.", UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_quiet_profiler_around_a_real_profile(capfd):
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(4) + 1
    assert "profiler_start" not in capfd.readouterr().err


# ---- a profiled run of the small model next to the tracker --------------------------------------------------------


@pytest.fixture(scope="module")
def profiled():
    """(profiled run, tracker trace, model) for two AdamW steps of the SMALL model, batch 4, built the same way."""
    torch.set_num_threads(THREADS)  # module fixtures run before the autouse one: the same threads as the tests
    model = make_model(device="cpu", **SMALL)
    run = profile_steps(model, make_optimizer(model, "adamw"), steps=2, batch_size=4)
    twin = make_model(device="cpu", **SMALL)
    return run, track_steps(twin, make_optimizer(twin, "adamw"), steps=2, batch_size=4), model


def test_profile_steps_labels_every_phase_of_every_step(profiled):
    run, _, _ = profiled
    assert [(s.step, s.phase) for s in run.spans] == [
        (k, p) for k in (1, 2) for p in ("forward", "backward", "optimizer")
    ]
    assert all(s.end_us > s.start_us for s in run.spans)
    assert run.trace.training_steps() == [1, 2]


def test_profiler_and_tracker_peaks_differ_by_what_only_the_profiler_sees(profiled):
    run, trace, _ = profiled
    pairs = step_peaks(trace, run.trace)
    text_ids = 8 * len(load_text())  # get_batch keeps the whole text as int64 token ids
    for p in pairs:  # ... and a few scalars made outside any op (8 bytes each), which only the profiler sees
        assert 0 <= p.profiler - p.tracker - text_ids < 1024
        assert p.profiler_phase == p.tracker_phase
    assert pairs[1].tracker > pairs[0].tracker  # step 2 carries the optimizer state
    assert "+" in format_step_peaks(pairs)


def test_optimizer_state_and_gradients_agree_exactly(profiled):
    run, trace, _ = profiled
    at_t = trace.peak(step=2).breakdown
    at_p = run.timeline.at(run.trace.peak(step=2).index)
    assert at_p["OPTIMIZER_STATE"] == at_t["optimizer_state"] > 0
    assert at_p["GRADIENT"] == at_t["gradients"]


def test_backward_temporaries_are_the_profilers_autograd_detail(profiled):
    run, trace, _ = profiled
    rows = {(r.step, r.phase): r for r in scratch_rows(trace, run.trace, run.timeline)}
    assert set(rows) == {(s, p) for s in (1, 2) for p in ("forward", "backward", "optimizer")}
    for s in (1, 2):
        r = rows[s, "backward"]
        assert abs(r.tracker - r.profiler) <= 1024 and r.profiler_by_category["AUTOGRAD_DETAIL"] > 0


def test_ops_per_phase(profiled):
    run, _, model = profiled
    ops = phase_ops(run.prof, run.spans)
    assert {r.phase for r in ops} == {"forward", "backward", "optimizer"} and {r.step for r in ops} == {1, 2}
    top = top_ops(ops, "backward", step=2, n=3)
    assert [r.self_bytes for r in top] == sorted((r.self_bytes for r in top), reverse=True)
    summed = top_ops(ops, "forward", n=1)[0]  # over both steps: twice step 2's (forward is the same in both)
    one = next(r for r in top_ops(ops, "forward", step=2, n=50) if r.name == summed.name)
    assert summed.calls == 2 * one.calls and summed.self_bytes == 2 * one.self_bytes
    n_tensors = len(list(model.parameters()))
    assert op_count_changes(ops, "optimizer", 1, 2)["aten::zeros_like"] == (2 * n_tensors, 0)
    assert op_count_changes(ops, "forward", 1, 2) == {}
    assert "self MiB" in format_top_ops(top) and "self ms" in format_top_ops(top, time=True)
    with pytest.raises(ValueError, match="by must be"):
        top_ops(ops, "forward", by="calls")


def test_event_counts_per_step(profiled):
    run, _, model = profiled
    n_tensors = len(list(model.parameters()))
    assert event_counts(run.prof, run.spans, "aten::zeros_like") == {1: 2 * n_tensors, 2: 0}
    assert event_counts(run.prof, run.spans, "no such event") == {1: 0, 2: 0}


def test_unknown_split_and_what_lives_inside_one_op(profiled):
    run, trace, _ = profiled
    unknown = unknown_split(run.prof, run.spans)
    assert {(u.step, u.phase) for u in unknown} == {
        (s, p) for s in (1, 2) for p in ("forward", "backward", "optimizer")
    }
    assert all(u.tensors >= 0 and u.no_tensor >= 0 for u in unknown)
    rows = in_one_op_rows(trace, run.trace, run.timeline, unknown)
    assert len(rows) == 6
    has_scratch = "kernel_scratch" in CATEGORIES
    assert all((r.tracker_kernel_scratch is None) != has_scratch for r in rows)


# ---- snapshots and answers ---------------------------------------------------------------------------------------


def test_memory_viz_html_embeds_the_viewer_under_its_label():
    snapshot = {"segments": [], "device_traces": [[]]}
    page = memory_viz_html(snapshot, "SIMULATED <snapshot>").data
    assert page.startswith("<p><b>SIMULATED &lt;snapshot&gt;</b></p><iframe srcdoc=")
    assert "MemoryViz.js" in page and "<script" not in page.split("srcdoc=")[1].split('"')[1]  # escaped inside


def test_load_gpu_reference(tmp_path):
    path = tmp_path / "first_steps.pickle"
    assert load_gpu_reference(path) is None
    snap = {"segments": [], "device_traces": [[]]}
    path.write_bytes(pickle.dumps(snap))
    assert load_gpu_reference(path) == (snap, {})
    path.with_suffix(".json").write_text(json.dumps({"gpu": "X", "steps": 3}))
    assert load_gpu_reference(path) == (snap, {"gpu": "X", "steps": 3})


def test_check_answer_does_not_reveal_without_an_answer(capsys):
    assert check_answer("phase", None, "backward") is None
    assert "backward" not in capsys.readouterr().out
    assert check_answer("phase", "backward", "backward") is True
    assert check_answer("phase", "forward", "backward") is False
    assert "look again" in capsys.readouterr().out


# ---- scripts/record_gpu_reference.py -----------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("record_gpu_reference", ROOT / "scripts" / "record_gpu_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_record_gpu_reference_refuses_without_cuda(tmp_path, capsys):
    out = tmp_path / "ref" / "first_steps.pickle"
    assert _script().main(["--out", str(out)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.parent.exists()


def test_record_gpu_reference_trims_stacks():
    frames = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(5)]
    snap = {
        "segments": [{"blocks": [{"size": 1, "frames": list(frames)}, {"size": 2, "state": "inactive"}]}],
        "device_traces": [[{"action": "alloc", "frames": list(frames)}]],
    }
    trimmed = _script().trim_frames(snap, 2)
    assert trimmed["segments"][0]["blocks"][0]["frames"] == frames[:2]
    assert trimmed["device_traces"][0][0]["frames"] == frames[:2]


def test_op_averages_leaves_out_python_frames_such_as_a_background_threads_wait():
    """with_stack=True turns Python functions into rows; a thread that only waits (a notebook kernel's select or
    sleep) would top the table by self CPU time. op_averages keeps the ops and the ranges, and the table prints."""
    import threading
    import time

    from torch.profiler import ProfilerActivity, profile

    from anatomy_helpers.lessons.lesson07_profiling import op_averages

    def wait():
        time.sleep(0.05)

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        waiter = threading.Thread(target=wait)
        waiter.start()
        (a @ a).sum()
        waiter.join()
    every = [e.key for e in prof.key_averages()]
    kept = op_averages(prof)
    assert any("sleep" in k or ".py(" in k for k in every)  # the frames are there to leave out
    assert "aten::mm" in [e.key for e in kept]
    assert not any(".py(" in e.key or e.key.startswith("<built-in") for e in kept)
    assert {e.key for e in kept} == {k for k in every if ".py(" not in k and not k.startswith("<built-in")}
    assert "aten::mm" in kept.table(sort_by="self_cpu_time_total", row_limit=5)
    assert "Self CPU Mem" in kept.table(sort_by="self_cpu_memory_usage", row_limit=5)  # memory columns kept
    shaped = op_averages(prof, group_by_input_shape=True)
    assert "aten::mm" in {e.key for e in shaped} and not any(".py(" in e.key for e in shaped)
