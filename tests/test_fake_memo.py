"""fake_memo: an op's outputs remade from a remembered answer are what the fake kernel itself returns (layout,
storage bytes, which input they are or share storage with), op by op for each kind remembered; the ops it must not
remember are not; and whole dry runs with and without it are the same, byte for byte, on configurations drawn at
random (course GPT and Llama blocks, checkpointing, autocast, micro-batches, every optimizer implementation), a
Hugging Face LoRA fine-tune and sharded ranks."""

import random

import pytest
import torch

from anatomy_helpers.core.model import ModelConfig
from anatomy_helpers.distributed.fake_world import dry_run_rank
from anatomy_helpers.distributed.fit import rank_job
from anatomy_helpers.prediction import fake_check, fake_check_cache, fake_memo
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.fake_check import CheckedFakeTensorMode
from anatomy_helpers.prediction.periodic import trace_differences

aten = torch.ops.aten
FRESH = fake_memo.FRESH


def _inputs(mode):
    with mode:
        x = torch.empty(4, 6, 8)
        return dict(
            x=x,
            w=torch.empty(8, 5),
            row=torch.empty(8),
            xs=[torch.empty(3, 2), torch.empty(7)],
            ys=[torch.empty(3, 2), torch.empty(7)],
            view=x.transpose(0, 1),  # not contiguous, on x's storage
            part=x[1:],  # a storage offset
            half=torch.empty(4, 8, dtype=torch.bfloat16),
        )


# (name, op, arguments from the inputs above, kind remembered)
CALLS = [
    ("mm", aten.mm.default, lambda t: (t["x"].view(24, 8), t["w"]), fake_memo.FRESH),
    ("add of a transposed view", aten.add.Tensor, lambda t: (t["view"], 1.0), fake_memo.FRESH),
    ("gelu at an offset", aten.gelu.default, lambda t: (t["part"],), fake_memo.FRESH),
    ("layer norm (a tuple)", aten.native_layer_norm.default, lambda t: (t["x"], [8], t["row"], None, 1e-5), FRESH),
    ("to bfloat16", aten._to_copy.default, lambda t: (t["x"],), fake_memo.FRESH),
    ("foreach mul (a list)", aten._foreach_mul.Scalar, lambda t: (t["xs"], 0.5), fake_memo.FRESH),
    ("a factory", aten.empty.memory_format, lambda t: ([3, 4],), fake_memo.FRESH),
    ("transpose", aten.transpose.int, lambda t: (t["x"], 0, 2), fake_memo.VIEW),
    ("view at an offset", aten.view.default, lambda t: (t["part"], [3, 48]), fake_memo.VIEW),
    ("split (a list of views)", aten.split.Tensor, lambda t: (t["x"], 3, 2), fake_memo.VIEW),
    ("expand", aten.expand.default, lambda t: (t["row"], [5, 8]), fake_memo.VIEW),
    ("_unsafe_view (undeclared view)", aten._unsafe_view.default, lambda t: (t["x"], [24, 8]), fake_memo.VIEW),
    ("add_", aten.add_.Tensor, lambda t: (t["x"], t["view"].transpose(0, 1)), fake_memo.IN_PLACE),
    ("foreach add_ (returns nothing)", aten._foreach_add_.List, lambda t: (t["xs"], t["ys"]), fake_memo.IN_PLACE),
]


def _described(o, inputs):
    """An output as a dry run reads it: layout, storage bytes, which input tensor it is and whose storage it shares."""
    if o is None:
        return None
    if isinstance(o, (list, tuple)):
        return type(o), [_described(x, inputs) for x in o]
    shares = [i for i, a in enumerate(inputs) if a.untyped_storage()._cdata == o.untyped_storage()._cdata]
    meta = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, o.device, o.untyped_storage().nbytes())
    return (*meta, shares, [i for i, a in enumerate(inputs) if a is o], type(o))


def _flat(args):
    out = []
    for a in args:
        out.extend(a if isinstance(a, list) else [a])
    return [a for a in out if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("name, func, make_args, kind", CALLS, ids=[c[0] for c in CALLS])
def test_remade_outputs_are_the_fake_kernels(name, func, make_args, kind):
    mode = CheckedFakeTensorMode()
    assert fake_memo.op_kind(func) == kind
    args = make_args(_inputs(mode))
    key = fake_memo.layout_key(mode, func, args, {})
    assert key is not None
    with fake_memo.off():  # the fake kernel's own answer, twice: once remembered, once to compare with
        with mode:
            first = func(*args)
        fake_memo.remember(mode, key, "checked", func, args, {}, first)
        args = make_args(_inputs(mode))  # new inputs of the same layouts: the same key
        assert fake_memo.layout_key(mode, func, args, {}) is None  # off: nothing is looked up
    assert fake_memo.layout_key(mode, func, args, {}) == key
    made = fake_memo.outputs_from(mode, key, args, {}, {"checked"})
    assert made is not fake_memo.MISS
    if kind is fake_memo.IN_PLACE:  # the same call on inputs of its own, read against its own inputs
        own_args = make_args(_inputs(mode))
        with fake_memo.off(), mode:
            own = func(*own_args)
        assert _described(made, _flat(args)) == _described(own, _flat(own_args))
    else:
        with fake_memo.off(), mode:
            own = func(*args)
        assert _described(made, _flat(args)) == _described(own, _flat(args))
    fresh = [o for o in (made if isinstance(made, (list, tuple)) else [made]) if o is not None]
    if kind is fake_memo.FRESH:  # new storages, none of them the fake kernel's first outputs'
        firsts = {o.untyped_storage()._cdata for o in (first if isinstance(first, (list, tuple)) else [first])}
        assert not firsts & {o.untyped_storage()._cdata for o in fresh}
    assert fake_memo.outputs_from(mode, key, args, {}, set()) is fake_memo.MISS  # its signature no longer checked


def test_what_is_never_remembered():
    mode = CheckedFakeTensorMode()
    t = _inputs(mode)
    for func in (aten.t_.default, aten.resize_.default, aten.nonzero.default, aten.set_.source_Storage,
                 aten.lift_fresh.default):  # fmt: skip
        assert fake_memo.op_kind(func) is None, func
    assert fake_memo.layout_key(mode, aten.add.Tensor, (t["x"], torch.ones(1)), {}) is None  # a real tensor
    with mode:
        constant = torch.tensor(2.0)  # lifted: a fake tensor with a constant
    assert constant.constant is not None
    assert fake_memo.layout_key(mode, aten.add.Tensor, (t["x"], constant), {}) is None
    other = CheckedFakeTensorMode()
    assert fake_memo.layout_key(other, aten.add.Tensor, (t["x"], 1.0), {}) is None  # another mode's tensor


def test_an_in_place_op_that_resizes_is_not_remembered():
    mode = CheckedFakeTensorMode()
    with mode:
        out, x = torch.empty(0), torch.empty(3, 5)
    func = aten.abs.out  # out= resizes ``out`` to x's size
    assert fake_memo.op_kind(func) == fake_memo.IN_PLACE
    key = fake_memo.layout_key(mode, func, (x,), {"out": out})
    with fake_memo.off(), mode:
        result = func(x, out=out)
    fake_memo.remember(mode, key, "checked", func, (x,), {"out": out}, result)
    assert fake_memo.outputs_from(mode, key, (x,), {"out": out}, {"checked"}) is fake_memo.MISS


def _random_configs(n: int, seed: int = 7):
    """Course configurations drawn at random, with the step options a dry run takes."""
    rng = random.Random(seed)
    for _ in range(n):
        block = rng.choice(["gpt2", "llama"])
        heads = rng.choice([2, 4])
        fields = dict(
            block=block, n_layer=rng.randint(1, 4), n_head=heads, d_model=heads * rng.choice([8, 12]),
            seq_len=rng.choice([8, 16, 24]), vocab_size=rng.choice([64, 100]),
            dtype=rng.choice(["float32", "bfloat16"]),
            attn_impl=rng.choice(["manual", "sdpa"]), checkpoint=rng.choice(["none", "full", "selective", "attention"]),
        )  # fmt: skip
        if block == "gpt2":
            fields["dropout"] = rng.choice([0.0, 0.1])
        else:
            fields["n_kv_head"] = rng.choice([1, heads])
        optimizer = rng.choice(["adamw", "adam", "sgd", "momentum"])
        implementation = rng.choice(["foreach", "single"] + (["fused"] if optimizer in ("adam", "adamw") else []))
        run = dict(
            optimizer=optimizer, foreach=implementation == "foreach", fused=implementation == "fused",
            batch_size=rng.choice([2, 4]), micro_batches=rng.choice([1, 2]),
            autocast=rng.choice([None, "bfloat16"]),
        )  # fmt: skip
        yield ModelConfig(**fields), run


@pytest.mark.parametrize("cfg, run", list(_random_configs(8)), ids=lambda x: repr(x)[:60])
def test_dry_runs_with_and_without_it_are_the_same(cfg, run):
    dry_run_config(cfg, **run)  # fills the memo (and checks the ops)
    with fake_memo.off():
        without = dry_run_config(cfg, **run)
    assert trace_differences(dry_run_config(cfg, **run), without) == []


@pytest.mark.parametrize("strategy, tp, world_size, rank", [("fsdp2_zero3", 1, 3, 2), ("tp_fsdp", 2, 4, 1)])
def test_a_ranks_dry_run_with_and_without_it_is_the_same(strategy, tp, world_size, rank):
    job = rank_job(dict(d_model=16, n_head=2, seq_len=8, vocab_size=64, attn_impl="sdpa", n_layer=2), strategy,
                   world_size, tp, 1)  # fmt: skip
    dry_run_rank(job, world_size, rank)
    with fake_memo.off():
        without = dry_run_rank(job, world_size, rank).result
    assert trace_differences(dry_run_rank(job, world_size, rank).result.trace, without.trace) == []


def test_a_lora_fine_tunes_dry_run_with_and_without_it_is_the_same():
    pytest.importorskip("peft")
    from anatomy_helpers.prediction.hf import tiny_config
    from anatomy_helpers.prediction.hf_step import FineTune, dry_run_hf

    cfg = tiny_config("qwen2.5-0.5b", layers=2)
    ft = FineTune(dtype="float16", autocast="float16", method="lora", lora_rank=4, foreach=True, batch_size=1)
    dry_run_hf(cfg, ft)
    with fake_memo.off():
        without = dry_run_hf(cfg, ft)
    assert trace_differences(dry_run_hf(cfg, ft), without) == []


def test_forgotten_checks_are_made_again(fresh_op_checks, monkeypatch):
    """The memo gives an answer only while its op signature is checked: with the checks forgotten (a new process
    with an empty cache on disk), the next dry run runs the real kernels again."""
    cfg = ModelConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, vocab_size=64)
    dry_run_config(cfg, batch_size=2)
    assert fake_memo._ANSWERS  # remembered
    monkeypatch.setattr(fake_check, "_PASSED", set(fake_check._ENTRY_OPS))
    monkeypatch.setattr(fake_check, "_ASKED", set())
    real = []
    run = fake_check._real_call
    monkeypatch.setattr(fake_check, "_real_call", lambda call: real.append(call) or run(call))
    monkeypatch.setenv(fake_check_cache.CACHE_DIR_ENV, str(fresh_op_checks / "again"))
    monkeypatch.setattr(fake_check_cache, "_current", None)
    dry_run_config(cfg, batch_size=2)
    assert any(str(call.func) == "aten.mm.default" for call in real)
