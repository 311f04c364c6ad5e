"""Our drop-ins against PyTorch's own modules as the oracle (issue 48): nn.EmbeddingBag /
F.embedding_bag for CachedLowPrecisionEmbedding, nn.Embedding for
CachedLowPrecisionUnpooledEmbedding, over the behaviours PyTorch's tests cover (modes, offsets,
empty bags, 1-D and 2-D input, padding_idx, per_sample_weights, include_last_offset, int32 and
int64 ids, constructor arguments, refusals).

* Values and gradients at FP32 without a cache: the output is PyTorch's, and the rows after one
  step() of SGD with lr 1 are PyTorch's ``weight - weight.grad``.
* Conventions at every precision behind a cache: the output's shape and dtype are PyTorch's,
  its values those PyTorch pools from the table's own current rows, and what PyTorch refuses is
  refused with a ValueError that changes nothing (every state byte and statistic).
* On CUDA too where a GPU is present.

The differences that remain are listed, with their reasons, in docs/contract.md §8.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from embcache import CachedLowPrecisionEmbedding, CachedLowPrecisionUnpooledEmbedding

ROWS, DIM, PAD = 64, 5, 3
PRECISIONS = ["fp32", "fp16", "int8", "int4", "int2"]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]
# FP32 without a cache: values comparable with PyTorch's; SGD with lr 1: a step is w - grad
EXACT = dict(precision="fp32", cache_ratio=0, lr=1.0, min_rows_for_low_precision=0)
# behind a cache that holds some rows after one step
CACHED = dict(cache_ratio=0.5, associativity=4, lr=0.5, min_rows_for_low_precision=0)
# PyTorch's refusals: a ValueError in Python, a RuntimeError or IndexError from its kernels,
# a NotImplementedError for per-sample weights with mean
REFUSED = (ValueError, RuntimeError, IndexError, NotImplementedError)


def _ids(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, ROWS, shape, generator=gen)


def _weight(gen: torch.Generator, ties: bool) -> torch.Tensor:
    """Random rows; with ``ties``, of a few values (halves in [-1, 1], zeros of either sign),
    so that a bag's maximum is often held by several rows."""
    if not ties:
        return torch.randn(ROWS, DIM, generator=gen)
    sign = torch.randint(0, 2, (ROWS, DIM), generator=gen) * 2.0 - 1.0
    return torch.randint(-2, 3, (ROWS, DIM), generator=gen) * 0.5 * sign


def _pooled_cases() -> dict:
    """name: (nn.EmbeddingBag's options, forward(input, offsets, per_sample_weights) as a
    function of a generator), every input fresh and random. PyTorch's mode default is not
    named here: the cases without ``mode`` test that it is ours. Cases named with "ties" are
    looked up in rows of a few values (:func:`_weight`)."""
    psw = lambda gen, *shape: torch.rand(shape, generator=gen)  # noqa: E731

    def bags(gen, most=4):
        lengths = torch.randint(0, most + 1, (7,), generator=gen)
        lengths[0] = 0  # an empty bag, first: offsets [0, 0, ...]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        return _ids(gen, int(lengths.sum())), offsets

    def padded(gen):
        ids, offsets = bags(gen, most=5)
        ids[torch.rand(ids.shape, generator=gen) < 0.4] = PAD
        last = torch.tensor([ids.numel()])  # a last bag of padding only
        return torch.cat([ids, torch.tensor([PAD, PAD])]), torch.cat([offsets, last])

    def ended(gen, past=0, weighted=False):
        """For include_last_offset: offsets ending with the bags' ids, ``past`` ids after."""
        ids, offsets = bags(gen)
        ends = torch.cat([offsets, torch.tensor([ids.numel()])])
        ids = torch.cat([ids, _ids(gen, past)])
        return ids, ends, psw(gen, ids.numel()) if weighted else None

    return {
        "default mode, bags with empty ones": ({}, lambda g: (*bags(g), None)),
        "sum, bags with empty ones": ({"mode": "sum"}, lambda g: (*bags(g), None)),
        "mean, 2-D input": ({"mode": "mean"}, lambda g: (_ids(g, 6, 3), None, None)),
        "sum, 2-D input, include_last_offset unread": (
            {"mode": "sum", "include_last_offset": True},
            lambda g: (_ids(g, 4, 2), None, None),
        ),
        "mean, no bags": ({"mode": "mean"}, lambda g: (_ids(g, 5), torch.tensor([]).long(), None)),
        "sum, no ids": ({"mode": "sum"}, lambda g: (_ids(g, 0), torch.zeros(3).long(), None)),
        "mean, include_last_offset": ({"mode": "mean", "include_last_offset": True}, ended),
        "sum, include_last_offset, ids past the last": (
            {"mode": "sum", "include_last_offset": True},
            lambda g: ended(g, past=3),
        ),
        "sum, include_last_offset, one offset": (
            {"mode": "sum", "include_last_offset": True},
            lambda g: (_ids(g, 4), torch.zeros(1).long(), None),
        ),
        "sum, padding_idx": ({"mode": "sum", "padding_idx": PAD}, lambda g: (*padded(g), None)),
        "mean, padding_idx from the end": (
            {"mode": "mean", "padding_idx": PAD - ROWS},
            lambda g: (*padded(g), None),
        ),
        "sum, per_sample_weights": (
            {"mode": "sum"},
            lambda g: (lambda i, o: (i, o, psw(g, i.numel())))(*bags(g)),
        ),
        "sum, 2-D input and per_sample_weights": (
            {"mode": "sum"},
            lambda g: (_ids(g, 5, 3), None, psw(g, 5, 3)),
        ),
        "sum, per_sample_weights past the last offset": (
            {"mode": "sum", "include_last_offset": True},
            lambda g: ended(g, past=3, weighted=True),
        ),
        "sum, per_sample_weights and padding_idx": (
            {"mode": "sum", "padding_idx": PAD},
            lambda g: (lambda i, o: (i, o, psw(g, i.numel())))(*padded(g)),
        ),
        "max, bags with empty ones": ({"mode": "max"}, lambda g: (*bags(g), None)),
        "max, ties, bags with empty ones": ({"mode": "max"}, lambda g: (*bags(g, most=8), None)),
        "max, ties, 2-D input": ({"mode": "max"}, lambda g: (_ids(g, 6, 5), None, None)),
        "max, no bags": ({"mode": "max"}, lambda g: (_ids(g, 0), torch.tensor([]).long(), None)),
        "max, include_last_offset, ids past the last": (
            {"mode": "max", "include_last_offset": True},
            lambda g: ended(g, past=3),
        ),
        "max, ties, padding_idx": (
            {"mode": "max", "padding_idx": PAD},
            lambda g: (*padded(g), None),
        ),
    }


POOLED = _pooled_cases()


def _pooled_refusals() -> dict:
    """name: (nn.EmbeddingBag's options, (input, offsets, per_sample_weights)): calls that
    PyTorch refuses."""
    ids, off = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    f64 = torch.ones(4, dtype=torch.float64)
    return {
        "index too large": ({}, (torch.tensor([1, ROWS]), torch.tensor([0]), None)),
        "negative index": ({}, (torch.tensor([1, -1]), torch.tensor([0]), None)),
        "float input": ({}, (ids.float(), off, None)),
        "3-D input": ({}, (ids.view(1, 2, 2), None, None)),
        "1-D input without offsets": ({}, (ids, None, None)),
        "2-D input with offsets": ({}, (ids.view(2, 2), off, None)),
        "2-D offsets": ({}, (ids, off.view(1, 2), None)),
        "offsets not from 0": ({}, (ids, torch.tensor([1, 2]), None)),
        "offsets past the input": ({}, (ids, torch.tensor([0, 5]), None)),
        "decreasing offsets": ({}, (ids, torch.tensor([0, 3, 2]), None)),
        "last offset past the input": (
            {"include_last_offset": True},
            (ids, torch.tensor([0, 2, 5]), None),
        ),
        "include_last_offset without offsets": (
            {"include_last_offset": True},
            (ids, torch.tensor([]).long(), None),
        ),
        "padded, offsets not from 0": (
            {"padding_idx": PAD},
            (torch.tensor([PAD, 1, 2, PAD]), torch.tensor([1, 3]), None),
        ),
        "padded, index too large": (
            {"padding_idx": PAD},
            (torch.tensor([PAD, ROWS]), torch.tensor([0]), None),
        ),
        "per_sample_weights with mean": ({"mode": "mean"}, (ids, off, torch.ones(4))),
        "per_sample_weights with max": ({"mode": "max"}, (ids, off, torch.ones(4))),
        "per_sample_weights float64": ({"mode": "sum"}, (ids, off, f64)),
        "per_sample_weights float16": ({"mode": "sum"}, (ids, off, f64.half())),
        "per_sample_weights shorter": ({"mode": "sum"}, (ids, off, torch.ones(3))),
        "2-D input [7, 3], 1-D per_sample_weights of 21": (
            {"mode": "sum"},
            (torch.zeros(7, 3).long(), None, torch.ones(21)),
        ),
    }


POOLED_REFUSALS = _pooled_refusals()


def _in_bags(options: dict, ids, offsets, psw) -> tuple:
    """The input without the ids past the last offset (with ``include_last_offset``), which
    are in no bag: PyTorch's backward gives them uninitialised gradients, and its max forward
    pools them into the last bag (docs/contract.md §8), so PyTorch's result from the ids in
    bags alone is the oracle there."""
    if not options.get("include_last_offset") or offsets is None:
        return ids, offsets, psw
    end = int(offsets[-1])
    return ids[:end], offsets, None if psw is None else psw[:end]


def _to(device, *tensors):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def _state(table) -> tuple[dict, dict]:
    tensors = {k: v.clone() for k, v in table.state_dict().items() if isinstance(v, torch.Tensor)}
    return tensors, table.stats()


def _assert_unchanged(before: tuple[dict, dict], table) -> None:
    tensors, stats = _state(table)
    assert tensors.keys() == before[0].keys()
    for key, value in tensors.items():
        assert torch.equal(value, before[0][key]), key
    assert stats == before[1]


def _train_once(table, gen, device):
    """A step on random ids: the cache holds rows, the step count and statistics move."""
    out = table(_ids(gen, 24, 2).to(device))
    out.backward(torch.randn(out.shape, generator=gen).to(device))
    table.step()


# --------------------------------------------------------------------------- nn.EmbeddingBag


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("case", list(POOLED))
def test_fp32_values_and_step_are_embedding_bags(case, index_dtype, device):
    options, make = POOLED[case]
    gen = torch.Generator().manual_seed(list(POOLED).index(case))
    weight = _weight(gen, "ties" in case)
    ref = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, **options).to(device)
    ours = CachedLowPrecisionEmbedding.from_pretrained(weight, device=device, **options, **EXACT)
    ids, offsets, psw = make(gen)
    ids = ids.to(index_dtype)
    offsets = None if offsets is None else offsets.to(index_dtype)
    grad_psw = psw is not None
    ids, offsets, psw, psw_ref = _to(device, ids, offsets, psw, psw)
    if grad_psw:
        psw, psw_ref = psw.clone().requires_grad_(), psw_ref.clone().requires_grad_()

    in_bags = _in_bags(options, ids, offsets, psw_ref)
    want = ref(*(in_bags if options.get("mode") == "max" else (ids, offsets, psw_ref)))
    got = ours(ids, offsets, per_sample_weights=psw)
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    want = ref(*in_bags)  # the gradient's oracle
    grad = torch.randn(want.shape, generator=gen).to(device)
    got.backward(grad)
    ours.step()
    if want.shape[0] == 0:  # no bags: no gradient (PyTorch's backward crashes on ids in none)
        expected = ref.weight.detach()
    else:
        want.backward(grad)
        expected = ref.weight.detach() - ref.weight.grad  # SGD, lr 1
    torch.testing.assert_close(ours.weight, expected, rtol=1e-6, atol=1e-6)
    if "padding_idx" in options:
        assert torch.equal(ours.weight[PAD], weight[PAD].to(device))  # never updated
    if grad_psw:
        torch.testing.assert_close(psw.grad, psw_ref.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", list(POOLED))
def test_cached_tables_pool_their_rows_as_embedding_bag(case, precision, device):
    """Behind a cache, in every format: PyTorch's shape and dtype, and the bags PyTorch pools
    from the table's own current rows (cache over table)."""
    options, make = POOLED[case]
    gen = torch.Generator().manual_seed(100 + list(POOLED).index(case))
    ours = CachedLowPrecisionEmbedding(
        ROWS, DIM, precision=precision, device=device, **options, **CACHED
    )
    _train_once(ours, gen, device)
    assert bool((ours.cache_tags >= 0).any())
    ids, offsets, psw = _to(device, *make(gen))
    rows = ours.weight
    mode = options.get("mode", "mean")
    ref_ids, ref_offsets, ref_psw = _in_bags(options, ids, offsets, psw)
    if mode != "max":  # else PyTorch pools the ids past the last offset too (_in_bags)
        ref_ids, ref_psw = ids, psw
    want = F.embedding_bag(
        ref_ids,
        rows,
        ref_offsets,
        mode=mode,
        per_sample_weights=ref_psw,
        include_last_offset=options.get("include_last_offset", False),
        padding_idx=options.get("padding_idx"),
    )
    got = ours(ids, offsets, per_sample_weights=psw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# torch 2.13 on the CPU refuses decreasing offsets on two threads and reads them on one
# (docs/contract.md §8): ours refuses them on every thread count
PYTORCH_REFUSES_ON_SOME_THREAD_COUNTS = {"decreasing offsets"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", list(POOLED_REFUSALS))
def test_what_embedding_bag_refuses_is_refused_changing_nothing(case, precision, device):
    options, args = POOLED_REFUSALS[case]
    if case not in PYTORCH_REFUSES_ON_SOME_THREAD_COUNTS:
        with pytest.raises(REFUSED):  # on the CPU: on a GPU a bad index is a device-side assert
            nn.EmbeddingBag(ROWS, DIM, **options)(*args)
    ids, offsets, psw = _to(device, *args)
    ours = CachedLowPrecisionEmbedding(
        ROWS, DIM, precision=precision, device=device, name="t", **options, **CACHED
    )
    _train_once(ours, torch.Generator().manual_seed(0), device)
    before = _state(ours)
    with pytest.raises(ValueError, match="table 't': "):
        ours(ids, offsets, per_sample_weights=psw)
    _assert_unchanged(before, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "max"])
def test_where_pytorch_is_defective_ours_follows_its_forward(mode, device):
    """docs/contract.md §8: a 2-D input of bags of no ids gives empty bags (PyTorch raises);
    ids in no bag (no offsets) give no bags (PyTorch's max forward crashes) and get no
    gradient (PyTorch's backward crashes)."""
    ours = CachedLowPrecisionEmbedding(ROWS, DIM, device=device, mode=mode, **EXACT)
    out = ours(torch.zeros(4, 0, dtype=torch.int64, device=device))
    assert torch.equal(out, torch.zeros(4, DIM, device=device))
    ids, offsets = _to(device, _ids(torch.Generator(), 5), torch.zeros(0, dtype=torch.int64))
    out = ours(ids, offsets)
    assert out.shape == (0, DIM)
    out.backward(torch.zeros(0, DIM, device=device))
    assert sum(g.numel() for g in ours.pending_grads()) == 0


# --------------------------------------------------------------------------- nn.Embedding

SHAPES = [(), (0,), (7,), (3, 4), (2, 3, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("padding_idx", [None, PAD, PAD - ROWS])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_values_and_step_are_embeddings(shape, padding_idx, index_dtype, device):
    gen = torch.Generator().manual_seed(SHAPES.index(shape))
    weight = torch.randn(ROWS, DIM, generator=gen)
    ref = nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=padding_idx)
    ref = ref.to(device)
    ours = CachedLowPrecisionUnpooledEmbedding.from_pretrained(
        weight, padding_idx=padding_idx, device=device, **EXACT
    )
    ids = _ids(gen, *shape)
    ids[torch.rand(shape, generator=gen) < 0.3] = PAD
    ids = ids.to(index_dtype).to(device)
    want, got = ref(ids), ours(ids)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    grad = torch.randn(want.shape, generator=gen).to(device)
    want.backward(grad)
    got.backward(grad)
    ours.step()
    torch.testing.assert_close(ours.weight, ref.weight.detach() - ref.weight.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cached_unpooled_tables_read_their_rows_as_embedding(precision, device):
    gen = torch.Generator().manual_seed(1)
    ours = CachedLowPrecisionUnpooledEmbedding(
        ROWS, DIM, PAD, precision=precision, device=device, **CACHED
    )
    _train_once(ours, gen, device)
    for shape in SHAPES:
        ids = _ids(gen, *shape).to(device)
        want = F.embedding(ids, ours.weight, padding_idx=PAD)
        got = ours(ids)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "ids", [torch.tensor([1, ROWS]), torch.tensor([[-1]]), torch.tensor([1.0])], ids=str
)
def test_what_embedding_refuses_is_refused_changing_nothing(ids, precision, device):
    with pytest.raises(REFUSED):  # on the CPU: on a GPU a bad index is a device-side assert
        nn.Embedding(ROWS, DIM)(ids)
    ids = ids.to(device)
    ours = CachedLowPrecisionUnpooledEmbedding(
        ROWS, DIM, precision=precision, device=device, name="t", **CACHED
    )
    _train_once(ours, torch.Generator().manual_seed(0), device)
    before = _state(ours)
    with pytest.raises(ValueError, match="table 't': "):
        ours(ids)
    _assert_unchanged(before, ours)


# --------------------------------------------------------------------------- constructors

# PyTorch's positional arguments, in its order, every one set
BAG_ARGS = (ROWS, DIM, None, 1.0, False, "sum", True, None, True, PAD)
EMBEDDING_ARGS = (ROWS, DIM, PAD, None, 1.0, False, True, None, False)
ATTRIBUTES = (
    "num_embeddings",
    "embedding_dim",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)


@pytest.mark.parametrize(
    "ours_kind,theirs_kind,args",
    [
        (CachedLowPrecisionEmbedding, nn.EmbeddingBag, BAG_ARGS),
        (CachedLowPrecisionUnpooledEmbedding, nn.Embedding, EMBEDDING_ARGS),
    ],
    ids=["EmbeddingBag", "Embedding"],
)
def test_positional_arguments_are_pytorchs(ours_kind, theirs_kind, args):
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    with_weight = (*args[:7], weight, *args[8:])  # _weight, eighth in both
    theirs, ours = theirs_kind(*with_weight), ours_kind(*with_weight, **EXACT)
    names = ATTRIBUTES + (("mode", "include_last_offset") if theirs_kind is nn.EmbeddingBag else ())
    for name in names:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert torch.equal(ours.weight, weight)
    ids = _ids(torch.Generator().manual_seed(3), 4, 3)
    ids[0, 0] = PAD
    torch.testing.assert_close(ours(ids), theirs(ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "ours_kind,theirs_kind",
    [
        (CachedLowPrecisionEmbedding, nn.EmbeddingBag),
        (CachedLowPrecisionUnpooledEmbedding, nn.Embedding),
    ],
    ids=["EmbeddingBag", "Embedding"],
)
def test_options_spelled_out_at_pytorchs_defaults_are_accepted(ours_kind, theirs_kind):
    defaults = dict(
        max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False, _weight=None
    )
    defaults.update(device=None, dtype=None)
    if theirs_kind is nn.Embedding:
        defaults["_freeze"] = False
    theirs = theirs_kind(ROWS, DIM, **defaults)
    ours = ours_kind(ROWS, DIM, **defaults)
    if theirs_kind is nn.EmbeddingBag:
        assert ours.mode == theirs.mode == "mean"
    # honoured at other values too: the gradient is always sparse (step() applies it), and
    # norm_type is read only with max_norm
    ours_kind(ROWS, DIM, sparse=True, norm_type=1.0, dtype=torch.float32)


@pytest.mark.parametrize(
    "kind,option,value",
    [
        (CachedLowPrecisionEmbedding, "max_norm", 1.0),
        (CachedLowPrecisionEmbedding, "scale_grad_by_freq", True),
        (CachedLowPrecisionEmbedding, "dtype", torch.float16),
        (CachedLowPrecisionUnpooledEmbedding, "max_norm", 2.0),
        (CachedLowPrecisionUnpooledEmbedding, "scale_grad_by_freq", True),
        (CachedLowPrecisionUnpooledEmbedding, "_freeze", True),
    ],
)
def test_options_the_tables_cannot_honour_are_refused_by_name(kind, option, value):
    with pytest.raises(ValueError, match=f"table 'x': {option}={value!r} is not supported: "):
        kind(ROWS, DIM, name="x", **{option: value})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", [CachedLowPrecisionEmbedding, CachedLowPrecisionUnpooledEmbedding])
def test_the_padding_row_starts_at_zero_in_every_format(kind, precision, device):
    theirs = nn.EmbeddingBag(ROWS, DIM, padding_idx=PAD)
    ours = kind(ROWS, DIM, padding_idx=PAD, precision=precision, device=device, **CACHED)
    assert torch.equal(ours.weight[PAD].cpu(), theirs.weight.detach()[PAD])
    assert int((ours.weight == 0).all(dim=1).sum()) == 1  # only that row
