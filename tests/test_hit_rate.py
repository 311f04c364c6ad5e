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

from dlrm.config import RunConfig
from dlrm.train import train
from embcache import CachedLowPrecisionEmbeddingBagCollection
from embcache.config import COUNTERS
from embcache.telemetry import PROBE_COUNTERS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _common  # noqa: E402
import hit_rate  # noqa: E402
import skew  # noqa: E402

CARDS = [1500, 6000]
BATCH, STEPS = 128, 15
# a replay flushes and rounds nothing
COMPARED = tuple(c for c in COUNTERS if c != "flushed" and c not in PROBE_COUNTERS)


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
    # A static loss scale of 1 skips no step (a skipped step changes no cache; the replay
    # knows of no skipped steps).
    cfg = RunConfig(
        synthetic_scale=0.001,
        synthetic_rows=20000,
        batch_size=256,
        steps=8,
        eval_every=0,
        progress=False,
        threads=1,
        loss_scaler="static",
        static_scale=1.0,
    )
    report = train(cfg, tmp_path / "runs" / "run")
    assert report["skipped_steps"] == 0
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
    md = (out / "hit_rate.md").read_text()
    assert "Overall hit rate" in md and "## Regime: distinct rows per step per slot" in md
    assert "| distinct rows / step / slot |" in md and "Observed rule" in md
    saved = json.loads((out / "hit_rate.json").read_text())
    meta = json.loads((Path(report["data"]["dir"]) / "meta.json").read_text())
    assert saved["cardinalities"] == list(meta["cardinalities"])
    assert (saved["batch_size"], saved["steps"], saved["trace_rows"]) == (256, 8, 8 * 256)
    assert saved["lookups_per_table"] == 8 * 256
    env = saved["environment"]
    assert env["command"].startswith("python bench/hit_rate.py --data ")
    assert {"commit", "dirty", "cpu_model", "cores", "threads", "torch", "date"} <= set(env)
    for r in saved["records"]:
        assert r["distinct_per_step"] == pytest.approx(r["unique_rows"] / 8)
        if r["slots"]:
            assert r["distinct_per_set"] == pytest.approx(r["unique_rows"] / 8 / r["sets"])
            assert r["distinct_per_slot"] == pytest.approx(r["unique_rows"] / 8 / r["slots"])
        else:
            assert r["distinct_per_set"] is None and r["distinct_per_slot"] is None
    assert {(r["table"], r["size"]) for r in saved["regime"]} == {
        (r["table"], r["size"]) for r in saved["records"]
    }
    assert [r["policy"] for r in saved["rule"]] == ["lru", "lfu"]
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


def test_regime_counts_distinct_rows_per_step_and_the_rule(tmp_path):
    """The regime columns against a direct count on a trace; the rule's threshold on a case
    built so that the many-way cache loses exactly where a step touches many rows per slot."""
    rng = np.random.default_rng(0)
    batch, steps = 64, 12
    trace = np.stack(
        [(rng.random(batch * steps) ** 2 * n).astype(np.int64) for n in (4000, 1200)], axis=1
    )
    trace[0] = [3999, 1199]  # the largest ids: cardinalities 4000 and 1200
    path = tmp_path / "trace.npy"
    np.save(path, trace)
    result = hit_rate.main(
        [
            "--data",
            str(path),
            "--batch-size",
            str(batch),
            "--sizes",
            "1",
            "10",
            "--policies",
            "lru",
            "--ways",
            "1",
            "4",
            "--out",
            str(tmp_path / "hit"),
        ]
    )
    assert result["cardinalities"] == [4000, 1200]
    assert (result["trace_rows"], result["steps"]) == (batch * steps, steps)
    for t, n in enumerate((4000, 1200)):
        per_step = np.mean([len(np.unique(s)) for s in trace[:, t].reshape(steps, batch)])
        for size in (1, 10):
            (reg,) = [r for r in result["regime"] if (r["table"], r["size"]) == (f"t_{t}", size)]
            slots = int(size / 100 * n)
            assert reg["slots"] == slots and reg["distinct_per_step"] == pytest.approx(per_step)
            assert reg["step_per_slot"] == pytest.approx(per_step / slots)
            assert reg["trace_distinct"] == len(np.unique(trace[:, t]))
    md = (tmp_path / "hit" / "hit_rate.md").read_text()
    reg = result["regime"][0]
    assert f"| {reg['table']} | {reg['rows']} | {reg['step_per_slot']:.3g} |" in md

    rows = []
    for table, _ratio, direct, many in [
        ("a", 0.1, 0.5, 0.6),
        ("b", 0.5, 0.5, 0.55),
        ("c", 2.0, 0.4, 0.3),
        ("d", 4.0, 0.3, 0.1),
    ]:
        for ways, rate in ((1, direct), (32, many)):
            rows.append(
                {
                    "table": table,
                    "size": 5,
                    "policy": "lru",
                    "ways": ways,
                    "slots": 100,
                    "hits": rate * 1000,
                    "lookups": 1000,
                }
            )
    df = hit_rate.pd.DataFrame(rows)
    regime = hit_rate.pd.DataFrame(
        {"table": list("abcd"), "size": 5, "step_per_slot": [0.1, 0.5, 2.0, 4.0]}
    )
    (rule,) = hit_rate.regime_rule(df, regime)
    assert rule["threshold_distinct_per_step_per_slot"] == 2.0
    assert (rule["cells_losing"], rule["losing_at_or_above"], rule["losing_below"]) == (2, 2, 0)
    assert (
        "in 2 of the 2 cells whose step touches at least 2 distinct rows per slot"
        in (hit_rate.rule_sentences([rule])[0])
    )
