"""Dense mixed precision (docs/contract.md §6): FP16 products, scalers, skipped steps, underflow."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlrm.mixed_precision import (
    BackoffScaler,
    Linear,
    LogMaxScaler,
    MixedPrecisionEmbedding,
    MixedPrecisionTrainer,
    StaticScaler,
    bmm,
    linear,
    make_scaler,
)
from dlrm.model import DLRM, SPARSE_KEYS
from dlrm.torchrec_adapter import make_torchrec_ebc

ROWS = (7, 5, 9)
KEYS = SPARSE_KEYS[: len(ROWS)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _grid(shape, gen):
    """FP16 values k / 64, |k| <= 64: their products and short sums are exact in FP32 and FP64,
    so an FP32 GEMM over them is the exact result and a float64 reference is independent."""
    return (torch.randint(-64, 65, shape, generator=gen) / 64.0).half()


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- FP16 products


def test_emulated_linear_is_fp32_gemm_rounded_once():
    gen = torch.Generator().manual_seed(0)
    x, w, b = _grid((8, 32), gen), _grid((16, 32), gen), _grid((16,), gen)
    y = linear(x, w, b)
    assert y.dtype == torch.float16
    exact = x.double() @ w.double().t() + b.double()  # exact: needs < 24 bits
    assert torch.equal(_bits(y), _bits(exact.half()))
    # not the FP32 result (rounding to FP16 happened) ...
    assert not torch.equal(y.float(), F.linear(x.float(), w.float(), b.float()))
    # ... and rounded once: the bias was added before the rounding, not after
    assert not torch.equal(y, (x.double() @ w.double().t()).half() + b)


def test_emulated_linear_backward_is_fp16_and_rounded_once():
    gen = torch.Generator().manual_seed(1)
    x, w, b, g = _grid((8, 32), gen), _grid((16, 32), gen), _grid((16,), gen), _grid((8, 16), gen)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    linear(x, w, b).backward(g)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float16
    assert torch.equal(_bits(x.grad), _bits((g.double() @ w.double()).half()))
    assert torch.equal(_bits(w.grad), _bits((g.double().t() @ x.double()).half()))
    assert torch.equal(_bits(b.grad), _bits(g.double().sum(0).half()))


def test_linear_module_matches_function_and_fp32_is_native():
    layer = Linear(5, 3)
    x = torch.randn(4, 5)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.half()
    assert torch.equal(layer(x.half()), linear(x.half(), layer.weight, layer.bias))
    with pytest.raises(TypeError, match="operands must share one dtype"):
        linear(x, layer.weight, layer.bias)


def test_emulated_bmm_forward_and_backward():
    gen = torch.Generator().manual_seed(2)
    a, b, g = _grid((3, 5, 8), gen), _grid((3, 8, 6), gen), _grid((3, 5, 6), gen)
    a.requires_grad_(), b.requires_grad_()
    c = bmm(a, b)
    assert c.dtype == torch.float16
    assert torch.equal(_bits(c), _bits((a.double() @ b.double()).half()))
    assert not torch.equal(c.float(), torch.bmm(a.float(), b.float()))
    c.backward(g)
    assert a.grad.dtype == b.grad.dtype == torch.float16
    assert torch.equal(_bits(a.grad), _bits((g.double() @ b.double().transpose(1, 2)).half()))
    assert torch.equal(_bits(b.grad), _bits((a.double().transpose(1, 2) @ g.double()).half()))


# --------------------------------------------------------------------------- scalers


def _grad_scaler_sequence(pattern, **kwargs):
    """Scales of torch.amp.GradScaler after each step, with inf injected where pattern is True."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scales = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if overflow:
            model.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _sequence(scaler, pattern):
    scales = []
    for overflow in pattern:
        scaler.update(overflow, math.inf if overflow else 1.0)
        scales.append(scaler.scale)
    return scales


def test_backoff_without_clamp_reproduces_grad_scaler():
    gen = torch.Generator().manual_seed(3)
    # 20 overflows in a row drive the scale below 1, then a random pattern makes it grow again
    pattern = [True] * 20 + (torch.rand(300, generator=gen) < 0.1).tolist()
    kwargs = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=5)
    expected = _grad_scaler_sequence(pattern, **kwargs)
    assert min(expected) < 1 and any(b > a for a, b in zip(expected, expected[1:]))
    assert _sequence(BackoffScaler(**kwargs, clamp=False), pattern) == expected

    clamped = _sequence(BackoffScaler(**kwargs), pattern)
    assert min(clamped) == 1.0 and clamped != expected


def test_backoff_defaults_reproduce_grad_scaler():
    pattern = [False] * 4200
    pattern[100] = pattern[101] = True  # 2^16 -> 2^14, then growth at steps 2101 and 4101
    expected = _grad_scaler_sequence(pattern)  # GradScaler's defaults: 2^16, x2, x0.5, 2000
    assert expected[2100:2102] == [2.0**14, 2.0**15] and expected[-1] == 2.0**16
    assert _sequence(BackoffScaler(clamp=False), pattern) == expected


def test_backoff_clamps_to_2_pow_24():
    scaler = BackoffScaler(init_scale=2.0**23, growth_interval=1)
    assert _sequence(scaler, [False] * 3) == [2.0**24] * 3


def test_logmax_matches_hand_computation():
    b1, b2, k = 0.99, 0.999, 3.09
    scaler = make_scaler("logmax")
    assert isinstance(scaler, LogMaxScaler) and scaler.scale == 1.0
    steps = [
        (False, 2.0**-3),
        (False, 0.5),
        (True, math.inf),
        (False, 2.0**-10),
        (False, 0.0),
        (False, 3.0),
    ]
    xs = []
    for t, (found_inf, max_abs) in enumerate(steps, start=1):
        if found_inf:
            xs.append(16.0)  # a non-finite max counts as log2 value 16
        elif max_abs == 0.0:
            xs.append(math.log2(2.0**-24 / scaler.scale))  # everything underflowed
        else:
            xs.append(math.log2(max_abs))
        scaler.update(found_inf, max_abs)
        # closed forms of the bias-corrected exponential averages over x_1..x_t
        mu = sum((1 - b1) * b1 ** (t - i) * x for i, x in enumerate(xs, start=1)) / (1 - b1**t)
        mean2 = sum((1 - b2) * b2 ** (t - i) * x for i, x in enumerate(xs, start=1)) / (1 - b2**t)
        sq2 = sum((1 - b2) * b2 ** (t - i) * x * x for i, x in enumerate(xs, start=1)) / (1 - b2**t)
        sigma = math.sqrt(max(sq2 - mean2**2, 0.0))
        expected = min(max(2.0 ** (16 - (mu + k * sigma)), 1.0), 2.0**24)
        assert scaler.scale == pytest.approx(expected, rel=1e-12)
        if t == 1:
            assert scaler.scale == 2.0**19  # mu = -3, sigma = 0


def test_make_scaler_and_static():
    scaler = make_scaler("static", scale=1024.0)
    assert isinstance(scaler, StaticScaler)
    assert _sequence(scaler, [True, False]) == [1024.0, 1024.0]
    assert isinstance(make_scaler("backoff"), BackoffScaler)
    with pytest.raises(ValueError, match="unknown loss scaler 'nope'"):
        make_scaler("nope")


# --------------------------------------------------------------------------- the training step


class FakeCachedEmbedding(nn.Module):
    """Stand-in for the library's cached collection: FP32 tables, its own SGD, the protocol."""

    def __init__(self, rows, dim, lr=0.1):
        super().__init__()
        self.dim, self.lr, self.inject_nonfinite = dim, lr, False
        self.tables = nn.ParameterList(nn.Parameter(0.1 * torch.randn(r, dim)) for r in rows)
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def feature_dims(self):
        return [self.dim] * len(self.tables)

    def forward(self, ids):
        return torch.cat([F.embedding(ids[:, k], t) for k, t in enumerate(self.tables)], 1)

    def has_nonfinite_grad(self):
        return self.inject_nonfinite or any(
            not bool(torch.isfinite(t.grad).all()) for t in self.tables
        )

    def unscale_grad_(self, inv_scale):
        for t in self.tables:
            t.grad.mul_(inv_scale)

    def step(self):
        with torch.no_grad():
            for t in self.tables:
                t -= self.lr * t.grad
        self.updates += 1
        self.zero_grad()

    def zero_grad(self, set_to_none=True):
        for t in self.tables:
            t.grad = None


class FakeWithPendingGrads(FakeCachedEmbedding):
    """The stand-in, showing its gradients to the trainer (as the library's collection does):
    the trainer's pass over them then decides the overflow, not ``has_nonfinite_grad``."""

    def pending_grads(self):
        return [t.grad for t in self.tables if t.grad is not None]


def _data(seed, batch=16):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, r, (batch,), generator=gen) for r in ROWS], 1)
    dense = torch.rand(batch, 13, generator=gen)
    labels = ((dense[:, 0] + (ids[:, 0] % 2)) > 1.0).float()
    return dense, ids, labels


def _trainer(embedding, seed=0, dense_precision="fp16", **kwargs):
    torch.manual_seed(seed)
    fakes = {"fake": FakeCachedEmbedding, "fake_pending": FakeWithPendingGrads}
    emb = fakes[embedding](ROWS, 4) if embedding in fakes else make_torchrec_ebc(ROWS, 4, KEYS)
    model = DLRM(emb, bottom_mlp=(13, 8, 4), top_mlp=(8, 1), num_sparse_features=len(ROWS))
    kwargs.setdefault("scaler", BackoffScaler(growth_interval=2))
    return MixedPrecisionTrainer(
        model,
        dense_precision=dense_precision,
        optimizer="adam",
        lr=0.01,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
        **kwargs,
    )


def _assert_same_bytes(a, b, where="state"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_bytes(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_bytes(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), where
    else:
        assert a == b, where


def _without_scaling(state):
    return {k: v for k, v in copy.deepcopy(state).items() if k not in ("scaler", "report")}


@pytest.mark.parametrize(
    "embedding, inject",
    [
        ("fake", "embedding"),
        ("fake_pending", "embedding"),
        ("torchrec", "embedding"),
        ("torchrec", "dense"),
        ("fake", "dense"),
    ],
)
def test_nonfinite_gradient_skips_the_whole_step(embedding, inject):
    trainer = _trainer(embedding)
    assert isinstance(trainer.model.embedding_collection, MixedPrecisionEmbedding) == (
        embedding != "torchrec"
    )
    for step in range(3):  # populate Adam and scheduler state
        assert not trainer.train_step(*_data(step))["skipped"]
    before = _without_scaling(trainer.state_dict())
    scale = trainer.scaler.scale

    handle = None
    if inject == "dense":
        trainer.scaler.scale = scale = 2.0**24  # the largest scale: FP16 gradients overflow
    elif embedding == "fake":
        trainer.model.embedding_collection.inject_nonfinite = True
    else:  # a NaN in the gradient itself
        collection = trainer.model.embedding_collection
        tables = collection.tables if embedding == "fake_pending" else collection.embedding_bags
        weight = tables[1] if embedding == "fake_pending" else tables["t_1"].weight
        handle = weight.register_hook(lambda g: torch.full_like(g, math.nan))
    result = trainer.train_step(*_data(3))
    if handle is not None:
        handle.remove()

    assert result["skipped"] and result["scale"] == scale
    assert trainer.scaler.scale == scale / 2
    assert trainer.report.skipped == 1 and trainer.report.steps == 4
    assert trainer.report.scale_trace[-1] == (4, scale / 2)
    _assert_same_bytes(before, _without_scaling(trainer.state_dict()))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(m.grad is None for m in trainer.masters)

    if embedding == "fake":
        trainer.model.embedding_collection.inject_nonfinite = False
    trainer.scaler.scale = 2.0**10
    assert not trainer.train_step(*_data(4))["skipped"]
    if embedding != "torchrec":
        assert int(trainer.model.embedding_collection.updates) == 4


def test_resume_is_bit_identical():
    first = _trainer("fake", seed=0)
    for step in range(4):
        first.train_step(*_data(step))
    saved = copy.deepcopy(first.state_dict())

    def continue_run(trainer):
        losses = []
        for step in range(4, 9):
            trainer.model.embedding_collection.inject_nonfinite = step == 6
            losses.append(trainer.train_step(*_data(step)))
        return losses, trainer.state_dict()

    second = _trainer("fake", seed=123)
    second.load_state_dict(saved)
    losses_a, state_a = continue_run(first)
    losses_b, state_b = continue_run(second)
    assert losses_a == losses_b and any(r["skipped"] for r in losses_a)
    _assert_same_bytes(state_a, state_b)
    assert first.report.scale_trace == second.report.scale_trace


def test_fp32_trainer_keeps_fp32_and_no_masters():
    """dense_precision="fp32" with a static scale of 1 is plain FP32 training: no master copies,
    FP32 parameters, and the same losses and parameters, bit for bit, as an independent
    loop of the same Adam + StepLR over a copy of the model (the trainer's unscaling by 1,
    overflow check and split dense/embedding update change nothing)."""
    trainer = _trainer("torchrec", dense_precision="fp32", scaler=StaticScaler(1.0))
    reference = copy.deepcopy(trainer.model)
    assert trainer.masters == []
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    losses, expected = [], []
    for step in range(6):
        dense, sparse, labels = _data(step)
        losses.append(trainer.train_step(dense, sparse, labels)["loss"])
        loss = F.binary_cross_entropy_with_logits(reference(dense, sparse).reshape(-1), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        expected.append(loss.item())
    assert losses == expected and trainer.report.skipped == 0
    assert losses[-1] < losses[0]
    ours, theirs = dict(trainer.model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.dtype == torch.float32 and torch.equal(_bits(p), _bits(theirs[name])), name


class _UnderflowModel(nn.Module):
    """The seed paper's phenomenon in miniature: activation gradients below FP16's 2^-24.

    The hidden layer starts at W = 0, b = 1, so h = 1 carries no information and only the
    hidden layer's gradient can make it useful. That gradient is ``dL/dh = g * w_out`` with
    ``|g| = 2^-7`` (mean loss over 64 samples) and ``|w_out| <= 2^-19``: at most 2^-26, which is
    0 in FP16. The output layer's own gradient ``sum_i g_i h`` is exactly 0 (balanced labels).
    So without loss scaling every gradient is 0 and nothing moves; with a scale it learns.
    """

    embedding_collection = None

    def __init__(self):
        super().__init__()
        self.hidden, self.out = Linear(4, 8), Linear(8, 1)
        with torch.no_grad():
            self.hidden.weight.zero_()
            self.hidden.bias.fill_(1.0)
            self.out.weight.uniform_(-(2.0**-19), 2.0**-19)
            self.out.bias.zero_()

    def forward(self, dense, sparse):
        h = torch.relu(self.hidden(dense.to(self.out.weight.dtype)))
        return self.out(h).float().squeeze(-1)


@pytest.mark.parametrize(
    "precision, scaler, learns",
    [
        ("fp32", "static 1", True),
        ("fp16", "static 1", False),
        ("fp16", "static 2^10", True),
        ("fp16", "backoff", True),
    ],
)
def test_fp16_underflow_needs_loss_scaling(precision, scaler, learns):
    gen = torch.Generator().manual_seed(0)
    half = torch.randn(32, 4, generator=gen)
    dense = torch.cat([half, -half])  # exactly balanced labels
    labels = (dense[:, 0] > 0).float()
    torch.manual_seed(0)
    scaler = {
        "static 1": StaticScaler(1.0),
        "static 2^10": StaticScaler(2.0**10),
        "backoff": BackoffScaler(),
    }[scaler]
    trainer = MixedPrecisionTrainer(
        _UnderflowModel(), dense_precision=precision, optimizer="adam", lr=0.05, scaler=scaler
    )
    losses = [trainer.train_step(dense, None, labels)["loss"] for _ in range(60)]
    if learns:
        assert losses[-1] < 0.2
    else:
        assert losses[-1] == losses[0] == pytest.approx(math.log(2), abs=1e-4)
        assert trainer.report.max_abs_grad == 0.0
    assert trainer.report.skipped == 0


def test_gradient_range_is_one_pass_equal_to_float64():
    """The overflow check's (max |g|, min non-zero |g|), against numpy in float64: several
    tensors of sizes around the op's chunk, zeros (signed), subnormals; then inf and NaN
    (NaN wins both); empty tensors and none at all."""
    import numpy as np

    from dlrm.mixed_precision.trainer import _abs_range

    def strided(tensors):  # not contiguous: torch's reductions
        return [torch.stack([g, g], 1)[:, 0] for g in tensors]

    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = [
            torch.randn(n, generator=gen)
            * 10.0 ** float(torch.randint(-30, 5, (1,), generator=gen))
            for n in (0, 1, 65535, 65537, 200_000)
        ]
        grads[2][::7] = 0.0
        grads[3][::5] = -0.0
        grads[4][3] = 1e-42  # a subnormal: the smallest non-zero
        flat = np.abs(np.concatenate([g.numpy().astype(np.float64) for g in grads]))
        expected = [flat.max(), flat[flat > 0].min()]
        assert _abs_range(grads).tolist() == expected
        assert _abs_range(strided(grads)).tolist() == expected
    grads[1][0] = -float("inf")
    assert _abs_range(grads)[0] == float("inf") == _abs_range(strided(grads))[0]
    grads[3][100] = float("nan")
    assert all(math.isnan(x) for x in _abs_range(grads).tolist())
    assert all(math.isnan(x) for x in _abs_range(strided(grads)).tolist())
    assert _abs_range([torch.zeros(3), torch.zeros(0)]).tolist() == [0.0, float("inf")]
    assert _abs_range([]).tolist() == [0.0, float("inf")]


def test_unscale_and_range_in_one_pass_equal_mul_then_range():
    """The trainer's unscale fused into the range: the same bits as ``g.mul_(inv_scale)`` for
    every element, and the range of the products, on the CPU op and on torch's path (a
    non-contiguous tensor takes it)."""
    from dlrm.mixed_precision.trainer import _abs_range, _unscale_abs_range

    gen = torch.Generator().manual_seed(1)
    for inv_scale in (1.0, 2.0**-13, 0.1, 3.0e-39 / 2.0**-100):
        grads = [
            torch.randn(n, generator=gen)
            * 2.0 ** float(torch.randint(-20, 20, (1,), generator=gen))
            for n in (0, 5, 70_000)
        ]
        expected = [g.clone().mul_(inv_scale) for g in grads]
        got = _unscale_abs_range(grads, inv_scale)
        assert all(
            torch.equal(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(grads, expected)
        )
        assert torch.equal(got, _abs_range(expected))
        strided = torch.randn(40, 6, generator=gen).t()  # not contiguous: torch's path
        reference = strided.clone().mul_(inv_scale)
        assert torch.equal(_unscale_abs_range([strided], inv_scale), _abs_range([reference]))
        assert torch.equal(strided, reference)


@pytest.mark.parametrize("value,refused", [(65519.99, False), (65520.0, True), (-7.0e4, True)])
def test_the_fp16_overflow_check_is_the_conversions_own(value, refused):
    """A master refused for FP16 exactly when its FP16 copy would be infinite (65519.99 rounds
    down to 65504, 65520 up to inf): the check reads the masters, it does not convert them."""
    from dlrm.mixed_precision.trainer import FP16_OVERFLOW

    x = torch.tensor([value], dtype=torch.float32)
    assert (not bool(torch.isfinite(x.half()).all())) == refused
    assert (abs(float(x)) >= FP16_OVERFLOW) == refused
