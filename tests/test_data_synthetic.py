"""Synthetic Criteo-like data (dlrm.data.synthetic)."""

import time

import numpy as np
import pytest

from dlrm.data import batches
from dlrm.data.criteo import KAGGLE_CARDINALITIES
from dlrm.data.synthetic import SyntheticCriteo, scaled_cardinalities


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


def test_fast_enough(tmp_path):
    start = time.perf_counter()
    SyntheticCriteo(seed=5).write(tmp_path, 200_000)
    assert time.perf_counter() - start < 10
