"""Criteo preprocessing (dlrm.data.criteo) and mini-batches (dlrm.data.batches) on real rows."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm.data import batches, criteo
from dlrm.data.criteo import DataError, preprocess_criteo

HEAD = Path(__file__).resolve().parents[1].parent / "shared/data/criteo_kaggle_train_head1000.tsv"
pytestmark = pytest.mark.skipif(not HEAD.is_file(), reason=f"real Criteo rows not found at {HEAD}")


def reference(lines):
    """Straightforward per-line reading of the format, for comparison: labels, dense, raw
    categoricals (None = missing)."""
    labels, dense, raw = [], [], []
    for line in lines:
        f = line.rstrip("\n").split("\t")
        f += [""] * (40 - len(f))
        labels.append(int(f[0]))
        dense.append([math.log(max(int(x or 0), 0) + 1) for x in f[1:14]])
        raw.append([int(x, 16) if x else None for x in f[14:]])
    return np.array(labels), np.array(dense), raw


def contiguous_ids(raw):
    """Expected ids: per column, distinct values sorted, missing first."""
    ids = np.zeros((len(raw), 26), np.int64)
    for c in range(26):
        column = [-1 if r[c] is None else r[c] for r in raw]
        ids[:, c] = np.searchsorted(np.unique(column), column)
    return ids


def load(path):
    return [np.load(Path(path) / name) for name in ("dense.npy", "sparse.npy", "labels.npy")]


@pytest.fixture(scope="module")
def head_lines():
    return HEAD.read_text().splitlines(keepends=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    meta = preprocess_criteo(HEAD, out, progress=False)
    return out, meta


def test_first_rows_hand_checked(prepared):
    out, meta = prepared
    dense, sparse, labels = load(out)
    # Line 1: 0  1 1 5 0 1382 4 15 2 181 1 2 <empty> 2  68fd1e64 80e26c9b ...
    assert labels[0] == 0 and labels[7] == 1
    assert dense[0, 0] == pytest.approx(math.log(2))
    assert dense[0, 4] == pytest.approx(math.log(1383))
    assert dense[0, 11] == 0  # empty
    assert dense[0, 12] == pytest.approx(math.log(3))
    # Line 5 has a dense value of -1 (column 1): clamped to 0.
    assert dense[4, 1] == 0
    # Lines 1 and 2 share 68fd1e64 in column 0 and 25c83c98 in column 4; line 3 differs.
    assert sparse[0, 0] == sparse[1, 0] != sparse[2, 0]
    assert sparse[0, 4] == sparse[1, 4] == sparse[2, 4]
    # Line 1 has an empty categorical 21: the missing id 0.
    assert meta["missing_ids"][21] == 0 and sparse[0, 21] == 0 and sparse[0, 20] != 0
    assert meta["cardinalities"] == (sparse.max(axis=0) + 1).tolist()
    assert meta["malformed"]["count"] == 0
    assert dense.dtype == np.float32 and sparse.dtype == np.int32 and labels.dtype == np.float32


def test_all_rows_match_reference(prepared, head_lines):
    out, _ = prepared
    dense, sparse, labels = load(out)
    ref_labels, ref_dense, raw = reference(head_lines)
    ragged = [i for i, line in enumerate(head_lines) if line.count("\t") < 39]
    assert len(ragged) > 0 and len(labels) == 1000
    np.testing.assert_array_equal(labels, ref_labels)
    np.testing.assert_allclose(dense, ref_dense, rtol=1e-6)
    np.testing.assert_array_equal(sparse, contiguous_ids(raw))
    assert (sparse[ragged, 25] == 0).all()  # the fields a ragged line lacks are missing


def test_split_ranges(prepared):
    _, meta = prepared
    # 1000 = 7 * 142 + 6: days 0-5 have 143 rows, day 6 has 142 = 71 test + 71 val.
    assert meta["splits"] == {"train": [0, 858], "test": [858, 929], "val": [929, 1000]}
    assert criteo.split_ranges(1001)["test"] == [858, 930]  # day 6 of 143: test gets 72
    for n in (1, 7, 13, 100):
        s = criteo.split_ranges(n)
        assert s["train"][0] == 0 and s["train"][1] == s["test"][0]
        assert s["test"][1] == s["val"][0] and s["val"][1] == n


def test_min_count(tmp_path, head_lines):
    meta = preprocess_criteo(HEAD, tmp_path, min_count=3, progress=False)
    _, sparse, _ = load(tmp_path)
    _, _, raw = reference(head_lines)
    for c in range(26):
        column = np.array([-1 if r[c] is None else r[c] for r in raw])
        values, counts = np.unique(column, return_counts=True)
        kept = values[(counts >= 3) | (values == -1)]
        rare = ~np.isin(column, kept)
        assert meta["rare_ids"][c] == (len(kept) if rare.any() else None)
        assert (sparse[rare, c] == len(kept)).all()
        np.testing.assert_array_equal(sparse[~rare, c], np.searchsorted(kept, column[~rare]))
        assert meta["cardinalities"][c] == len(kept) + rare.any()


def test_hashing(tmp_path, prepared, head_lines):
    meta = preprocess_criteo(HEAD, tmp_path, max_ind_range=50, progress=False)
    _, sparse, _ = load(tmp_path)
    _, contiguous, _ = load(prepared[0])
    _, _, raw = reference(head_lines)
    for c in range(26):
        if prepared[1]["cardinalities"][c] > 50:
            assert c in meta["hashed_columns"] and meta["cardinalities"][c] == 50
            expected = [0 if r[c] is None else 1 + r[c] % 49 for r in raw]
            np.testing.assert_array_equal(sparse[:, c], expected)
        else:
            assert c not in meta["hashed_columns"]
            np.testing.assert_array_equal(sparse[:, c], contiguous[:, c])


def test_malformed_lines_skipped_and_reported(tmp_path, prepared, head_lines):
    bad = {
        3: "2\t" + head_lines[0].split("\t", 1)[1],  # label 2
        10: head_lines[0].replace("\t1382\t", "\t13.5\t"),  # non-integer dense
        500: head_lines[0].replace("68fd1e64", "68fd1e6g"),  # non-hex
        501: head_lines[0].replace("68fd1e64", "68fd1e6400"),  # too long
        777: head_lines[0].rstrip("\n") + "\tabc\n",  # 41 fields
        900: "\n",  # blank line
    }
    lines = list(head_lines)
    for pos in sorted(bad):
        lines.insert(pos - 1, bad[pos])  # becomes line number `pos`
    src = tmp_path / "dirty.tsv"
    src.write_text("".join(lines).rstrip("\n"))  # and no newline at the end
    meta = preprocess_criteo(src, tmp_path / "out", chunk_bytes=4096, progress=False)
    report = meta["malformed"]
    assert report["count"] == 6 and report["policy"].startswith("skip")
    assert [f["line"] for f in report["first"]] == [3, 10, 500, 501, 777, 900]
    assert [f.get("field") for f in report["first"]] == [1, 6, 15, 15, 41, 1]
    assert report["by_reason"] == {
        "too many fields": 1,
        "bad label": 2,
        "bad dense value": 1,
        "bad categorical value": 2,
        "NUL byte": 0,
        "line too long": 0,
    }
    assert json.loads((tmp_path / "out/meta.json").read_text())["malformed"] == report
    for ours, clean in zip(load(tmp_path / "out"), load(prepared[0])):
        np.testing.assert_array_equal(ours, clean)


def test_user_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        preprocess_criteo(tmp_path / "absent.tsv", tmp_path / "out", progress=False)
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(DataError, match="empty.tsv: empty file"):
        preprocess_criteo(tmp_path / "empty.tsv", tmp_path / "out", progress=False)
    (tmp_path / "notes.txt").write_text("hello, world\nthis is not criteo\n")
    with pytest.raises(
        DataError, match=r"notes.txt: line 1, field 1 \(label\): bad label; .*not a Criteo TSV file"
    ):
        preprocess_criteo(tmp_path / "notes.txt", tmp_path / "out", progress=False)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(DataError, match="a_file/out"):
        preprocess_criteo(HEAD, blocker / "out", progress=False)
    with pytest.raises(DataError, match="meta.json"):
        batches.load(tmp_path)
    assert not (tmp_path / "out").exists()


def test_failure_leaves_no_partial_output(tmp_path, prepared, monkeypatch):
    out = tmp_path / "out"
    preprocess_criteo(HEAD, out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(*args):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(criteo._Column, "ids", fail)
    with pytest.raises(RuntimeError, match="injected"):
        preprocess_criteo(HEAD, out, min_count=2, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old output intact
    with pytest.raises(RuntimeError, match="injected"):
        preprocess_criteo(HEAD, tmp_path / "fresh", progress=False)
    assert list((tmp_path / "fresh").iterdir()) == []


def test_torchrec_npys_converted(tmp_path, head_lines):
    from torchrec.datasets.criteo import BinaryCriteoUtils

    src = tmp_path / "torchrec"
    src.mkdir()
    # TorchRec's row mapper needs all 40 fields: pad the ragged lines.
    padded = [line[:-1] + "\t" * (39 - line.count("\t")) + "\n" for line in head_lines[:240]]
    for day in range(2):
        tsv = tmp_path / f"day_{day}.tsv"
        tsv.write_text("".join(padded[day * 120 : (day + 1) * 120]))
        BinaryCriteoUtils.tsv_to_npys(
            str(tsv),
            *(str(src / f"day_{day}_{part}.npy") for part in ("dense", "sparse", "labels")),
        )
    (tmp_path / "all.tsv").write_text("".join(padded))

    meta = criteo.convert_torchrec_npys(src, tmp_path / "converted", progress=False)
    expected = preprocess_criteo(tmp_path / "all.tsv", tmp_path / "ours", progress=False)
    assert meta["source_files"] == ["day_0", "day_1"]
    assert meta["torchrec_dense_min"] == [-1, -1]  # the smallest raw integers of the two days
    assert meta["cardinalities"] == expected["cardinalities"]
    assert meta["splits"] == expected["splits"]
    converted, ours = load(tmp_path / "converted"), load(tmp_path / "ours")
    np.testing.assert_allclose(converted[0], ours[0], rtol=1e-6)
    np.testing.assert_array_equal(converted[1], ours[1])
    np.testing.assert_array_equal(converted[2], ours[2])


def test_batches(prepared):
    out, meta = prepared
    dense, sparse, labels = load(out)
    assert batches.cardinalities(out) == meta["cardinalities"]
    ds = batches.load(out)

    plain = list(batches.iterate_batches(ds, "val", 32))
    assert [len(b.labels) for b in plain] == [32, 32, 7]  # val = rows 929..999
    b = plain[1]
    assert b.ids.shape == (32, 26) and b.ids.dtype == torch.int32
    np.testing.assert_array_equal(b.ids.numpy(), sparse[961:993])
    np.testing.assert_array_equal(b.dense.numpy(), dense[961:993])
    np.testing.assert_array_equal(b.labels.numpy(), labels[961:993])
    assert len(list(batches.iterate_batches(ds, "val", 32, drop_last=True))) == 2

    def rows(batch):  # identify rows by their dense values and labels
        return [tuple(r) for r in np.column_stack([batch.dense.numpy(), batch.labels.numpy()])]

    epoch0 = list(batches.iterate_batches(ds, "train", 100, shuffle=True, seed=1, epoch=0))
    again = list(batches.iterate_batches(out, "train", 100, shuffle=True, seed=1, epoch=0))
    epoch1 = list(batches.iterate_batches(ds, "train", 100, shuffle=True, seed=1, epoch=1))
    assert [rows(b) for b in epoch0] == [rows(b) for b in again]
    assert [rows(b) for b in epoch0] != [rows(b) for b in epoch1]
    assert sorted(r for b in epoch0 for r in rows(b)) == sorted(
        tuple(r) for r in np.column_stack([dense[:858], labels[:858]])
    )
    resumed = list(
        batches.iterate_batches(ds, "train", 100, shuffle=True, seed=1, epoch=0, start_batch=6)
    )
    assert [rows(b) for b in resumed] == [rows(b) for b in epoch0[6:]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_parts_are_the_batch_in_order(prepared, shuffle):
    """Three processes reading parts (i, 3) of each batch see the whole batch between them,
    in order, in parts whose sizes differ by at most one."""
    ds = batches.load(prepared[0])
    kwargs = dict(shuffle=shuffle, seed=2)
    whole = list(batches.iterate_batches(ds, "val", 32, **kwargs))
    parts = [list(batches.iterate_batches(ds, "val", 32, part=(i, 3), **kwargs)) for i in range(3)]
    for b, batch in enumerate(whole):
        pieces = [p[b] for p in parts]
        sizes = [len(p.labels) for p in pieces]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(batch.labels)
        for field in ("dense", "ids", "labels"):
            got = torch.cat([getattr(p, field) for p in pieces])
            assert torch.equal(got, getattr(batch, field))
