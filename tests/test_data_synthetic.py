"""Synthetic Criteo-like data (dlrm.data.synthetic)."""

import subprocess
import sys

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from dlrm.data import batches, synthetic
from dlrm.data.criteo import KAGGLE_CARDINALITIES
from dlrm.data.synthetic import BLOCK_ROWS, SyntheticCriteo, _auc, scaled_cardinalities


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


def test_threads_do_not_change_the_data(gen):
    """Blocks generated in parallel come back in order: the same rows with 1 or 3 threads."""
    one = SyntheticCriteo(seed=3, threads=1).rows(1000, 5 * BLOCK_ROWS + 17)
    three = SyntheticCriteo(seed=3, threads=3).rows(1000, 5 * BLOCK_ROWS + 17)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(a, b)


def test_full_scale_ids_in_range():
    """At Kaggle's full cardinalities (33.8M ids) every id is in [0, n), and each table's
    rank -> id map is a bijection (checked whole on the tables up to 1M ids)."""
    gen = SyntheticCriteo(scale=1.0, seed=1)
    assert gen.cardinalities == list(KAGGLE_CARDINALITIES)
    sparse = gen.rows(0, 3 * BLOCK_ROWS)[1]
    assert (sparse >= 0).all() and (sparse < np.array(KAGGLE_CARDINALITIES)).all()
    assert (sparse.max(axis=0) > np.array(KAGGLE_CARDINALITIES) // 2).sum() >= 20  # spread out
    for t, n in enumerate(KAGGLE_CARDINALITIES):
        if n <= 1_000_000:
            ranks = np.zeros((n, 26), np.int64)
            ranks[:, t] = np.arange(n)
            ids = gen.ids_of_ranks(ranks)[:, t]
            assert np.array_equal(np.sort(ids), np.arange(n)), t


def test_skew_matches_the_model(gen):
    """The share of the accesses taken by each table's hottest 1% of ids (the model's hottest:
    ranks 0..k-1) is what ``share_of_hottest`` promises, within sampling error; the hot ids
    are permuted, not 0, 1, 2, ..."""
    n_rows = 200_000
    sparse = gen.rows(0, n_rows)[1]
    checked = 0
    for t, n in enumerate(gen.cardinalities):
        k = int(np.ceil(0.01 * n))
        if n < 100:
            continue
        ranks = np.zeros((k, 26), np.int64)
        ranks[:, t] = np.arange(k)
        hot = gen.ids_of_ranks(ranks)[:, t]
        counts = np.bincount(sparse[:, t], minlength=n)
        share = counts[hot].sum() / n_rows
        assert share == pytest.approx(gen.share_of_hottest(t, k), abs=0.01), t
        assert 0.05 < share < 0.95
        if n > 1000:
            assert set(np.argsort(counts)[::-1][:10]) != set(range(10))
        checked += 1
    assert checked >= 5
    # The model itself: the calibrated defaults (head, alpha) of a few columns.
    assert gen.share_of_hottest(8, 1) == pytest.approx(0.8 + 0.2 * (1 - 2**0.38) / (1 - 4**0.38))
    assert gen.share_of_hottest(2, gen.cardinalities[2]) == pytest.approx(1.0)


def test_bayes_auc_at_full_scale():
    auc = SyntheticCriteo(scale=1.0, seed=2).bayes_auc(100_000)
    assert 0.75 < auc < 0.88


def test_memory_bounded_at_full_scale():
    """Building the full-scale generator (33.8M ids) and generating 100k rows raises the peak
    RSS (VmHWM of a fresh process, measured after the imports) by less than 300 MB."""
    code = """
import sys
from dlrm.data.synthetic import SyntheticCriteo

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before = hwm()
gen = SyntheticCriteo(scale=1.0, seed=0)
rows = gen.rows(0, 100_000)
assert len(rows[2]) == 100_000
print(hwm() - before)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown = int(done.stdout.split()[-1])
    assert grown < 300 * 2**20, f"peak RSS grew by {grown / 2**20:.0f} MB"


def test_auc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 50, 5000):
        scores = np.round(rng.normal(size=n), 1).astype(np.float32)  # many ties, -0.0 too
        labels = (rng.random(n) < 1 / (1 + np.exp(-scores))).astype(np.float32)
        labels[:2] = [0, 1]
        assert _auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert _auc(np.ones(4), np.arange(4, dtype=np.float32)) is None


def test_progress_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(synthetic, "PROGRESS_MIN_ROWS", 1000)
    SyntheticCriteo(seed=5).write(tmp_path / "a", 2000, progress=False)
    assert "synthetic data" not in capsys.readouterr().err
    SyntheticCriteo(seed=5).write(tmp_path / "b", 2000)
    assert "synthetic data" in capsys.readouterr().err


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
        np.testing.assert_array_equal(a.dense.numpy(), b.dense.numpy())
        np.testing.assert_array_equal(a.ids.numpy(), b.ids.numpy())
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
