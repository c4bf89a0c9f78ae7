"""Will a Hugging Face fine-tune fit (prediction/hf_fit.py on one device; distributed/hf_fit.py per rank: a dry run
of one rank of the sharded step, by the engine the course GPT's ranks use)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from anatomy_helpers.distributed.fake_world import STEP_BYTES, fsdp_rows, zero1_partition  # noqa: E402
from anatomy_helpers.distributed.hf_fit import ZERO_STRATEGIES, dry_run_hf_rank, will_it_fit_hf  # noqa: E402
from anatomy_helpers.prediction.devices import get_device  # noqa: E402
from anatomy_helpers.prediction.fit import STEP_PHASES  # noqa: E402
from anatomy_helpers.prediction.hf import tiny_config  # noqa: E402
from anatomy_helpers.prediction.hf_fit import HF_RULES  # noqa: E402
from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf, make_hf_model  # noqa: E402
from anatomy_helpers.tracking.events import CATEGORIES  # noqa: E402

from .conftest import THREADS  # noqa: E402

FULL = FineTune()
LORA = FineTune(method="lora", dtype="bfloat16", lora_rank=4)


@pytest.fixture(scope="module")
def runs():
    cfg = tiny_config("llama-3.2-1b")
    return cfg, {ft: dry_run_hf(cfg, ft) for ft in (FULL, LORA)}


def test_the_report_holds_the_dry_runs_peaks_and_its_verdict_follows_the_device(runs):
    cfg, traces = runs
    trace = traces[FULL]
    report = will_it_fit_hf(cfg, FULL, get_device("h100").total, trace=trace)  # a size: the CPU kernels' rules
    for need, (step, phase) in zip(report.phases, STEP_PHASES):
        pk = trace.peak(step=step, phase=phase)
        assert (need.step, need.phase, need.tensors, need.breakdown) == (step, phase, pk.bytes, dict(pk.breakdown))
    assert report.peak.tensors == trace.peak().bytes and report.fits
    assert report.rules == HF_RULES and f"device rules: {HF_RULES}" in report.table()
    context = get_device("h100").context
    reserved = max(p.reserved for p in report.phases)
    just_enough = will_it_fit_hf(cfg, FULL, context + reserved, trace=trace)
    assert just_enough.fits and just_enough.usable == reserved
    too_small = will_it_fit_hf(cfg, FULL, context + trace.peak().bytes - 1, trace=trace)
    assert not too_small.fits and "DOES NOT FIT" in too_small.verdict()


def test_on_a_named_gpu_the_cuda_rules_a_hf_model_can_state_are_applied_and_the_rest_named(runs):
    cfg, traces = runs
    trace = traces[FULL]
    cpu = will_it_fit_hf(cfg, FULL, get_device("h100").total, trace=trace)
    h100 = will_it_fit_hf(cfg, FULL, "h100", trace=trace)  # compute capability 9.0: 32 MiB cuBLAS workspaces
    ws = 32 * 2**20
    for c, g in zip(cpu.phases, h100.phases):
        n = 1 if (c.step, c.phase) == (1, "forward") else 2  # the backward thread's handle adds the second
        assert g.tensors == c.tensors + n * ws and g.breakdown["kernel_scratch"] == n * ws  # no bias: no cuBLASLt
    assert h100.rules.startswith("CUDA rules from torch source (cuBLAS workspace)")
    assert "not applied, the CPU kernels' instead: SDPA's" in h100.rules  # named, not dropped
    gpt2 = tiny_config("gpt2")  # Conv1D (addmm with a bias) and dropout 0.1 everywhere
    bf16 = FineTune(dtype="bfloat16")
    trace2 = dry_run_hf(gpt2, bf16, steps=2)
    t4 = will_it_fit_hf(gpt2, bf16, "t4", trace=trace2)
    cpu2 = will_it_fit_hf(gpt2, bf16, get_device("t4").total, trace=trace2)
    lt, ws = 2**20, 8_519_680  # cuBLASLt's 1024 KiB; cuBLAS's ":4096:2:16:8" on 7.5
    assert [g.tensors - c.tensors for g, c in zip(t4.phases, cpu2.phases)] == [ws + lt] + [2 * ws + lt] * 5
    assert "cuBLAS workspace, cuBLASLt workspace" in t4.rules and "dropout masks (transformer.drop" in t4.rules
    assert "SDPA's math backend" in t4.rules and "it is low" in t4.rules  # bf16 below 8.0: no fused kernel


QWEN = tiny_config("qwen2.5-7b")  # the architecture of the shipped 7B (benchmarks/hf_rank_fit.py runs it whole)
FOREACH = FineTune(foreach=True)  # the CLI's default implementation: the temporaries of all parameters at once


@pytest.fixture(scope="module")
def qwen_ranks():
    torch.set_num_threads(THREADS)
    return {zero: dry_run_hf_rank(QWEN, FOREACH, 4, zero).result for zero in range(4)}


def _rank_states_by_hand(model, zero: int, n: int) -> dict[str, int]:
    """Rank 0's model states before its optimizer step under ZeRO stage ``zero`` at ``n`` ranks, from the real
    model's tensors and the rules lesson 08 found (fake_world.model_states_rule): AdamW's two moments per element
    held and a 4-byte step per parameter it updates; ZeRO-1 updates torch's partition (zero1_partition); FSDP2
    keeps dim 0 of each parameter and gradient padded to ceil(dim0 / n) rows, every rank a step per parameter."""
    params = list(model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # filed as parameters by the tracker
    size = [p.numel() * p.element_size() for p in params]
    if zero < 2:
        mine = zero1_partition([p.numel() for p in params], n)[0] if zero == 1 else range(len(params))
        state = sum(2 * size[i] + STEP_BYTES for i in mine)
        return {"parameters": sum(size) + buffers, "gradients": sum(size), "optimizer_state": state}
    padded = [fsdp_rows(p.shape[0], n, 0)[1] * (s // p.shape[0]) for p, s in zip(params, size)]
    held = [fsdp_rows(p.shape[0], n, 0)[0] * (s // p.shape[0]) for p, s in zip(params, size)]
    state = sum(2 * h for h in held) + STEP_BYTES * len(params)
    return {"parameters": sum(padded) + buffers, "gradients": sum(padded), "optimizer_state": state}


def test_a_hf_rank_holds_the_sharded_model_states_of_each_zero_stage(qwen_ranks):
    torch.manual_seed(0)
    model = make_hf_model(QWEN, FOREACH)
    for zero, result in qwen_ranks.items():
        held = {c: result.model_states[c] for c in ("parameters", "gradients", "optimizer_state")}
        assert held == _rank_states_by_hand(model, zero, 4), zero
        assert result.strategy == ZERO_STRATEGIES[zero] and result.backend == "fake" and result.world_size == 4


def test_zero2s_optimizer_temporaries_are_a_shards_not_the_whole_models(qwen_ranks):
    """The formula path divided the model states of a one-device dry run and kept its optimizer temporaries whole
    (the 7B at ZeRO-2 on 4 ranks: 14.19 GiB of them, a false 39.01 GiB peak in the optimizer phase). The rank's own
    dry run holds foreach AdamW's temporaries of its shards: a quarter of the one-device step's, with padding."""
    one = dry_run_hf(QWEN, FOREACH)
    temporaries = CATEGORIES.index("temporaries")

    def optimizer_temporaries(trace) -> int:
        phase = trace.phase(2, "optimizer")
        return int(trace.timeline.bytes[phase.start : phase.end + 1, temporaries].max())

    whole = optimizer_temporaries(one)
    zero2 = qwen_ranks[2]
    sharded = optimizer_temporaries(zero2.trace)
    states = zero2.model_states
    assert (
        whole / 4
        <= sharded
        <= whole / 4
        + states["parameters"]
        - _rank_states_by_hand(make_hf_model(QWEN, FOREACH), 2, 1)["parameters"] / 4
        + 4 * 1024
    ), (whole, sharded)
    report = will_it_fit_hf(QWEN, FOREACH, "h100", world_size=4, zero=2)
    assert report.phases[-1].tensors == zero2.trace.peak(step=2, phase="optimizer").bytes
    assert report.peak.tensors == zero2.trace.peak().bytes < one.peak().bytes
    assert "fake process group" in report.note and "ZeRO-2" in report.note


def test_the_course_gpt_and_a_hf_model_go_through_the_same_rank_function(monkeypatch):
    """dry_run_rank (the course GPT, lesson 08's tables) and dry_run_hf_rank both run ranks.run_job on the fake
    process group: the HF model with its Trainee, the course GPT without."""
    from anatomy_helpers.distributed import fake_world
    from anatomy_helpers.distributed.ranks import RankJob, RankResult

    from .conftest import SMALL

    seen = []
    run_job = fake_world.run_job

    def spy(job, rank, world_size, device, **kw):
        seen.append((type(kw["gpt"]).__name__, kw["trainee"] is not None, world_size))
        return run_job(job, rank, world_size, device, **kw)

    monkeypatch.setattr(fake_world, "run_job", spy)
    course = fake_world.dry_run_rank(RankJob("zero1", steps=2, warmup=1, batch_size=2, model=dict(SMALL)), 2, 0)
    hf = dry_run_hf_rank(QWEN, FineTune(batch_size=1), 2, 1)
    assert [s for s in seen if s[0] == "GPT"][0] == ("GPT", False, 2)
    assert [s for s in seen if s[0] != "GPT"][0] == ("Qwen2ForCausalLM", True, 2)
    for run in (course, hf):
        assert isinstance(run.result, RankResult) and run.result.strategy == "zero1"
        assert run.result.trace.training_steps() == [1, 2] and run.result.collectives


def test_the_cli_and_the_python_api_give_one_ranks_numbers(tmp_path, capsys):
    """``predict --hf`` at --world-size 4 --zero 2 prints the numbers will_it_fit_hf returns, phase by phase."""
    import json

    from anatomy_helpers.cli.main import main

    QWEN.to_json_file(tmp_path / "config.json")
    args = ["predict", "--hf", str(tmp_path), "--seq-len", "16", "--batch-size", "2", "--dtype", "float32"]
    assert main([*args, "--impl", "foreach", "--world-size", "4", "--zero", "2", "--gpu", "h100", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    report = will_it_fit_hf(str(tmp_path), FOREACH, "h100", world_size=4, zero=2)
    assert answer["phases"] == [
        dict(step=p.step, phase=p.phase, tensor_bytes=p.tensors, reserved_bytes=p.reserved) for p in report.phases
    ]
    assert answer["peak_breakdown_bytes"] == report.peak.breakdown and answer["note"] == report.note


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(zero=2), "needs world_size > 1"),
        (dict(world_size=8, zero=4), "zero must be one of"),
        (dict(device="a100-90"), "device must be one of"),
        (dict(fine_tune="lora"), "fine_tune must be a FineTune"),
        (dict(model="llama-4"), "shipped configurations"),
    ],
)
def test_bad_requests_are_refused_before_any_dry_run(kw, message):
    args = {"model": "llama-3.1-8b", "fine_tune": FULL, "device": "a100-80"} | kw
    with pytest.raises(ValueError, match=message):
        will_it_fit_hf(args.pop("model"), **args)


def test_the_flop_count_from_one_and_two_layers_is_the_whole_models():
    from anatomy_helpers.prediction.hf_fixes import _flops_of, hf_step_flops

    cfg = tiny_config("llama-3.2-1b", layers=3)
    for ft in (FineTune(), FineTune(gradient_checkpointing=True, batch_size=2, micro_batches=2)):
        assert hf_step_flops(cfg, ft) == _flops_of(cfg, ft) > 0


def test_cheapest_fix_hf_ranks_dry_run_candidates():
    """Per rank (world size 2): the search's combination is made of the one catalogue's levers (ZeRO stages
    among them), fits, and is the report of the setup it names; a step that fits needs nothing. The device holds
    rank 0 of ZeRO-3 with 4 micro-batches and checkpointing (the simulated allocator's reserved bytes), so a
    combination fits; the request (DDP, no lever) does not."""
    from anatomy_helpers.distributed.hf_fit import cheapest_fix_hf
    from anatomy_helpers.prediction.levers import fine_tune_levers

    cfg = tiny_config("llama-3.2-1b", layers=2, head_dim=32, vocab=4096)  # MiBs: the allocator's segments matter less
    ft = FineTune(batch_size=8, seq_len=64, dtype="bfloat16", fused=True)
    low = will_it_fit_hf(cfg, dataclasses.replace(ft, micro_batches=4, gradient_checkpointing=True), "h100",
                         world_size=2, zero=3)  # fmt: skip
    device = get_device("h100").context + max(p.reserved for p in low.phases)
    base = will_it_fit_hf(cfg, ft, device, world_size=2)
    assert not base.fits
    fixes = cheapest_fix_hf(cfg, ft, device, world_size=2)
    names = {lv.name for lv in fine_tune_levers(ft, get_device(device), 2)}
    assert fixes and all(f.fits for f in fixes) and all(set(f.name.split(" + ")) <= names for f in fixes)
    setup = fixes[0].setup
    again = will_it_fit_hf(cfg, setup.fine_tune, device, world_size=setup.world_size, zero=setup.zero)
    assert again.phases == fixes[0].report.phases and again.peak.tensors < base.peak.tensors
    assert cheapest_fix_hf(cfg, ft, "h100", world_size=2) == []  # it fits on an H100: nothing to rank


def test_one_optimizer_list_for_the_course_step_and_a_fine_tune():
    from anatomy_helpers.cli.hf import build_hf_predict_parser
    from anatomy_helpers.prediction import hf_step
    from anatomy_helpers.training.train import OPTIMIZERS

    assert hf_step.OPTIMIZERS is OPTIMIZERS  # one definition, not a second tuple that may drift
    assert hf_step.FINE_TUNE_OPTIMIZERS == (*OPTIMIZERS, "adamw8bit")  # lesson 03's four and bitsandbytes' 8-bit
    choices = next(a.choices for a in build_hf_predict_parser()._actions if a.dest == "optimizer")
    assert tuple(choices) == hf_step.FINE_TUNE_OPTIMIZERS
    for name in hf_step.FINE_TUNE_OPTIMIZERS:
        assert FineTune(optimizer=name).optimizer == name
    with pytest.raises(ValueError, match="optimizer"):
        FineTune(optimizer="lion")


#: Qwen2.5-1.5B's published configuration (its config.json on the Hub): no shipped copy, so the test writes one.
QWEN_1_5B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


def test_one_verdict_when_the_tensors_fit_but_the_allocators_segments_do_not(tmp_path):
    """Qwen2.5-1.5B, full fine-tune, batch 1 of 2,048 tokens, gradient checkpointing. On a T4 as a process sees it
    (14.08 GiB usable) the optimizer phase's tensors do not fit, and the table and the verdict say so together. On a
    device a little larger, every phase's tensors fit and the simulated allocator's segments do not: the verdict says
    the allocator decides, and why; the table shows both; the margin is against what is assumed (the context, the
    cuBLAS workspaces where CUDA's rules are not applied)."""
    import json

    from anatomy_helpers.prediction.devices import CUDA_CONTEXT_BYTES
    from anatomy_helpers.prediction.fit import unapplied_workspaces
    from anatomy_helpers.prediction.fit_report import RESERVED_DECIDES, size_text

    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    ft = FineTune(batch_size=1, seq_len=2048, dtype="bfloat16", gradient_checkpointing=True, foreach=True)
    report = will_it_fit_hf(str(tmp_path), ft, "t4")
    params = 1_543_714_304  # 1.54B published; by hand: 151,936 x 1,536 embedding + 28 x 46,797,824 + 1,536
    optimizer_peak = [p for p in report.phases if (p.step, p.phase) == (1, "optimizer")][0]
    with torch.device("meta"):  # the rotary embedding's inverse frequencies are buffers, counted with the weights
        buffers = sum(b.numel() * b.element_size() for b in make_hf_model(str(tmp_path), ft).buffers())
    assert optimizer_peak.breakdown["parameters"] == 2 * params + buffers
    assert optimizer_peak.breakdown["gradients"] == 2 * params
    assert not report.fits and report.failure == (1, "optimizer") and optimizer_peak.tensors > report.usable
    row = next(line.split() for line in report.table().splitlines() if line.startswith("   1  optimizer"))
    assert row[-3:] == ["NO", "RUNS", "OUT"]  # the row agrees
    assert "capped at 14.08 GiB usable, runs out first in step 1's optimizer pass" in report.verdict()

    tensors = report.peak.tensors
    reserved = max(p.reserved for p in report.phases)
    between = tensors + (reserved - tensors) // 8  # usable memory above every phase's tensors, below the segments
    report = will_it_fit_hf(str(tmp_path), ft, CUDA_CONTEXT_BYTES + between)
    assert all(p.tensors <= report.usable for p in report.phases) and not report.fits
    assert report.failure == (1, "optimizer")
    verdict = report.verdict()
    assert f"DOES NOT FIT: the simulated caching allocator, capped at {size_text(between)} usable, runs out" in verdict
    assert f"tensors peak at {size_text(report.peak.tensors)}" in verdict
    table = report.table()
    assert f"{RESERVED_DECIDES}: the tensors alone ({size_text(report.peak.tensors)}) would fit" in table
    assert "expandable_segments:True" in table and "torch.cuda.mem_get_info()" in table
    workspaces = unapplied_workspaces(get_device(report.capacity))  # a size: CUDA's rules are not applied
    assert report.allowance == CUDA_CONTEXT_BYTES + workspaces
    assert not report.close and f"the answer holds with {size_text(report.allowance)} more memory" in table


@pytest.fixture(scope="module")
def hf_gloo_ranks():
    """Two real gloo ranks of a tiny Qwen2.5 LoRA fine-tune under each ZeRO stage, in one world."""
    from anatomy_helpers.distributed.hf_fit import HFRankJob
    from anatomy_helpers.distributed.world import run_world

    return run_world([HFRankJob(QWEN, HF_GLOO_FT, zero) for zero in range(4)], 2, timeout_s=600)


HF_GLOO_FT = FineTune(batch_size=1, seq_len=16, method="lora", lora_rank=4, lora_alpha=8)


@pytest.mark.parametrize("zero", range(4))
def test_every_hf_dry_run_rank_equals_its_real_gloo_rank_byte_for_byte(hf_gloo_ranks, zero):
    # issue #40: only the course GPT's ranks were checked against real gloo ranks; a Hugging Face rank (the one
    # per-rank engine's other trainee) now is too, under each ZeRO stage, rank by rank
    from anatomy_helpers.distributed.fake_world import rank_differences

    for rank in range(2):
        real = hf_gloo_ranks[ZERO_STRATEGIES[zero]][rank]
        fake = dry_run_hf_rank(QWEN, HF_GLOO_FT, 2, zero, rank).result
        assert real.backend == "gloo" and fake.backend == "fake"
        assert rank_differences(real, fake) == {}, (zero, rank)
