"""Prefetch (docs/design.md, "Prefetch"), on the emulated CUDA kernels: a stage holds copies
of the stored rows a coming batch misses; the forward and the update read them in place of
the table's rows; an update marks the copies of the rows it may write stale. Nothing a stage
does may change a value: every run is compared with the CPU ops' run without one, and the
stage is shown to be read by poisoning it."""

import pytest
import torch

import embcache.group
from dlrm.mixed_precision.trainer import MixedPrecisionTrainer
from embcache import BagTable, CachedLowPrecisionEmbedding, CachedLowPrecisionEmbeddingBags
from embcache.group import TableGroup
from tests._emulated import EMU, comparable_stats, needs_emulator, small_bags

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_emulator]

NO_ROW = (1 << 63) - 1  # csrc/include/embcache/stage.h kNoStagedRow
CPU = torch.ops.embcache
TABLES = [
    BagTable("t_a", 900, 8, ("f_0", "f_1")),
    BagTable("t_b", 500, 12, ("f_2",), mode="max"),
    BagTable("t_c", 400, 10, ("f_3",)),
]


@pytest.fixture
def staging(emulated, monkeypatch):
    """Every table of a group staged (on a GPU only host-placed ones are: the emulator's
    tables are all in its one memory)."""
    monkeypatch.setattr(
        TableGroup, "staged_positions", lambda self, device: list(range(len(self.tables)))
    )


def _module(seed=0, **options):
    per_table = {"t_c": {"precision": "int4", "cache_ratio": 0.0}}  # odd row bytes, no cache
    return small_bags(TABLES, seed, per_table=per_table, **options)


def _batch(gen, batch=24):
    """Feature-major ids and lengths: bags of 0 to 3 ids, skewed so that rows recur."""
    rows = [900, 900, 500, 400]
    lengths = torch.randint(0, 4, (4 * batch,), generator=gen)
    ids = [
        (torch.rand(int(n), generator=gen) ** 3 * r).long()
        for n, r in zip(lengths.view(4, batch).sum(1), rows)
    ]
    return torch.cat(ids), lengths


def _tables(module):
    return {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cpu_step(module, batch, grad):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(embcache.group, "_ops", embcache.group._ops.cpu_ops)
        out = module(*batch)
        out.backward(grad)
        module.step()
    return out


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_steps_that_prefetch_the_next_batch_are_the_cpu_steps(staging, policy, optimizer):
    """Each step prefetches the next batch after its forward (as dlrm's trainer does); its
    forward, update, tables and statistics equal the CPU ops' without any stage, bit for
    bit, over steps whose batches share rows (so updates write rows the next stage holds)."""
    options = {"policy": policy, "optimizer": optimizer}
    ours, theirs = _module(**options), _module(**options)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    batches = [_batch(gen) for _ in range(8)]
    staged = stale = 0
    for step, batch in enumerate(batches):
        grad = torch.randn(24, 8 * 2 + 12 + 10, generator=gen)
        out = ours(*batch)
        if step + 1 < len(batches):
            ours.prefetch(*batches[step + 1])
            keys = ours.group._stage.slots[:, 0]  # (a view: the update marks it)
            staged += int((keys != NO_ROW).sum())
        out.backward(grad)
        ours.step()
        if step + 1 < len(batches):
            stale += int(((keys != NO_ROW) & (keys % 2 == 1)).sum())
        assert torch.equal(out, _cpu_step(theirs, batch, grad)), f"step {step}"
    assert _same(_tables(ours), _tables(theirs))
    assert comparable_stats(ours) == comparable_stats(theirs)
    assert staged > 0 and stale > 0  # the stages held rows, and updates made some stale


def test_the_stage_holds_copies_of_the_misses_of_the_staged_tables(emulated):
    """stage_misses: a hash table of twice as many entries as lookups (a power of two) whose
    keys are the (table, row) of every lookup of a staged table whose row is not cached, each
    once, with a copy of the row's stored bytes, the copies numbered from 0; the other
    entries empty. The CPU op stages nothing."""
    m = _module()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _cpu_step(m, _batch(gen), torch.randn(24, 38, generator=gen))
    ids, lengths = _batch(gen)
    group = m.group
    args = (group.state(), group.specs, ids, lengths, m._feature_tables, 24)
    slots, rows = EMU.stage_misses(*args, [0, 2])
    entries = slots.shape[0]
    assert entries >= 2 * ids.numel() and entries & (entries - 1) == 0 and slots.shape[1] == 2
    table_of_lookup = torch.repeat_interleave(
        torch.tensor(m._feature_tables), lengths.view(4, 24).sum(1)
    )
    want = {
        (t << 49) | (row << 1)
        for t, row in zip(table_of_lookup.tolist(), ids.tolist())
        if t in (0, 2) and row not in group.tables[t].cache_tags.tolist()
    }
    filled = slots[slots[:, 0] != NO_ROW]
    assert sorted(filled[:, 0].tolist()) == sorted(want)  # each once
    assert sorted(filled[:, 1].tolist()) == list(range(len(want)))
    assert rows.shape[0] == ids.numel() and rows.shape[1] % 16 == 0
    for key, copy in filled.tolist():
        table, row = group.tables[key >> 49], key >> 1 & ((1 << 48) - 1)
        width = table.config.row_bytes
        assert torch.equal(rows[copy, :width], table.weights[row]), (key >> 49, row)
    cpu_slots, cpu_rows = CPU.stage_misses(*args, [0, 2])
    assert bool((cpu_slots[:, 0] == NO_ROW).all()) and cpu_rows.numel() == 0


def test_the_forward_and_the_update_read_the_stage(staging):
    """A poisoned stage shows that it is read: a forward that takes it pools the poison; an
    update whose forward took it starts from the poison (a fresh stage gives the CPU's
    values, the test above)."""
    m, twin = _module(), _module()
    gen = torch.Generator().manual_seed(2)
    batch, grad = _batch(gen), torch.randn(24, 38, generator=gen)
    m.prefetch(*batch)
    m.group._stage.rows.fill_(0x3C)  # not the stored bytes
    out = m(*batch)
    assert not torch.equal(out, _cpu_step(twin, batch, grad))
    m2, twin2 = _module(), _module()
    m2.prefetch(*batch)
    out = m2(*batch)
    assert torch.equal(out, _cpu_step(twin2, batch, grad))
    out.backward(grad)
    m2.group._backward.stage.rows.fill_(0x3C)
    m2.step()
    assert not _same(_tables(m2), _tables(twin2))


def test_an_update_marks_the_copies_of_its_rows_stale(staging):
    """After an update, exactly the entries whose rows it updated are stale (bit 0), and
    unstage_rows is the CPU op's rule."""
    m = _module()
    gen = torch.Generator().manual_seed(3)
    batch = _batch(gen)
    out = m(*batch)
    m.prefetch(*batch)  # the same rows: every staged row is updated
    before = m.group._stage.slots.clone()
    out.backward(torch.randn(24, 38, generator=gen))
    m.step()
    after = m.group._stage.slots
    assert torch.equal(after[:, 1], before[:, 1])  # the copies stay where they are
    before, after = before[:, 0], after[:, 0]
    fresh = before != NO_ROW
    assert bool(fresh.any()) and torch.equal(after[fresh], before[fresh] | 1)
    assert torch.equal(after[~fresh], before[~fresh])
    # the rule on its own, against the CPU op: random keys, parts of two tables, one unsound
    rows = torch.tensor([1, 4, 9, 2, 3, 7, 8])
    ranges = torch.tensor([[0, 3, 0], [3, 7, 0], [5, 99, 0]])
    keys = torch.tensor(
        [(t << 49) | (r << 1) | s for t in range(4) for r in range(10) for s in (0, 1)] + [NO_ROW]
    )
    slots = torch.stack([keys, torch.arange(keys.numel())], dim=1)
    for range_of in ([0, 1, -1, 2], [1, -1, 0, -1], [-1, -1, -1, -1]):
        a, b = slots.clone(), slots.clone()
        EMU.unstage_rows(a, rows, ranges, range_of)
        CPU.unstage_rows(b, rows, ranges, range_of)
        assert torch.equal(a, b) and torch.equal(a[:, 1], slots[:, 1]), range_of
    CPU.unstage_rows(b := slots.clone(), rows, ranges, [0, 1, -1, 2])
    marked = {(k >> 49, k >> 1 & 15) for k, was in zip(b[:, 0].tolist(), keys.tolist()) if k != was}
    assert marked == {(0, 1), (0, 4), (0, 9), (1, 2), (1, 3), (1, 7), (1, 8)} | {
        (3, r) for r in range(10)
    }
    with pytest.raises(RuntimeError, match="range_of_table holds 3"):
        CPU.unstage_rows(slots.clone(), rows, ranges, [3])


def test_a_stage_serves_any_forward_of_its_mode_and_goes_with_a_flush_or_a_load(staging):
    """A stage is taken by the next forward of as many lookups in the mode it was made in (an
    evaluation leaves a training stage); made for other lookups of that count it changes no
    value (each copy is found by its table and row); a flush or a load drops it."""
    m, twin = _module(), _module()
    gen = torch.Generator().manual_seed(4)
    first = _batch(gen)
    second = (torch.randint(0, 400, first[0].shape, generator=gen), first[1])  # other rows
    grad = torch.randn(24, 38, generator=gen)
    m.prefetch(*second)
    assert m.group._stage is not None
    m.eval()
    m(*first)
    m.train()
    assert m.group._stage is not None  # left for a training forward
    out = m(*first)
    assert m.group._stage is None  # taken
    assert torch.equal(out, _cpu_step(twin, first, grad))
    m.prefetch(*first)
    m.flush()
    assert m.group._stage is None
    m.prefetch(*first)
    m.load_state_dict(twin.state_dict())
    assert m.group._stage is None


def test_prefetch_does_nothing_where_nothing_gains(emulated):
    """On the CPU, and for tables in device memory, ``prefetch`` stages nothing."""
    m = _module()
    m.prefetch(*_batch(torch.Generator().manual_seed(5)))
    assert m.group._stage is None
    single = CachedLowPrecisionEmbedding(3000, 8, cache_ratio=0.1)
    single.prefetch(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    assert single.group._stage is None


class _Model(torch.nn.Module):
    """The trainer's model: the tables under a linear layer, taking (ids, lengths) batches."""

    def __init__(self, seed):
        super().__init__()
        self.embedding_collection = _module(seed)
        torch.manual_seed(seed)
        self.top = torch.nn.Linear(38, 1)

    def forward(self, dense, batch):
        x = self.embedding_collection(*batch) + dense
        return self.top(x.to(self.top.weight.dtype))

    def prefetch(self, batch):
        self.embedding_collection.prefetch(*batch)


def test_the_trainer_prefetching_each_next_batch_trains_as_without(staging):
    """MixedPrecisionTrainer given each next batch (as dlrm train gives it) trains as the
    same trainer on the CPU ops without one, loss for loss, through a skipped step (an
    overflow: the gated update changes nothing, and its stale marks are harmless)."""
    gen = torch.Generator().manual_seed(9)
    trainers = [MixedPrecisionTrainer(_Model(1), lr=0.1) for _ in range(2)]
    batches = [_batch(gen) for _ in range(6)]
    for step, batch in enumerate(batches):
        dense, labels = torch.randn(24, 38, generator=gen), torch.rand(24, generator=gen).round()
        if step == 3:
            dense[0, 0] = float("inf")
        following = batches[step + 1] if step + 1 < len(batches) else None
        ours = trainers[0].train_step(dense, batch, labels, next_sparse=following)
        staged = trainers[0].model.embedding_collection.group._stage
        assert (staged is not None) == (following is not None)  # the next step's, made
        with pytest.MonkeyPatch.context() as m:
            m.setattr(embcache.group, "_ops", embcache.group._ops.cpu_ops)
            theirs = trainers[1].train_step(dense, batch, labels)
        assert ours["skipped"] == theirs["skipped"] == (step == 3)
        torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=0, atol=0, equal_nan=True)
    a, b = (t.model.embedding_collection for t in trainers)
    assert _same(_tables(a), _tables(b))


def test_a_stage_too_narrow_for_a_tables_rows_is_not_read(emulated):
    """A stage whose rows are narrower than a table's (a stage of other tables) is not read
    for it, even where its keys name the table's rows: no value changes, no read past it."""
    m = small_bags([BagTable("w", 900, 8)], precision="fp32")  # 32-byte rows
    ids = torch.randint(0, 900, (40,))
    lengths = torch.full((8,), 5)
    group = m.group
    slots, rows = EMU.stage_misses(group.state(), group.specs, ids, lengths, [0], 8, [0])
    assert int((slots[:, 0] != NO_ROW).sum()) > 0 and rows.shape[1] == 32
    narrow = torch.full((40, 16), 0xFF, dtype=torch.uint8)  # its keys, narrower rows
    args = (group.state(), group.specs, ids, lengths, None, [0], 8, [])
    staged = EMU.multi_lookup_forward(*args, slots, narrow)[0]
    assert torch.equal(staged, EMU.multi_lookup_forward(*args)[0])
    assert torch.equal(EMU.multi_lookup_forward(*args, slots, rows)[0], staged)  # (read: same)


def test_dlrm_prefetches_through_embcache_collections_only(staging):
    """DLRM.prefetch (what dlrm's trainer calls) stages through our tables, given the ids as
    a tensor whichever interface the collection has; a TorchRec collection's prefetch, of
    another kind, is never called."""
    from dlrm.model import DLRM
    from dlrm.torchrec_adapter import make_torchrec_ebc
    from embcache import CachedLowPrecisionEmbeddingBagCollection

    names = [f"f{i}" for i in range(26)]
    bags = [BagTable(f"t{i}", 500, 16, (name,)) for i, name in enumerate(names)]
    ids = torch.randint(0, 500, (8, 26))
    options = dict(cache_ratio=0.1, min_rows_for_low_precision=0)
    for tables in (
        CachedLowPrecisionEmbeddingBags(bags, **options),
        CachedLowPrecisionEmbeddingBagCollection.from_bag_tables(bags, **options),
    ):
        DLRM.from_preset("kaggle", tables).prefetch(ids)
        assert tables.group._stage is not None and tables.group._stage.lookups == 8 * 26
    DLRM.from_preset("kaggle", make_torchrec_ebc([500] * 26, 16, names)).prefetch(ids)
