"""periodic_dry_run_hf_rank: one rank of a Hugging Face fine-tune under ZeRO stage 0-3, built from dry runs of that
rank at 3, 4 and 5 layers, equals the rank's full-depth dry run byte for byte; where the rank's step may not repeat
layer by layer (ZeRO-1's partition, a DDP bucket that grows past torch's smallest cap) or the layers differ, it
makes the full dry run and says why; will_it_fit_hf per rank says which dry run answered."""

import functools

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.distributed import hf_rank_period  # noqa: E402
from anatomy_helpers.distributed.hf_fit import dry_run_hf_rank, periodic_dry_run_hf_rank, will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.fit import dry_run_text  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune  # noqa: E402
from anatomy_helpers.prediction.periodic import trace_differences  # noqa: E402

FULL = FineTune(dtype="bfloat16", batch_size=1)  # bf16 weights: the tiny Llama's DDP bucket stays under 1 MiB
LORA = FineTune(method="lora", dtype="bfloat16", lora_rank=4, batch_size=1)

# (model, depth, fine-tune, world size, ZeRO stage, rank): one case per stage, first and last ranks, LoRA and full.
# Both tiny twins keep their grouped-query attention (hf.tiny_config), Qwen its q/k/v biases. World size 3 pads
# FSDP2's shards (head width 8, 256 tokens: dims not divisible by 3). ZeRO-1 at 64 ranks: rank 0 is given the same
# parameters at every depth; at 2 or 3 ranks its partition moves with the depth (refused below).
CASES = [
    ("qwen2.5-0.5b", 7, LORA, 3, 0, 2),
    ("llama-3.2-1b", 7, LORA, 64, 1, 0),
    ("llama-3.2-1b", 6, FULL, 2, 2, 1),
    ("qwen2.5-0.5b", 6, FULL, 3, 3, 0),
]


@functools.cache
def runs(name, depth, ft, world_size, zero, rank):
    """(the config, the periodic path's Trace and why, the full dry run's Trace) of one case, made once."""
    cfg = tiny_config(name, layers=depth)
    fast, why = periodic_dry_run_hf_rank(cfg, ft, world_size, zero, rank)
    return cfg, fast, why, dry_run_hf_rank(cfg, ft, world_size, zero, rank).result.trace


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2].method}-N{c[3]}-z{c[4]}-r{c[5]}" for c in CASES])
def test_periodic_rank_equals_the_full_dry_run(case):
    _, fast, why, full = runs(*case)
    assert why is None  # built from the three shallow runs
    assert trace_differences(fast, full) == []
    assert fast.peak() == full.peak()
    assert fast.before_last_optimizer_step() == full.before_last_optimizer_step()  # the rank's model states


def test_zero1_whose_partition_moves_with_depth_runs_in_full():
    """ZeRO-1 on 2 ranks: largest parameter first, to the emptiest rank; the tiny Llama's embedding and MLP weights
    are the same size, so which layers' weights rank 0 updates changes with the depth: refused before any shallow
    run, the full dry run made."""
    cfg = tiny_config("llama-3.2-1b", layers=6)
    trace, why = periodic_dry_run_hf_rank(cfg, FULL, 2, 1, 0)
    assert why == (
        "ZeRO-1's partition (largest parameter first, to the rank holding the fewest elements) gives rank 0 other "
        "parameters of the layers at other depths"
    )
    assert "model.layers.5" in trace.timeline.module_names  # the full depth's trace


def test_rows_that_do_not_repeat_run_in_full(monkeypatch):
    """The same ZeRO-1 rank with the partition's check taken away: its shallow runs' rows do not repeat layer by
    layer either, and periodic_trace's own checks refuse them (NotPeriodic): the full dry run, the same bytes."""
    from anatomy_helpers.distributed import hf_fit

    monkeypatch.setattr(hf_fit, "zero1_share", lambda *a: None)
    cfg = tiny_config("llama-3.2-1b", layers=6)
    trace, why = periodic_dry_run_hf_rank(cfg, FULL, 2, 1, 0)
    assert why == "the events of a deeper run are not the shallower run's with blocks inserted (replace)"
    assert "model.layers.5" in trace.timeline.module_names  # the full depth's trace


def test_a_ddp_bucket_growing_past_the_smallest_cap_runs_in_full(monkeypatch):
    """DDP's one bucket grows with every layer; past torch's smallest cap the full depth could cut it in two where
    no shallow run shows it, so the built trace is not trusted (the cap lowered here to see it on a tiny model)."""
    monkeypatch.setattr(hf_rank_period.dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**16)
    cfg = tiny_config("llama-3.2-1b", layers=6)
    trace, why = periodic_dry_run_hf_rank(cfg, FULL, 2, 0, 0)
    assert why.startswith("a DDP gradient bucket grows with the depth to ") and "65,536" in why
    assert "model.layers.5" in trace.timeline.module_names


def test_layers_named_by_the_fine_tune_and_shallow_models_run_in_full():
    """The one-device path's refusals by name (prediction/hf_periodic.refused_before_hf) hold for a rank too."""
    shallow = tiny_config("llama-3.2-1b", layers=5)
    _, why = periodic_dry_run_hf_rank(shallow, LORA, 2, 3, 0)
    assert why == "num_hidden_layers 5 is at most 5, the deepest run the period is read from"
    one_layer = FineTune(
        method="lora", dtype="bfloat16", lora_rank=4, batch_size=1, lora_targets=("layers.3.mlp.up_proj",)
    )
    trace, why = periodic_dry_run_hf_rank(tiny_config("llama-3.2-1b", layers=6), one_layer, 2, 3, 0)
    assert why == "LoRA target 'layers.3.mlp.up_proj' picks particular layers of model.layers"
    assert "base_model.model.model.layers.5.mlp" in trace.timeline.module_names  # peft's names, full depth


def test_bad_input_is_refused_before_any_dry_run():
    cfg = tiny_config("llama-3.2-1b", layers=6)
    with pytest.raises(ValueError, match="rank"):
        periodic_dry_run_hf_rank(cfg, LORA, 2, 1, 2)
    with pytest.raises(ValueError, match="zero"):
        periodic_dry_run_hf_rank(cfg, LORA, 2, 4, 0)
    with pytest.raises(ValueError, match="world_size"):
        periodic_dry_run_hf_rank(cfg, LORA, 0, 0, 0)


def test_will_it_fit_hf_per_rank_says_which_dry_run_answered():
    """will_it_fit_hf with world_size > 1 builds rank 0's dry run from 3, 4 and 5 layers: the same report as from
    the full dry run, and its ``dry_run`` says which was made (``predict --hf``'s "dry run:" line)."""
    cfg, _, _, full_trace = runs(*CASES[-1])
    report = will_it_fit_hf(cfg, FULL, "h100", world_size=3, zero=3)
    assert report.dry_run == dry_run_text(6, None) and report.dry_run.startswith("depths 3, 4, 5, extended to 6")
    full = will_it_fit_hf(cfg, FULL, "h100", world_size=3, zero=3, trace=full_trace)
    assert full.dry_run == ""  # a trace given: its maker says how it was made
    assert report.phases == full.phases and report.peak == full.peak and report.note == full.note
