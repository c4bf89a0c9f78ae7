"""The course GPT's predictions dry-run depths 3, 4 and 5 and extend them (prediction/periodic.py): every number
of a FitReport and of a lever's Fix equals the full-depth dry run's, and the report and the CLI say which dry
run answered."""

import dataclasses
import json

import pytest

from anatomy_helpers.cli.main import main
from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.prediction import fit
from anatomy_helpers.prediction.devices import Device
from anatomy_helpers.prediction.fit import FULL_DRY_RUN_ENV, FitRequest, dry_run_text, will_it_fit
from anatomy_helpers.prediction.levers import levers, try_levers

# deep enough for the period (more than 5 blocks), small enough that each dry run takes a fraction of a second
DEEP = dict(n_layer=8, d_model=32, n_head=2, seq_len=16, vocab_size=128)
EXTENDED = "depths 3, 4, 5, extended to 8 blocks (exact: the same bytes as a full dry run)"
TINY_ARGS = ["--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab", "128", "--batch-size", "2"]


def numbers(report):
    """Everything a report says but which dry run answered."""
    return dataclasses.replace(report, dry_run="")


def full_depth(monkeypatch, call):
    """``call()`` with the full-depth dry run forced."""
    with monkeypatch.context() as m:
        m.setenv(FULL_DRY_RUN_ENV, "1")
        return call()


@pytest.fixture(scope="module")
def roomy():
    """will_it_fit's report of DEEP at batch 2 on a device of unbounded size (the sizes the other tests cut)."""
    return will_it_fit(ModelConfig(**DEEP), 2, device=2**40)


@pytest.mark.parametrize(
    "fields, options",
    [
        # CUDA's rules (cuBLAS workspaces, dropout masks, autocast's softmax) on the extended trace
        (dict(checkpoint="selective"), dict(device="h100")),
        (dict(dropout=0.1), dict(device="t4", implementation="single", autocast="float16", in_backward=True)),
        (dict(checkpoint="full", attn_impl="sdpa"), dict(optimizer="sgd", implementation="fused", micro_batches=2)),
    ],
    ids=["h100-selective", "t4-dropout-fp16-in-backward", "size-sdpa-full-sgd-fused-accumulated"],
)
@pytest.mark.parametrize("cap", ["fits", "runs out"])
def test_will_it_fit_equals_the_full_dry_runs_report(fields, options, cap, monkeypatch):
    cfg = ModelConfig(**DEEP, **fields)
    options = {"device": 2**40, **options}  # a size (CPU kernels' rules) unless a GPU is named
    if cap == "runs out":  # the same device cut to half its reserved peak: the capped allocator runs out in the step
        dev = fit.get_device(options["device"])
        reserved = max(p.reserved for p in will_it_fit(cfg, 2, **options).phases)
        options["device"] = Device(f"{dev.name}, cut", dev.context + reserved // 2, dev.capability)
    fast = will_it_fit(cfg, 2, **options)
    full = full_depth(monkeypatch, lambda: will_it_fit(cfg, 2, **options))
    assert fast.fits == (cap == "fits")
    assert fast.dry_run == dry_run_text(8, None) == EXTENDED
    assert full.dry_run == f"full depth ({FULL_DRY_RUN_ENV}=1 asks for it)"
    assert numbers(fast) == numbers(full)  # peaks, per-phase needs and breakdowns, verdict, where it ran out
    assert fast.table() == full.table() and fast.verdict() == full.verdict()


def test_levers_reports_equal_the_full_dry_runs(roomy, monkeypatch):
    """Levers the reports above do not take (the attention checkpointed, the chunked loss, bf16 optimizer state),
    tried as cheapest_fix tries them (try_levers), give the same Fixes from the extended dry runs."""
    cfg = ModelConfig(**DEEP)
    tight = Device("cut", fit.get_device(2**40).context + max(p.reserved for p in roomy.phases) * 3 // 4)
    request = FitRequest(cfg, 2, device=tight)
    names = ("checkpoint=attention", "chunked loss (4 tokens)", "bf16 optimizer state")  # the catalogue's order
    chosen = [lever for lever in levers(cfg, batch_size=2, device=tight) if lever.name in names]
    fast = try_levers(request, tight, chosen)
    full = full_depth(monkeypatch, lambda: try_levers(request, tight, chosen))
    assert [f.name for f in fast] == list(names)
    assert all(f.report.dry_run == EXTENDED for f in fast)
    assert [dataclasses.replace(f, report=numbers(f.report)) for f in fast] == [
        dataclasses.replace(f, report=numbers(f.report)) for f in full
    ]


@pytest.mark.parametrize(
    "fields, why",
    [
        (dict(n_layer=5), "n_layer 5 is at most 5, the deepest run the period is read from"),
        (dict(checkpoint="every_k", checkpoint_every=2), "checkpoint every_k with checkpoint_every 2 > 1 groups"),
    ],
)
def test_the_report_says_why_the_dry_run_ran_at_full_depth(fields, why):
    report = will_it_fit(ModelConfig(**{**DEEP, **fields}), 2, device="h100")
    assert report.dry_run.startswith(f"full depth ({why}")


def test_a_bad_full_dry_run_setting_is_refused_before_any_dry_run(monkeypatch):
    monkeypatch.setenv(FULL_DRY_RUN_ENV, "yes")
    monkeypatch.setattr(fit, "_dry_run", lambda *a, **k: pytest.fail("dry-ran a refused request"))
    with pytest.raises(ValueError, match=f"{FULL_DRY_RUN_ENV} must be 0 or 1"):
        will_it_fit(ModelConfig(**DEEP), 2)


def test_predict_prints_which_dry_run_answered(capsys):
    assert main(["predict", "--layers", "8", *TINY_ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"dry run: {EXTENDED}"
    assert main(["predict", "--layers", "2", *TINY_ARGS, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["dry_run"] == "full depth (n_layer 2 is at most 5, the deepest run the period is read from)"
