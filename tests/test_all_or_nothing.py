"""A refused step or load changes nothing: the trainer when the embedding tables or the dense
update refuse new values, and load_state_dict of a table, a collection and a trainer from
another configuration. Every state tensor is compared byte for byte before and after."""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import embcache
from dlrm.mixed_precision import Linear, MixedPrecisionTrainer, StepRefusedError
from embcache import CachedLowPrecisionEmbedding, CachedLowPrecisionEmbeddingBagCollection

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, DIM, BATCH = 1000, 4, 8
EDGE_ROW = 0  # starts at 65000, next to FP16's largest value


def _same(a, b, where="state") -> None:
    """Assert two nested structures equal, tensors byte for byte (dtype and shape too)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        ), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _without_lookup_counts(state: dict) -> dict:
    """A table's extra state without the counts of lookups and hits: they count every training
    forward, also that of a step later skipped or refused (they describe the access stream)."""
    for key, value in state.items():
        if key.endswith("_extra_state"):
            value["stats"] = {
                k: v for k, v in value["stats"].items() if k not in ("lookups", "hits")
            }
    return state


def _trainer_state(t: MixedPrecisionTrainer) -> dict:
    """Everything a step could change, copied."""
    return copy.deepcopy(
        {
            "model": _without_lookup_counts(copy.deepcopy(t.model.state_dict())),
            "masters": t.masters,
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.lr_scheduler.state_dict(),
            "scaler": t.scaler.state_dict(),
            "report": dataclasses.asdict(t.report),
        }
    )


class _Tiny(nn.Module):
    """logit = dense_linear(x) + 1e-6 * sum(embedding of the bag): with a huge table LR, the
    row at 65000 is pushed past FP16's range exactly when its bag's label is 1."""

    def __init__(self, table):
        super().__init__()
        self.embedding_collection = table
        self.dense = Linear(3, 1)

    def forward(self, dense, ids):
        x = self.dense(dense.to(self.dense.weight.dtype)).float().reshape(-1)
        pooled = self.embedding_collection(ids, torch.arange(ids.numel()))
        return x + 1e-6 * pooled.sum(1)


def _tiny_trainer(optimizer: str) -> MixedPrecisionTrainer:
    torch.manual_seed(0)
    weight = torch.rand(ROWS, DIM) * 0.02 - 0.01
    weight[EDGE_ROW] = 65000.0
    table = CachedLowPrecisionEmbedding(
        ROWS,
        DIM,
        weight=weight,
        precision="fp16",
        rounding="nearest",
        cache_ratio=0.0,
        optimizer="sgd",
        lr=1e10,
        name="edge",
    )
    return MixedPrecisionTrainer(
        _Tiny(table),
        dense_precision="fp16",
        optimizer=optimizer,
        lr=0.01,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    )


def _batch(seed: int, with_edge_row: bool):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, ROWS, (BATCH,), generator=gen)
    labels = torch.randint(0, 2, (BATCH,), generator=gen).float()
    if with_edge_row:
        ids[0], labels[0] = EDGE_ROW, 1.0
    return torch.randn(BATCH, 3, generator=gen), ids, labels


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
@pytest.mark.parametrize("applied_before", [0, 2])
def test_refused_embedding_update_changes_nothing_and_is_dropped(optimizer, applied_before):
    trainer = _tiny_trainer(optimizer)
    for s in range(applied_before):
        assert not trainer.train_step(*_batch(10 + s, with_edge_row=False))["skipped"]
    twin = copy.deepcopy(trainer)
    before = _trainer_state(trainer)
    with pytest.raises(StepRefusedError, match=rf"step {applied_before + 1} refused: table 'edge'"):
        trainer.train_step(*_batch(1, with_edge_row=True))
    _same(before, _trainer_state(trainer))
    assert trainer.model.embedding_collection.pending_grads() == []
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(m.grad is None for m in trainer.masters)
    # the refused gradient is gone: the next step is the twin's, who never saw it
    trainer.train_step(*_batch(2, with_edge_row=False))
    twin.train_step(*_batch(2, with_edge_row=False))
    _same(_trainer_state(twin), _trainer_state(trainer))


def test_dense_update_that_overflows_fp16_is_refused_and_changes_nothing():
    trainer = _tiny_trainer("adam")
    trainer.train_step(*_batch(10, with_edge_row=False))
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e6  # Adam moves every weight by about lr: far past 65504
    before = _trainer_state(trainer)
    with pytest.raises(
        StepRefusedError, match=r"step 2 refused: dense parameter 'dense\.(weight|bias)'.*FP16"
    ):
        trainer.train_step(*_batch(11, with_edge_row=False))
    _same(before, _trainer_state(trainer))
    assert trainer.model.embedding_collection.pending_grads() == []
    # the masters were finite: only the FP16 copies would have overflowed
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# --------------------------------------------------------------------------- load_state_dict


def _trained_table(lr: float, seed: int) -> CachedLowPrecisionEmbedding:
    table = CachedLowPrecisionEmbedding(
        2000,
        6,
        precision="int8",
        cache_ratio=0.05,
        associativity=4,
        policy="lfu",
        optimizer="rowwise_adagrad",
        lr=lr,
        name="t",
        seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ids = (torch.rand(64, generator=gen) ** 3 * 2000).long()
        table(ids, torch.arange(0, 64, 4)).sum().backward()
        table.step()
    return table


def _module_state(m: nn.Module) -> dict:
    stats = {
        n: t.stats() for n, t in m.named_modules() if isinstance(t, CachedLowPrecisionEmbedding)
    }
    return copy.deepcopy({"state": m.state_dict(), "stats": stats})


def test_table_load_from_another_configuration_changes_nothing():
    saved = _trained_table(lr=0.1, seed=1).state_dict()
    table = _trained_table(lr=0.2, seed=2)
    before = _module_state(table)
    with pytest.raises(ValueError, match=r"table 't'.*lr"):
        table.load_state_dict(saved)
    _same(before, _module_state(table))


def _collection(
    lr_of_last: float, data_seed: int, steps: int = 3
) -> CachedLowPrecisionEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(
            name=f"t_{i}", embedding_dim=4, num_embeddings=1500, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    ebc = CachedLowPrecisionEmbeddingBagCollection(
        tables,
        per_table={"t_2": {"lr": lr_of_last}},
        precision="int4",
        cache_ratio=0.1,
        associativity=8,
        optimizer="sgd",
        lr=0.1,
    )
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        values = (torch.rand(3 * 32, generator=gen) ** 3 * 1500).long()
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"], values=values, lengths=torch.ones(96, dtype=torch.int64)
        )
        ebc(kjt).values().square().sum().backward()
        ebc.step()
    return ebc


def test_collection_load_with_a_later_table_differing_changes_no_table():
    saved = _collection(lr_of_last=0.3, data_seed=1).state_dict()
    ebc = _collection(lr_of_last=0.1, data_seed=2)
    before = _module_state(ebc)
    with pytest.raises(ValueError, match=r"table 't_2'.*lr"):
        ebc.load_state_dict(saved)
    _same(before, _module_state(ebc))  # t_0 and t_1 were not loaded either


def test_trainer_load_from_another_configuration_changes_nothing():
    a, b = _tiny_trainer("adam"), _tiny_trainer("adam")
    a.train_step(*_batch(10, with_edge_row=False))
    b.train_step(*_batch(11, with_edge_row=False))
    b.train_step(*_batch(12, with_edge_row=False))
    saved = copy.deepcopy(a.state_dict())
    table = b.model.embedding_collection
    table.config = dataclasses.replace(table.config, lr=1e9)  # b's table: another configuration
    before = _trainer_state(b)
    with pytest.raises(ValueError, match=r"table 'edge'.*lr"):
        b.load_state_dict(saved)
    _same(before, _trainer_state(b))
    saved["masters"][0] = saved["masters"][0][:0]  # a master of another shape
    with pytest.raises(ValueError, match=r"master of 'dense.weight'"):
        b.load_state_dict(saved)
    _same(before, _trainer_state(b))


@pytest.mark.parametrize("refused", [False, True])
def test_collection_check_step_is_a_dry_run_of_step(refused):
    """check_step raises what step would raise and changes nothing; the step after it is the
    step of a twin that never ran the check."""
    ebc, twin = (
        _collection(lr_of_last=1e38, data_seed=3, steps=0)
        if refused
        else _collection(lr_of_last=0.3, data_seed=3)
        for _ in range(2)
    )
    gen = torch.Generator().manual_seed(4)
    values = (torch.rand(96, generator=gen) ** 3 * 1500).long()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=values, lengths=torch.ones(96, dtype=torch.int64)
    )
    for m in (ebc, twin):
        (m(kjt).values().square().sum() * 1e3).backward()
    before = _module_state(ebc)
    if refused:
        with pytest.raises(ValueError, match="table 't_2'.*cannot store") as checked:
            ebc.check_step()
        _same(before, _module_state(ebc))
        with pytest.raises(ValueError) as stepped:
            ebc.step()
        assert str(stepped.value) == str(checked.value)
        _same(before, _module_state(ebc))
        return
    ebc.check_step()
    _same(before, _module_state(ebc))
    ebc.step()
    twin.step()
    _same(_module_state(twin), _module_state(ebc))
    assert not torch.equal(
        before["state"]["embedding_bags.t_0.weights"], ebc.embedding_bags.t_0.weights
    )


def test_the_step_timer_sees_each_phase_and_a_skipped_step_updates_nothing():
    """phase_seconds: every phase of PHASES, their sum within the steps' wall time; an applied
    step spends time in every update phase, a skipped one (inf gradient) in none of those
    after the decision (in one process the dense step comes before it, and is undone), and
    leaves the masters and the model as they were."""
    import time

    from dlrm.mixed_precision.trainer import PHASES

    trainer = _tiny_trainer("adagrad")
    start = time.perf_counter()
    trainer.train_step(*_batch(3, with_edge_row=False))
    wall = time.perf_counter() - start
    applied = trainer.phase_seconds
    assert list(applied) == list(PHASES)
    assert 0 < sum(applied.values()) <= wall
    update = ("backup", "dense_step", "dense_check", "embedding_step", "fp16_copies")
    assert all(applied[p] > 0 for p in ("forward_backward", "unscale_check", *update))
    trainer.scaler.scale = float("inf")  # the scaled loss, and so every gradient, is inf
    before = [m.clone() for m in trainer.masters], copy.deepcopy(trainer.model.state_dict())
    assert trainer.train_step(*_batch(4, with_edge_row=False))["skipped"]
    skipped = trainer.phase_seconds
    assert all(skipped[p] == applied[p] for p in ("dense_check", "embedding_step", "fp16_copies"))
    assert all(torch.equal(a, b) for a, b in zip(before[0], trainer.masters))
    after = trainer.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before[1].items() if torch.is_tensor(v))
    assert skipped["forward_backward"] > applied["forward_backward"]


@pytest.mark.parametrize("value,refused", [(62400.0, True), (61000.0, False)])
def test_rowwise_adagrad_update_near_the_fp16_limit_is_judged_right(value, refused):
    """Row-wise AdaGrad's step on one element of a dim-256 row whose other gradients are 0 is
    lr * sqrt(256) = 3200: from 62400 it leaves FP16's range (refused, nothing changed), from
    61000 it does not (applied). The update may skip computing new values only when a bound on
    them proves them storable; a bound of lr alone would wrongly pass 62400 + 3200."""
    weight = torch.zeros(1000, 256)
    weight[7, 0] = value
    table = CachedLowPrecisionEmbedding(
        1000,
        256,
        weight=weight,
        precision="fp16",
        rounding="nearest",
        cache_ratio=0.05,
        optimizer="rowwise_adagrad",
        lr=200.0,
        name="near",
    )
    before = {k: v.clone() for k, v in table.state_dict().items() if isinstance(v, torch.Tensor)}
    out = table(torch.tensor([7]), torch.tensor([0]))
    grad = torch.zeros_like(out)
    grad[0, 0] = -1.0
    out.backward(grad)
    if refused:
        with pytest.raises(embcache.EmbeddingUpdateError, match=r"table 'near'.*row 7"):
            table.step()
        _same(before, {k: v for k, v in table.state_dict().items() if isinstance(v, torch.Tensor)})
    else:
        table.step()
        assert float(table.current_weight()[7, 0]) == float(torch.tensor(value + 3200.0).half())
