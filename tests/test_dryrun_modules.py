"""Dry runs of modules that are not the course GPT: byte for byte the real run, or refused naming the op."""

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from anatomy_helpers import make_optimizer
from anatomy_helpers.prediction import dryrun, fake_check
from anatomy_helpers.prediction.dryrun import DryRunError, dry_run, dry_run_config, fake_module, run_steps
from anatomy_helpers.tracking.tracker import StepTracker

from .conftest import SMALL
from .test_dryrun import assert_same_trace


@pytest.fixture
def nothing_checked(fresh_op_checks):
    """Forget what this process and the cache on disk have checked, so that the test sees the real kernels run."""


def real_and_dry(factory, batch, loss, optimizer="adamw", steps=2):
    """A real tracked run (kernel scratch off, the one category a dry run cannot see) and the dry run."""
    torch.manual_seed(0)
    model = factory()
    real = run_steps(model, make_optimizer(model, optimizer), batch, loss, steps, kernel_scratch=False)
    return real, dry_run(factory, batch, loss, lambda m: make_optimizer(m, optimizer), steps)


def token_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def token_batch(step):
    return torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)


class RecurrentLM(nn.Module):
    """Embedding, a 2-layer recurrent network (nn.LSTM or nn.GRU), linear head."""

    def __init__(self, cell=nn.LSTM, vocab=50, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = cell(d, d, num_layers=layers, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])  # (B, T, vocab)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_lstm_on_onednn_is_refused_naming_the_op(nothing_checked):
    # oneDNN's LSTM layer returns a workspace autograd saves for backward; its fake kernel returns an empty one.
    with pytest.raises(DryRunError, match=r"mkldnn_rnn_layer.*module 'rnn', forward phase.*\(0,\) uint8") as err:
        real_and_dry(RecurrentLM, token_batch, token_loss)
    assert "mkldnn.flags(enabled=False)" in str(err.value)  # and says what to do instead


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_lm_on_torchs_own_kernels_equals_its_real_run(cell, nothing_checked):
    with torch.backends.mkldnn.flags(enabled=False):
        real, dry = real_and_dry(lambda: RecurrentLM(cell), token_batch, token_loss)
    assert_same_trace(dry, real)
    assert dry.peak().breakdown["activations"] > 0


def test_fake_module_gives_an_lstm_its_fake_weights():
    # nn.LSTM runs on self._flat_weights, a list of its parameters made in __init__: it must hold the fake ones.
    with torch.device("meta"):
        model = RecurrentLM()
    fake_module(model, FakeTensorMode())
    params = list(model.rnn.parameters())
    assert len(model.rnn._flat_weights) == len(params) > 0
    assert all(w is p for w, p in zip(model.rnn._flat_weights, params))
    assert all(ref() is p for ref, p in zip(model.rnn._flat_weight_refs, params))


class ConvNet(nn.Module):
    """Two conv + BatchNorm + ReLU blocks (BatchNorm's running statistics are buffers), pooling, linear head."""

    def __init__(self, classes=5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def image_batch(step):
    return torch.empty(4, 3, 16, 16), torch.zeros(4, dtype=torch.long)


def class_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_cnn_with_batchnorm_equals_its_real_run(optimizer, nothing_checked):
    real, dry = real_and_dry(ConvNet, image_batch, class_loss, optimizer)
    assert_same_trace(dry, real)
    assert dry.baseline["parameters"] > 0


class Encoder(nn.Module):
    """nn.TransformerEncoder (pre-norm, GELU, dropout) with a linear head."""

    def __init__(self, d=32):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d, nhead=4, dim_feedforward=64, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def test_transformer_encoder_with_dropout_equals_its_real_run(nothing_checked):
    batch = lambda step: (torch.empty(4, 10, 32), torch.zeros(4, dtype=torch.long))  # noqa: E731
    real, dry = real_and_dry(Encoder, batch, class_loss)
    assert_same_trace(dry, real)


class TiedWithBuffers(nn.Module):
    """Tied input and output weights, a buffer that is a view of another (one storage), a submodule used twice,
    and a list of parameters kept as a plain attribute."""

    def __init__(self, vocab=40, d=16, positions=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("table", torch.linspace(0, 1, 2 * positions * d).view(2 * positions, d))
        self.register_buffer("positions", self.table[:positions])  # a view: the real model holds one storage
        self.scales = [self.block.weight]  # a cached reference, as nn.LSTM keeps _flat_weights

    def forward(self, x):
        h = self.emb(x) + self.positions[: x.shape[1]]
        h = self.block(torch.relu(self.block(h)))  # the same module twice
        assert self.scales[0] is self.block.weight
        return self.head(h)


def test_tied_weights_and_shared_buffers_equal_their_real_run(nothing_checked):
    # the baseline counts the view's storage once, as the real run does; the forward finds the cached list fake
    real, dry = real_and_dry(TiedWithBuffers, token_batch, token_loss)
    assert_same_trace(dry, real)


class KeepsADerivedTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w_t = self.lin.weight.t()  # derived from a parameter, kept outside parameters and buffers

    def forward(self, x):
        return x @ self.w_t


def test_a_tensor_derived_from_parameters_is_refused():
    with pytest.raises(DryRunError, match=r"KeepsADerivedTensor\.w_t is a tensor the module keeps outside"):
        dry_run(KeepsADerivedTensor, lambda s: (torch.empty(2, 4),), lambda m, b: m(*b).sum())


# ---- the check itself ----------------------------------------------------------------------------------------


@torch.library.custom_op("anatomy_test::padded_copy", mutates_args=())
def padded_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x])[: x.shape[0]]  # x's values in a storage twice x's size


@padded_copy.register_fake
def _(x):
    return torch.empty_like(x)  # the right shape, but half the storage the real kernel allocates


padded_copy.register_autograd(lambda ctx, grad: grad)


class UsesAWrongFakeKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return padded_copy(self.lin(x))


def test_an_op_whose_fake_kernel_differs_is_refused_by_name(nothing_checked):
    with pytest.raises(DryRunError, match=r"anatomy_test\.padded_copy\.default \(first seen in module 'model'") as err:
        dry_run(UsesAWrongFakeKernel, lambda s: (torch.empty(3, 8),), lambda m, b: m(*b).sum())
    assert "(3, 8) float32 at offset 0 of storage 1 (96 B) in the fake run" in str(err.value)
    assert "(3, 8) float32 at offset 0 of storage 1 (192 B) for real" in str(err.value)


def test_checks_are_remembered_and_leave_the_rng_alone(nothing_checked, monkeypatch):
    cfg = dict(SMALL, dropout=0.1)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    dry_run_config(batch_size=2, **cfg)  # dropout's real kernel runs in the check
    assert torch.equal(torch.get_rng_state(), state)
    assert len(fake_check._PASSED) > 30

    def no_real_call(call):
        raise AssertionError(f"{call.func} was checked twice")

    monkeypatch.setattr(fake_check, "_real_call", no_real_call)
    dry_run_config(batch_size=3, **{**cfg, "n_layer": 3})  # other sizes, same signatures: nothing runs for real


def test_16bit_calls_on_the_cpu_over_a_mib_are_checked_on_the_small_twin(nothing_checked, monkeypatch):
    """A bfloat16 model whose smallest weight (1,024 x 1,024) is 2 MiB: every signature of its dry run is checked,
    no matrix product for real at a bfloat16 call over MAX_CHECK_BYTES_16BIT_CPU (slow on a CPU without 16-bit
    arithmetic). (tests/test_hf_fit.py's fused AdamW over a bfloat16 model: an element-wise op over 1 MiB, still
    run.)"""
    seen, ran = [], []
    check_calls, real_call = fake_check.check_calls, fake_check._real_call
    monkeypatch.setattr(dryrun, "check_calls", lambda calls, *a: seen.append(calls) or check_calls(calls, *a))
    monkeypatch.setattr(fake_check, "_real_call", lambda call: ran.append(call) or real_call(call))
    dry_run_config(batch_size=2, **{**SMALL, "d_model": 1024, "n_head": 8, "seq_len": 16, "dtype": "bfloat16"})

    def bf16(call) -> bool:  # a bfloat16 matrix product
        matrix = str(call.func).split(".")[1] in ("mm", "addmm", "bmm", "baddbmm")
        return matrix and any(getattr(a, "dtype", None) == torch.bfloat16 for a in [*call.args, *call.kwargs.values()])

    def size(call) -> int:
        return call.nbytes + fake_check._new_bytes(call.outcome)

    assert any(bf16(c) and size(c) > 2**20 for c in seen[0].values())  # the full-size run has such calls ...
    assert len(seen) == 2  # ... so the small twin ran too
    assert ran and max(size(c) for c in ran if bf16(c)) <= fake_check.MAX_CHECK_BYTES_16BIT_CPU == 2**20
    assert all(fake_check.op_checked(key) for calls in seen for key in calls)


def test_ops_too_large_to_check_are_refused_or_checked_on_a_small_twin(nothing_checked, monkeypatch):
    monkeypatch.setattr(fake_check, "MAX_CHECK_BYTES", 1)
    with pytest.raises(DryRunError, match=r"uses aten\.\S+.* only at calls over .* dry-run a smaller instance"):
        dry_run(ConvNet, image_batch, class_loss)
    monkeypatch.setattr(fake_check, "MAX_CHECK_BYTES", 2**20)
    real_twin = []
    original = fake_check._real_call
    monkeypatch.setattr(fake_check, "_real_call", lambda call: real_twin.append(call.nbytes) or original(call))
    # the calls over 1 MiB are checked on the small twin (none of its calls is over), or this would raise
    dry_run_config(batch_size=4, **{**SMALL, "d_model": 256, "n_head": 4, "seq_len": 64})
    assert real_twin and max(real_twin) <= 2**20


@pytest.mark.parametrize("batch_size, twin", [(12, 8), (4, 4)])
def test_the_small_twin_keeps_the_micro_batches(nothing_checked, monkeypatch, batch_size, twin):
    """4 micro-batches of 3 rows: the twin runs 4 micro-batches of 2 (its batch a multiple of 4: a twin of
    min(12, 2) rows could not be split in 4); of 1 row where the real micro-batch has 1."""
    monkeypatch.setattr(fake_check, "MAX_CHECK_BYTES", 2**18)  # the 256-wide weights' calls are over it
    seen, rows = [], []
    check_calls, course_batch = fake_check.check_calls, dryrun.course_batch
    monkeypatch.setattr(dryrun, "check_calls", lambda calls, *a: seen.append(calls) or check_calls(calls, *a))
    monkeypatch.setattr(dryrun, "course_batch", lambda b, *a: rows.append(b) or course_batch(b, *a))
    dry_run_config(batch_size=batch_size, micro_batches=4, **{**SMALL, "d_model": 256, "n_head": 4, "seq_len": 64})
    assert len(seen) == 2 and rows == [batch_size] * 2 + [twin] * 2  # the full run's 2 steps, then its twin's
    assert all(fake_check.op_checked(key) for calls in seen for key in calls)


# ---- the small twin: it checks what the full-size run could not, or the dry run is refused ------------------------


def test_what_the_small_twin_cannot_check_either_is_refused(nothing_checked, monkeypatch):
    """Every call over the limit, the twin's too: the twin runs, checks nothing, and the dry run is refused (not
    passed because a twin ran)."""
    monkeypatch.setattr(fake_check, "MAX_CHECK_BYTES", 1)
    seen = []
    check_calls = fake_check.check_calls
    monkeypatch.setattr(dryrun, "check_calls", lambda calls, *a: seen.append(calls) or check_calls(calls, *a))
    with pytest.raises(DryRunError, match=r"the course GPT uses aten\.\S+.* only at calls over .* smaller instance"):
        dry_run_config(batch_size=2, **SMALL)
    assert len(seen) == 2 and seen[1]  # the full-size run, then its small twin: it ran, and noted calls


def _padded_model_calls(rows: int) -> dict:
    """The op calls of a dry run of UsesAWrongFakeKernel on ``rows`` rows (checked by nothing yet)."""
    return dryrun._run_fake(
        UsesAWrongFakeKernel, lambda s: (torch.empty(rows, 8),), lambda m, b: m(*b).sum(), make_optimizer,
        2, None, True, "cpu",
    )[1]  # fmt: skip


def test_the_small_twin_checks_what_the_full_run_could_not(nothing_checked, monkeypatch):
    """padded_copy's fake kernel is wrong; the full-size run's calls of it are over the limit, its twin's under."""
    monkeypatch.setattr(fake_check, "MAX_CHECK_BYTES", 4096)  # 512 x 8 float32 rows: 16 KiB; 3 x 8: 96 B
    big = _padded_model_calls(512)
    padded = [key for key in big if "padded_copy" in str(key[0])]
    assert padded and all(big[key].nbytes > 4096 for key in padded)
    # a twin with the same code paths finds the difference: refused naming the op, the module and the difference
    with pytest.raises(DryRunError, match=r"anatomy_test\.padded_copy\.default \(first seen in module 'model'") as err:
        dryrun.check_ops(big, "the model", lambda: _padded_model_calls(3))
    assert "(3, 8) float32 at offset 0 of storage 1 (96 B) in the fake run" in str(err.value)
    assert "only at calls over" not in str(err.value)
    # a twin that never calls padded_copy leaves its signature unchecked: refused, naming it, not passed
    fake_check._FAILED.clear()

    def plain_twin():
        return dryrun._run_fake(
            lambda: nn.Linear(8, 8), lambda s: (torch.empty(3, 8),), lambda m, b: m(*b).sum(), make_optimizer,
            2, None, True, "cpu",
        )[1]  # fmt: skip

    with pytest.raises(DryRunError, match=r"uses anatomy_test\.padded_copy\.default only at calls over"):
        dryrun.check_ops(big, "the model", plain_twin)


# ---- a signature keeps the dtype: a check in float32 does not stand for bfloat16 -----------------------------------


@torch.library.custom_op("anatomy_test::padded_in_bf16", mutates_args=())
def padded_in_bf16(x: torch.Tensor) -> torch.Tensor:
    # a dtype-specific path: in bfloat16, x's values in a storage twice x's size; otherwise an exact copy
    return torch.cat([x, x])[: x.shape[0]] if x.dtype == torch.bfloat16 else x.clone()


@padded_in_bf16.register_fake
def _(x):
    return torch.empty_like(x)  # right in float32; half the real storage in bfloat16


padded_in_bf16.register_autograd(lambda ctx, grad: grad)


class UsesAFakeKernelWrongInBf16(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x):
        return padded_in_bf16(self.lin(x))


def test_an_op_checked_in_float32_is_checked_again_in_bfloat16(nothing_checked):
    def dry(dtype):
        model = lambda: UsesAFakeKernelWrongInBf16(dtype)  # noqa: E731
        return dry_run(model, lambda s: (torch.empty(3, 8, dtype=dtype),), lambda m, b: m(*b).float().sum())

    dry(torch.float32)  # the fake kernel is right in float32: checked, passed, remembered
    with pytest.raises(DryRunError, match=r"anatomy_test\.padded_in_bf16\.default \(first seen in module 'model'") as e:
        dry(torch.bfloat16)
    assert "(3, 8) bfloat16 at offset 0 of storage 1 (48 B) in the fake run" in str(e.value)
    assert "(3, 8) bfloat16 at offset 0 of storage 1 (96 B) for real" in str(e.value)


class SparseLookup(nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=sparse)
        self.lin = nn.Linear(16, 50)

    def forward(self, x):
        return self.lin(self.emb(x))


def test_a_sparse_gradient_is_refused_by_the_dry_run_and_the_tracker_naming_it():
    """nn.Embedding(sparse=True): its gradient is a sparse COO tensor, whose bytes neither the tracker (strided
    storages) nor a fake tensor measures; was a raw NotImplementedError from fake_check."""

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    with pytest.raises(DryRunError, match=r"^emb \(Embedding\(sparse=True\)\) gets a sparse gradient"):
        dry_run(SparseLookup, token_batch, token_loss, sgd)
    model = SparseLookup()
    with pytest.raises(ValueError, match=r"^emb \(Embedding\(sparse=True\)\) gets a sparse gradient"):
        StepTracker(model, sgd(model))
    dry_run(lambda: SparseLookup(sparse=False), token_batch, token_loss, sgd)  # the dense one runs


def test_a_sparse_tensor_made_in_the_step_is_refused(nothing_checked):
    def sparse_loss(model, batch):
        return token_loss(model, batch) + model.lin.weight.to_sparse().values().sum()

    with pytest.raises(DryRunError, match="has no storage .*non-strided layout"):
        dry_run(lambda: SparseLookup(sparse=False), token_batch, sparse_loss, lambda m: torch.optim.SGD(m.parameters()))
