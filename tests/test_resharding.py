"""Loading tables from a checkpoint saved under another sharding (embcache.resharding).

The oracle is the saved table itself: a table loaded whole under its own name is its saved
state byte for byte; rows loaded into another split are the saved rows after a write-back of
the cache (``flush``), with their optimizer state and LFU counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from embcache import CachedLowPrecisionEmbedding
from embcache.resharding import SavedTables, load_tables, split_name
from embcache.sharding import shard_config

ROWS, DIM = 3000, 8
OPTIONS = dict(
    precision="int8",
    rounding="stochastic",
    cache_ratio=0.05,
    associativity=4,
    policy="lfu",
    optimizer="rowwise_adagrad",
    lr=0.05,
    seed=11,
    name="t",
)
PREFIX = "model.tables."


def _trained(seed: int) -> CachedLowPrecisionEmbedding:
    """The whole table after a few updates: rows cached, counts and AdaGrad state set."""
    table = CachedLowPrecisionEmbedding(ROWS, DIM, **OPTIONS)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        ids = (torch.rand(64, 3, generator=gen) ** 3 * ROWS).long()
        table(ids).pow(2).sum().backward()
        table.step()
    assert (table.cache_tags >= 0).any()
    return table


def _shard(name: str, rows: int) -> CachedLowPrecisionEmbedding:
    """A table of ``rows`` rows on the meta device, configured as shard ``name``."""
    whole = CachedLowPrecisionEmbedding(ROWS, DIM, device="meta", **OPTIONS).config
    config = shard_config(whole, rows).to_dict()
    config["name"] = name
    del config["num_embeddings"], config["embedding_dim"]
    return CachedLowPrecisionEmbedding(rows, DIM, device="meta", **config)


def _save(path, tables: dict) -> None:
    state = {"model": {"tables": {n: t.state_dict() for n, t in tables.items()}}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _saved(path) -> SavedTables:
    return SavedTables.from_dcp(path, PREFIX)


def _flushed(table: CachedLowPrecisionEmbedding) -> CachedLowPrecisionEmbedding:
    copy = CachedLowPrecisionEmbedding.from_state(table.state_dict())
    copy.flush()
    return copy


def test_split_name():
    assert split_name("t_2@2001") == ("t_2", 2001)
    assert split_name("t_2") == ("t_2", 0)
    assert split_name("a@b") == ("a@b", 0)


def test_a_table_saved_whole_loads_exactly_and_splits_into_its_flushed_rows(tmp_path):
    seed = int(torch.randint(0, 1 << 30, ()))
    table = _trained(seed)
    _save(tmp_path / "ckpt", {"t": table})
    assert [s.rows for s in _saved(tmp_path / "ckpt").shards["t"]] == [ROWS]

    same = CachedLowPrecisionEmbedding(ROWS, DIM, device="meta", **OPTIONS)
    load_tables(_saved(tmp_path / "ckpt"), {"t": same})
    for key, value in table.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(same.state_dict()[key], value), key
        else:
            assert same.state_dict()[key] == value, key

    cut = int(torch.randint(1, ROWS - 1, ()))
    shards = {"t@0": _shard("t@0", cut), f"t@{cut}": _shard(f"t@{cut}", ROWS - cut)}
    load_tables(_saved(tmp_path / "ckpt"), shards)
    flushed = _flushed(table)
    for name, shard in shards.items():
        start = split_name(name)[1]
        stop = start + shard.config.num_embeddings
        assert torch.equal(shard.weights, flushed.weights[start:stop])
        assert torch.equal(shard.optimizer_state, flushed.optimizer_state[start:stop])
        if shard.config.num_slots:  # a shard too small for a cache keeps no LFU counts
            assert torch.equal(shard.counts, flushed.counts[start:stop])
        assert shard.step_count == table.step_count == 4
        assert not (shard.cache_tags >= 0).any()


def test_row_wise_shards_load_into_another_split_and_back_into_one_table(tmp_path):
    table = _trained(int(torch.randint(0, 1 << 30, ())))
    flushed = _flushed(table)
    _save(tmp_path / "whole", {"t": table})
    saved = {"t@0": _shard("t@0", 1000), "t@1000": _shard("t@1000", 2000)}
    load_tables(_saved(tmp_path / "whole"), saved)
    _save(tmp_path / "rw", saved)

    # 3 ranks' shards, each crossing the saved boundary or not, and the table whole
    targets = {
        "t@0": _shard("t@0", 700),
        "t@700": _shard("t@700", 1600),
        "t@2300": _shard("t@2300", 700),
    }
    load_tables(_saved(tmp_path / "rw"), targets)
    for name, shard in targets.items():
        start = split_name(name)[1]
        stop = start + shard.config.num_embeddings
        assert torch.equal(shard.weights, flushed.weights[start:stop]), name
        assert torch.equal(shard.optimizer_state, flushed.optimizer_state[start:stop]), name
    in_memory = {
        PREFIX + name + "." + key: value
        for name, shard in saved.items()
        for key, value in shard.state_dict().items()
    }
    for source in (_saved(tmp_path / "rw"), SavedTables.from_state_dict(in_memory, PREFIX)):
        whole = CachedLowPrecisionEmbedding(ROWS, DIM, device="meta", **OPTIONS)
        load_tables(source, {"t": whole})
        assert torch.equal(whole.weights, flushed.weights)
        assert torch.equal(whole.counts, flushed.counts)
        assert whole.step_count == 4


def test_missing_rows_are_refused_before_any_table_is_written(tmp_path):
    table = _trained(0)
    half = _shard("t@0", 1500)
    load_tables_path = tmp_path / "half"
    _save(tmp_path / "whole", {"t": table})
    load_tables(_saved(tmp_path / "whole"), {"t@0": half})
    _save(load_tables_path, {"t@0": half})  # rows [1500, 3000) were never saved
    first = _shard("t@0", 1000)
    whole = CachedLowPrecisionEmbedding(ROWS, DIM, device="meta", **OPTIONS)
    with pytest.raises(ValueError, match=r"table 't': .* does not hold its rows \[1500, 3000\)"):
        load_tables(_saved(load_tables_path), {"t@0": first, "t": whole})
    assert first.weights.is_meta and whole.weights.is_meta
    other = CachedLowPrecisionEmbedding(10, DIM, device="meta", **{**OPTIONS, "name": "u"})
    with pytest.raises(ValueError, match="table 'u': .* has no table 'u'"):
        load_tables(_saved(load_tables_path), {"u": other})
