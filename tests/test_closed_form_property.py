"""The closed form against the dry run on random configurations: every phase of two steps equal to the byte, or refused.

``estimate_step`` claims byte-exact phase peaks for the course GPT on CPU kernels, or a ValueError naming what it
cannot model. The dry run (byte for byte the real run) is the referee. The configurations come from a seeded
generator of this file's own (:func:`random_case`), so a failure names a configuration that fails again: both
blocks, both attention kernels, dropout off and on, every checkpointing policy, every optimizer name and
implementation the closed form models, float32 and bfloat16, odd widths and head counts (one head, head width 1
and 2, grouped-query attention), batch sizes 1 to 4. The models are tiny (a dry run allocates nothing, but each op
costs the same however small): the test checks the arithmetic of shapes, not sizes. Refusals are counted: they must
stay a minority, so the test cannot pass by refusing everything.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest

from anatomy_helpers.core.checkpointing import CHECKPOINT_POLICIES
from anatomy_helpers.core.model import ATTENTION_IMPLS, BLOCKS, DTYPES, ModelConfig
from anatomy_helpers.prediction.dryrun import dry_run_config
from anatomy_helpers.prediction.estimate import IMPLEMENTATIONS, MODELLED_OPTIMIZERS, estimate_step, n_param_tensors

# the issue that asked for the test; any seed must pass (the docstring's promise): CLOSED_FORM_SEED=7 runs another
SEED = int(os.environ.get("CLOSED_FORM_SEED", "41"))
CASES = 500
MAX_REFUSED = 0.1  # refusals allowed, as a share of the cases


@dataclass(frozen=True)
class Case:
    """One random step: a model, its micro-batch, its optimizer and the optimizer's implementation."""

    config: dict
    batch: int
    optimizer: str
    impl: str

    def __str__(self) -> str:
        return f"ModelConfig(**{self.config}), batch {self.batch}, {self.optimizer} ({self.impl})"


def random_case(rng: random.Random) -> Case:
    """A tiny configuration drawn from ``rng``: every field the closed form reads varies."""
    block = rng.choice(BLOCKS)
    n_head = rng.choice([1, 1, 2, 3, 4, 5, 8])
    widths = [2, 2, 4, 6, 8] if block == "llama" else [1, 2, 3, 4, 5, 7, 8]  # rotary turns pairs: even widths
    # every op costs the same however small: mostly one block keeps it fast; two and three blocks (one in five)
    # still reach the first block's moments and every_k's longer segments
    n_layer = rng.choice([1, 1, 1, 1, 1, 1, 1, 1, 2, 3])
    config = dict(
        block=block,
        n_layer=n_layer,
        n_head=n_head,
        d_model=n_head * rng.choice(widths),
        seq_len=rng.choice([1, 2, 5, 8, 13, 16, 24, 32]),
        vocab_size=rng.choice([59, 61, 100, 257, 1000]),
        mlp_ratio=rng.choice([1, 2, 3, 4]),
        dtype=rng.choice(list(DTYPES)),
        attn_impl=rng.choice(ATTENTION_IMPLS),
        dropout=rng.choice([0.0, 0.0, 0.1, 0.5]),
        checkpoint=rng.choice(CHECKPOINT_POLICIES),
        checkpoint_every=rng.randint(1, n_layer),
        tie_embeddings=rng.random() < 0.7,
    )
    if block == "llama":
        config["n_kv_head"] = rng.choice([k for k in range(1, n_head + 1) if n_head % k == 0])
    optimizer = rng.choice(MODELLED_OPTIMIZERS)
    impl = rng.choice(IMPLEMENTATIONS)
    if optimizer == "adamw_bf16":  # modelled on a float32 model, with its one implementation (refused otherwise)
        config["dtype"], impl = "float32", "single"
    return Case(config, rng.randint(1, 4), optimizer, impl)


def mismatches(case: Case) -> dict[tuple[int, str], tuple[int, int]] | None:
    """(step, phase) -> (closed form, dry run) for every phase that differs; None when the closed form refuses."""
    cfg = ModelConfig(**case.config)
    try:
        est = estimate_step(cfg, case.batch, case.optimizer, case.impl)
    except ValueError:
        return None
    foreach, fused = case.impl == "foreach" or None, case.impl == "fused" or None
    trace = dry_run_config(cfg, optimizer=case.optimizer, foreach=foreach, fused=fused, batch_size=case.batch)
    out = {}
    for (step, phase), predicted in est.phase_peaks.items():
        measured = trace.peak(step=step, phase=phase).bytes
        # step 1's optimizer phase peaks before the tracker counts Adam's 4-byte `step` counters (StepEstimate)
        slack = 4 * n_param_tensors(cfg) if (step, phase) == (1, "optimizer") and "adam" in case.optimizer else 0
        if not 0 <= predicted - measured <= slack:
            out[(step, phase)] = (predicted, measured)
    return out


def test_closed_form_equals_the_dry_run_on_random_configurations():
    rng = random.Random(SEED)
    cases = [random_case(rng) for _ in range(CASES)]
    refused, wrong = [], []
    for case in cases:
        found = mismatches(case)
        if found is None:
            refused.append(case)
        elif found:
            wrong.append(f"{case}: {found}")
    print(f"seed {SEED}: {len(refused)} of {CASES} refused, {len(wrong)} wrong")  # shown by pytest -s
    assert not wrong, f"{len(wrong)} of {CASES} differ from the dry run:\n" + "\n".join(wrong[:10])
    assert len(refused) <= MAX_REFUSED * CASES, f"{len(refused)} of {CASES} refused, e.g. {refused[0]}"
    assert len(cases) - len(refused) >= (1 - MAX_REFUSED) * CASES  # most cases were compared, phase by phase


@pytest.mark.parametrize("seed", [0, 1])
def test_the_generator_is_deterministic_and_varied(seed):
    """The same seed draws the same cases (a failure can be replayed); the draws cover every value that matters."""
    first = [random_case(random.Random(seed)) for _ in range(3)]
    assert first == [random_case(random.Random(seed)) for _ in range(3)]
    rng = random.Random(SEED)
    cases = [random_case(rng) for _ in range(CASES)]
    for field, values in [
        ("block", BLOCKS),
        ("attn_impl", ATTENTION_IMPLS),
        ("checkpoint", CHECKPOINT_POLICIES),
        ("dtype", tuple(DTYPES)),
    ]:
        assert {c.config[field] for c in cases} == set(values), field
    assert {c.optimizer for c in cases} == set(MODELLED_OPTIMIZERS)
    assert {c.impl for c in cases} == set(IMPLEMENTATIONS)
    assert {c.batch for c in cases} == {1, 2, 3, 4}
    assert {c.config["n_layer"] for c in cases} == {1, 2, 3}
    assert any(c.config["checkpoint"] == "every_k" and c.config["checkpoint_every"] > 1 for c in cases)
    assert any(c.config["dropout"] > 0 for c in cases) and any(c.config["dropout"] == 0 for c in cases)
    assert any(c.config["d_model"] % 2 for c in cases)  # odd widths
    assert any(c.config["n_head"] == 1 for c in cases)
