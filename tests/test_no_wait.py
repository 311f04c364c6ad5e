"""What a training step waits for on a GPU, run on the emulated CUDA kernels (their host code
is the CUDA build's, their "device" the CPU): the tables' Python driver (embcache.group) with
its cache ops served by torch.ops.embcache_emu. The forward, the backward and the update wait
for nothing (the emulator counts every read-back, ``read_backs()``); bad input, refused at the forward on
the CPU, comes back from the device as error bits and is raised later, naming the table and
the value, with nothing changed; a gate stops the update on the device; the trainer reads the
update's verdict with its own figures. Every result is compared with the CPU ops'."""

import copy

import pytest
import torch

import embcache
import embcache.group
from dlrm.mixed_precision.trainer import MixedPrecisionTrainer, StepRefusedError
from embcache import BagTable, CachedLowPrecisionEmbeddingBags, EmbeddingUpdateError
from tests._emulated import EMU, comparable_stats, needs_emulator, small_bags

pytestmark = pytest.mark.usefixtures("one_thread")

TABLES = [BagTable("t_a", 900, 8, ("f_0", "f_1")), BagTable("t_b", 400, 8, ("f_2",))]


def _module(seed=0, tables=TABLES, **options):
    return small_bags(tables, seed, **options)


def _batch(gen, batch=32):
    rows = torch.tensor([900, 900, 400])
    return (torch.rand(batch, 3, generator=gen) ** 3 * rows).long()


def _bytes(module):
    return {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(module, gen, steps):
    for _ in range(steps):
        ids = _batch(gen)
        module(ids).square().sum().backward()
        module.step()


@needs_emulator
def test_the_emulated_step_is_the_cpu_step_and_reads_nothing_back(emulated):
    """The same steps through the driver on the emulated kernels and on the CPU ops give the
    same tables and statistics; the forward, the backward (its outputs sized for every lookup
    a unique row) and the update's kernels read nothing back: only ``step()`` reads the
    verdict, once."""
    ours, theirs = _module(), _module()
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    waits = []
    for _ in range(6):
        ids = _batch(gen)
        before = EMU.read_backs()
        out = ours(ids)
        forward = EMU.read_backs()
        out.square().sum().backward()
        backward = EMU.read_backs()
        ours.step()
        waits.append((forward - before, backward - forward, EMU.read_backs() - backward))
        with pytest.MonkeyPatch.context() as m:  # the CPU ops, for the twin
            m.setattr(embcache.group, "_ops", embcache.group._ops.cpu_ops)
            theirs(ids).square().sum().backward()
            theirs.step()
    assert waits == [(0, 0, 0)] * 6
    assert _same(_bytes(ours), _bytes(theirs))
    assert comparable_stats(ours) == comparable_stats(theirs)
    assert (
        comparable_stats(ours)["t_a"]["steps"] == 6
        and comparable_stats(ours)["t_a"]["lookups"] == 6 * 64
    )


@needs_emulator
@pytest.mark.parametrize("deferred", [False, True], ids=["read-at-forward", "read-at-update"])
@pytest.mark.parametrize("bad", ["index", "negative", "lengths"])
def test_bad_input_from_the_device_names_the_table_and_changes_nothing(
    emulated, monkeypatch, bad, deferred
):
    """Bad input is found by the device's kernels, not before: the error names the table (or
    feature) and the value, as the CPU forward's does, and no table byte changes. Read at a
    later forward once its kernels are done, or (``deferred``: as on a GPU whose kernels have
    not run yet) by the update, which the bad forward's error bits stop on the device; the
    batch's gradient is dropped, so the next step trains as if the batch had never come."""
    module, twin = _module(), _module()
    gen = torch.Generator().manual_seed(3)
    for m in (module, twin):
        _train(m, torch.Generator().manual_seed(3), 2)
    before = _bytes(module)
    if deferred:
        monkeypatch.setattr(embcache.group.TableGroup, "_check_finished_inputs", lambda self: None)
    ids = _batch(gen)
    if bad == "lengths":  # feature-major ids with lengths that leave one id out
        args, match = (ids.t().reshape(-1), torch.ones(96, dtype=torch.int32)), "lengths sum to"
        args[1][-1] = 0
    else:
        ids[5, 2] = 400 if bad == "index" else -3
        args, match = (ids,), r"table 't_b'.*(400|-3)"
    with pytest.raises(ValueError, match=match):
        module(*args).sum().backward()
        module.step()
    assert _same(_bytes(module), before)
    monkeypatch.undo()
    ids = _batch(torch.Generator().manual_seed(11))
    for m in (module, twin):
        m(ids).square().sum().backward()
        m.step()
    assert _same(_bytes(module), _bytes(twin))


@needs_emulator
def test_a_gate_stops_the_update_on_the_device(emulated):
    """start_step(gate): a non-zero word stops the commit (the device decides; finish says it
    did not apply) and the gradient stays pending; with a zero gate the same update applies
    as step() would."""
    module, twin = _module(), _module()
    gen = torch.Generator().manual_seed(5)
    ids = _batch(gen)
    for m in (module, twin):
        m(ids).square().sum().backward()
    before = _bytes(module)
    pending = module.start_step(torch.tensor([0, 7]))
    assert pending.finish() is False
    assert _same(_bytes(module), before)
    assert module.start_step(torch.zeros(2, dtype=torch.int64)).finish() is True
    twin.step()
    assert _same(_bytes(module), _bytes(twin))
    assert comparable_stats(module) == comparable_stats(twin)


@needs_emulator
def test_a_refused_update_names_the_table_from_the_verdict(emulated):
    """An update a table cannot store (a huge gradient for an INT8 table) is refused on the
    device: the verdict names the row, the error the table, and nothing changes."""
    module = _module()
    gen = torch.Generator().manual_seed(6)
    _train(module, gen, 1)
    before = _bytes(module)
    ids = _batch(gen)
    (module(ids)[:, 16:] * 1e38).sum().backward()
    with pytest.raises(EmbeddingUpdateError, match="table 't_b'"):
        module.step()
    assert _same(_bytes(module), before)


class _Model(torch.nn.Module):
    def __init__(self, seed, **options):
        super().__init__()
        self.embedding_collection = _module(seed, **options)
        torch.manual_seed(seed)
        self.top = torch.nn.Linear(24, 1)

    def forward(self, dense, ids):
        x = self.embedding_collection(ids) + dense
        return self.top(x.to(self.top.weight.dtype))  # (the trainer's FP16 dense part)


@needs_emulator
def test_the_trainer_reads_the_update_with_its_figures(emulated):
    """MixedPrecisionTrainer on the emulated tables: the tables' kernels read nothing back
    (the trainer's one read of its figures and the verdict is its own), the same model as on
    the CPU ops, and an overflow skips the step on the device (the gate) with no table
    changed."""
    gen = torch.Generator().manual_seed(7)
    trainers = [MixedPrecisionTrainer(_Model(1), lr=0.1) for _ in range(2)]
    for step in range(5):
        ids, dense = _batch(gen), torch.randn(32, 24, generator=gen)
        labels = torch.rand(32, generator=gen).round()
        if step == 3:
            dense[0, 0] = float("inf")  # an overflow: skipped everywhere
        results = []
        for trainer, ops in zip(trainers, ("emulated", "cpu")):
            with pytest.MonkeyPatch.context() as m:
                if ops == "cpu":
                    m.setattr(embcache.group, "_ops", embcache.group._ops.cpu_ops)
                before = EMU.read_backs()
                results.append(trainer.train_step(dense, ids, labels))
                assert EMU.read_backs() == before
        assert results[0]["skipped"] == results[1]["skipped"] == (step == 3)
        assert torch.equal(results[0]["loss"], results[1]["loss"])
    ours, theirs = (t.model.embedding_collection for t in trainers)
    assert _same(_bytes(ours), _bytes(theirs))
    assert trainers[0].report.skipped == 1


@needs_emulator
def test_a_refused_table_update_undoes_the_dense_step(emulated):
    """The tables refuse (on the device) the update the trainer launched with its dense step
    (SGD at a learning rate that takes INT8 rows past what FP16 qparams hold): the step is
    refused naming the table, every dense tensor and every table byte as before."""
    trainer = MixedPrecisionTrainer(_Model(2, optimizer="sgd", lr=1e7), lr=0.1)
    model = trainer.model
    gen = torch.Generator().manual_seed(8)
    ids, dense = _batch(gen), torch.randn(32, 24, generator=gen)
    labels = torch.rand(32, generator=gen).round()
    before_tables = _bytes(model.embedding_collection)
    before_dense = copy.deepcopy(trainer.masters)
    with pytest.raises(StepRefusedError, match="table 't_"):
        trainer.train_step(dense, ids, labels)
    assert _same(_bytes(model.embedding_collection), before_tables)
    assert all(torch.equal(a, b) for a, b in zip(trainer.masters, before_dense))


class _Two(torch.nn.Module):
    """Two groups of one feature a table (so that each backward is its group's whole
    gradient, and the update joins them as they are)."""

    def __init__(self):
        super().__init__()
        tables = [BagTable("u_a", 900, 8), BagTable("u_b", 400, 8)]
        self.first = _module(0, tables)
        self.second = _module(1, tables, optimizer="adagrad")

    def forward(self, ids):
        ids = ids[:, 1:]  # rows < 900, < 400
        return torch.cat([self.first(ids), self.second(ids.flip(1) % 400)], 1)


@needs_emulator
def test_groups_updated_together_from_arrays_sized_for_every_lookup(emulated, monkeypatch):
    """TableOptimizer updates two groups in one call from their device backwards as they are,
    arrays sized for every lookup (the second group's rows start past the first's padding):
    the same tables as the CPU ops give, and no read-back but the update's verdict."""
    monkeypatch.setattr(embcache.group, "_start_merged", None)  # (not the merging path)
    ours, theirs = _Two(), _Two()
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        ids = _batch(gen)
        before = EMU.read_backs()
        ours(ids).square().sum().backward()
        embcache.TableOptimizer(ours).step()
        assert EMU.read_backs() == before
        with pytest.MonkeyPatch.context() as m:
            m.setattr(embcache.group, "_ops", embcache.group._ops.cpu_ops)
            theirs(ids).square().sum().backward()
            embcache.TableOptimizer(theirs).step()
    for a, b in ((ours.first, theirs.first), (ours.second, theirs.second)):
        assert _same(_bytes(a), _bytes(b))
        assert comparable_stats(a) == comparable_stats(b)


@needs_emulator
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_multi_hot_bags_of_every_mode_train_as_on_the_cpu(emulated, mode):
    """Multi-hot, feature-major ids with empty bags (and per-sample weights with sum), INT4
    rows, LRU, AdaGrad: the emulated kernels' padded backward and update give the CPU ops'
    tables and statistics."""

    def module():
        torch.manual_seed(0)
        tables = [BagTable("x", 900, 8, ("f0", "f1"), mode=mode), BagTable("y", 400, 4, mode=mode)]
        return CachedLowPrecisionEmbeddingBags(
            tables,
            precision="int4",
            cache_ratio=0.1,
            associativity=4,
            policy="lru",
            optimizer="adagrad",
            lr=0.05,
            min_rows_for_low_precision=0,
        )

    ours, theirs = module(), module()
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(4):
        lengths = torch.randint(0, 4, (3 * 6,), generator=gen)
        ids = torch.cat(
            [
                torch.randint(0, rows, (int(lengths[f * 6 : (f + 1) * 6].sum()),), generator=gen)
                for f, rows in enumerate((900, 900, 400))
            ]
        )
        psw = torch.rand(ids.numel(), generator=gen) if mode == "sum" else None
        for m, ops in ((ours, None), (theirs, embcache.group._ops.cpu_ops)):
            with pytest.MonkeyPatch.context() as patch:
                if ops is not None:
                    patch.setattr(embcache.group, "_ops", ops)
                out = m(ids, lengths, psw)
                (out * torch.arange(out.numel()).view_as(out)).sum().backward()
                m.step()
    assert _same(_bytes(ours), _bytes(theirs))
    assert comparable_stats(ours) == comparable_stats(theirs)
