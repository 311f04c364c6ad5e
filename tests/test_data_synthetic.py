"""Synthetic Criteo-like data (dlrm.data.synthetic)."""

import numpy as np
import pytest

from dlrm.data import batches
from dlrm.data.criteo import KAGGLE_CARDINALITIES
from dlrm.data.synthetic import BLOCK_ROWS, SyntheticCriteo, scaled_cardinalities


@pytest.fixture(scope="module")
def gen():
    return SyntheticCriteo(seed=3)


@pytest.fixture(scope="module")
def written(gen, tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    return out, gen.write(out, 50_000)


def test_deterministic_and_chunked_equals_whole(gen, written):
    whole = gen.rows(0, 40_000)
    again = SyntheticCriteo(seed=3).rows(0, 40_000)
    chunked = [np.concatenate(p) for p in zip(gen.rows(0, 12_345), gen.rows(12_345, 40_000))]
    for a, b, c in zip(whole, again, chunked):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    other = SyntheticCriteo(seed=4).rows(0, 1000)
    assert not np.array_equal(whole[1][:1000], other[1])
    out, _ = written
    on_disk = [np.load(out / name) for name in ("dense.npy", "sparse.npy", "labels.npy")]
    for a, b in zip(gen.rows(0, 50_000), on_disk):
        np.testing.assert_array_equal(a, b)


def test_cardinalities(gen):
    assert scaled_cardinalities(1.0) == list(KAGGLE_CARDINALITIES)
    cards = scaled_cardinalities(0.001)
    assert cards[2] == 10131 and cards[8] == 3 and cards[19] == 4 and cards[16] == 10
    assert min(cards) >= 2 and gen.cardinalities == cards
    _, sparse, labels, prob = gen.rows(0, 20_000)
    assert sparse.dtype == np.int32 and (sparse >= 0).all()
    assert (sparse < np.array(cards)).all()
    assert set(np.unique(labels)) == {0.0, 1.0} and ((prob > 0) & (prob < 1)).all()


def test_skew(gen):
    ids = gen.rows(0, 100_000)[1][:, 2]  # the table of 10131 ids
    counts = np.sort(np.bincount(ids, minlength=10131))[::-1]
    assert counts[:101].sum() / len(ids) > 0.4  # the top 1% of ids get a large share
    hot = np.argsort(np.bincount(ids))[::-1][:10]
    assert set(hot) != set(range(10))  # hot ids are permuted, not 0, 1, 2, ...


def test_learnable(written):
    _, meta = written
    assert meta["bayes_auc"] > 0.75
    assert all(auc > 0.7 for auc in meta["bayes_auc_splits"].values())
    assert meta["positive_rate"] == pytest.approx(0.25, abs=0.03)
    assert meta["generator"]["seed"] == 3 and meta["rows"] == 50_000


def test_batches_on_the_fly_match_disk(gen, written):
    out, meta = written
    assert batches.cardinalities(out) == gen.cardinalities
    disk = list(batches.iterate_batches(out, "val", 1000, start_batch=1))
    fly = list(gen.batches(50_000, "val", 1000, start_batch=1))
    assert len(fly) == len(disk) == 3 and len(fly[-1].labels) == 571  # val: 3571 rows
    for a, b in zip(fly, disk):
        assert a.sparse.keys() == b.sparse.keys()
        np.testing.assert_array_equal(a.dense.numpy(), b.dense.numpy())
        np.testing.assert_array_equal(a.sparse.values().numpy(), b.sparse.values().numpy())
        np.testing.assert_array_equal(a.labels.numpy(), b.labels.numpy())
    assert len(list(gen.batches(50_000, "val", 1000, drop_last=True))) == 3


def test_written_block_by_block(tmp_path, monkeypatch):
    """Generation is vectorized, block by block (BLOCK_ROWS rows per numpy call): writing a
    data set that spans two of write's chunks (16 blocks each, the second partial) draws
    every block exactly once, and the files hold the rows ``rows()`` gives. (In place of a
    wall-clock bound, which depends on the machine.)"""
    drawn = []
    block = SyntheticCriteo._block

    def counted(self, i):
        drawn.append(i)
        return block(self, i)

    monkeypatch.setattr(SyntheticCriteo, "_block", counted)
    n = 16 * BLOCK_ROWS + 1000
    gen = SyntheticCriteo(seed=5)
    meta = gen.write(tmp_path, n)
    assert sorted(drawn) == list(range(-(-n // BLOCK_ROWS)))  # 17 blocks, each once
    assert meta["rows"] == n
    on_disk = [np.load(tmp_path / name) for name in ("dense.npy", "sparse.npy", "labels.npy")]
    assert [a.shape for a in on_disk] == [(n, 13), (n, 26), (n,)]
    for lo, hi in ((0, 1000), (16 * BLOCK_ROWS - 500, n)):  # both chunks, across the seam
        for a, b in zip(gen.rows(lo, hi), on_disk):
            np.testing.assert_array_equal(a, b[lo:hi])
