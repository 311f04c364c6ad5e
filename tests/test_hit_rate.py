"""bench/hit_rate.py and bench/skew.py: the replay counts what training counts, and the scripts
write their outputs."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.train import RunConfig, train
from embcache import CachedLowPrecisionEmbeddingBagCollection

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common  # noqa: E402
import hit_rate  # noqa: E402
import skew  # noqa: E402

CARDS = [1500, 6000]
BATCH, STEPS = 128, 15
COMPARED = ("lookups", "hits", "unique_rows", "unique_hits", "insertions", "evictions", "bypasses")


def _stream(seed=0):
    """Power-law ids, one per sample per table: int64 [tables, STEPS * BATCH]."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(STEPS * BATCH, generator=gen) ** 3 * n).long() for n in CARDS]


@pytest.mark.parametrize(
    "policy,ways,ratio",
    [
        ("lru", 1, 0.05),
        ("lru", 4, 0.1),
        ("lru", 32, 0.3),
        ("lfu", 1, 0.05),
        ("lfu", 8, 0.3),
        ("lfu", 32, 0.1),
    ],
)
def test_replay_counts_what_training_counts(policy, ways, ratio):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(CARDS)
    ]
    ebc = CachedLowPrecisionEmbeddingBagCollection(
        tables,
        precision="int8",
        cache_ratio=ratio,
        associativity=ways,
        policy=policy,
        optimizer="rowwise_adagrad",
        lr=0.1,
    )
    ids = _stream()
    gen = torch.Generator().manual_seed(1)
    for s in range(STEPS):
        kjt = KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.cat([i[s * BATCH : (s + 1) * BATCH] for i in ids]),
            lengths=torch.ones(2 * BATCH, dtype=torch.int32),
            stride=BATCH,
        )
        out = ebc(kjt).values()
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        ebc.step()
    stats = ebc.stats()
    for i, n in enumerate(CARDS):
        counters, tags = hit_rate.replay(ids[i], n, BATCH, ratio, policy, ways)
        trained = stats[f"t{i}"]
        assert {k: counters[k] for k in COMPARED} == {k: trained[k] for k in COMPARED}
        assert trained["hits"] > 0 and trained["evictions"] > 0
        assert torch.equal(tags, ebc.embedding_bags[f"t{i}"].cache_tags)


def test_main_matches_a_dlrm_training_run_and_writes_outputs(tmp_path):
    cfg = RunConfig(
        synthetic_rows=20000, batch_size=256, steps=8, eval_every=0, progress=False, threads=1
    )
    report = train(cfg, tmp_path / "runs" / "run")
    out = tmp_path / "hit"
    result = hit_rate.main(
        [
            "--data",
            report["data"]["dir"],
            "--batch-size",
            "256",
            "--steps",
            "8",
            "--sizes",
            "5",
            "30",
            "--policies",
            "lru",
            "lfu",
            "--ways",
            "1",
            "32",
            "--out",
            str(out),
        ]
    )
    assert {p.name for p in out.iterdir()} == {"hit_rate.md", "hit_rate.json", "hit_rate.png"}
    assert "Overall hit rate" in (out / "hit_rate.md").read_text()
    assert json.loads((out / "hit_rate.json").read_text())["steps"] == 8
    trained = report["embeddings"]["tables"]
    replayed = {
        r["table"]: r["hits"] / r["lookups"]
        for r in result["records"]
        if (r["size"], r["policy"], r["ways"]) == (5, "lfu", 32)
    }
    assert replayed and replayed == {
        name: t["hit_rate"] for name, t in trained.items() if t["precision"] != "fp32"
    }
    assert max(replayed.values()) > 0


def test_trace_input_and_skew_shares(tmp_path):
    hot = np.concatenate(
        [np.zeros(501, np.int64), np.arange(1, 1000)]
    )  # row 0: 501 of 1500 accesses
    trace = np.stack([hot, np.arange(1500) % 10], axis=1)  # table 1: 10 rows, 150 accesses each
    path = tmp_path / "trace.npy"
    np.save(path, trace)

    result = skew.main(
        [
            "--data",
            str(path),
            "--min-rows",
            "1",
            "--fractions",
            "0.001",
            "0.1",
            "0.5",
            "--out",
            str(tmp_path / "skew"),
        ]
    )
    t0, t1 = result["tables"]
    assert (t0["rows"], t0["accesses"]) == (1000, 1500)
    assert t0["hottest 0.1%"] == pytest.approx(501 / 1500) and t0["hottest 50%"] == pytest.approx(
        1000 / 1500
    )
    assert t1["hottest 0.1%"] == pytest.approx(0.1) and t1["hottest 50%"] == pytest.approx(0.5)
    assert (tmp_path / "skew" / "skew.png").stat().st_size > 0

    result = hit_rate.main(
        [
            "--data",
            str(path),
            "--min-rows",
            "1000",
            "--batch-size",
            "100",
            "--sizes",
            "10",
            "--policies",
            "lfu",
            "--ways",
            "4",
            "--out",
            str(tmp_path / "hit"),
        ]
    )
    (record,) = result["records"]
    direct, _ = hit_rate.replay(torch.from_numpy(hot), 1000, 100, 0.1, "lfu", 4)
    assert record["table"] == "t_0" and record["hits"] == direct["hits"] > 0
    assert result["left_out"] == ["t_1"]


def test_outputs_are_replaced_whole(tmp_path):
    """A write interrupted half-way leaves the old file and no temporary one."""
    path = tmp_path / "out.json"
    path.write_text("old")

    def interrupted(tmp):
        tmp.write_text("ha")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _common.write_atomic(path, interrupted)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]
    _common.write_text(path, "new")
    assert path.read_text() == "new" and list(tmp_path.iterdir()) == [path]
