"""The memory-budget planner (docs/design.md, "The memory-budget planner"): a plan fits its
budget in the bytes the tables really allocate, is the best combination of candidates but for
a grid step per table, never has a larger proxy for a larger budget; an unmeetable budget is
refused naming the smallest; caches go where the sample reuses rows; the plan is plain JSON;
``dlrm plan`` and ``dlrm train --memory-budget`` use it."""

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from dlrm.cli import main
from dlrm.config import RunConfig
from dlrm.data.criteo import preprocess_criteo
from embcache import CachedLowPrecisionEmbedding, TableConfig, fp32_bytes, memory_breakdown, plan
from embcache.config import PRECISION_BITS
from embcache.planner import (
    CACHE_RATIOS,
    candidates,
    overrides,
    replay,
    rounding_noise,
    smallest_budget,
)

CRITEO = Path("/work/shared/data/criteo_kaggle_train_head10000.tsv")
BATCH = 256
# named as dlrm's tables, so that a plan's overrides are a RunConfig's too
TABLES = [
    TableConfig(300, 8, name="t_0"),  # below min_rows_for_low_precision: FP32
    TableConfig(20_000, 16, name="t_1", optimizer="rowwise_adagrad"),
    TableConfig(40_000, 4, name="t_2", policy="lru", qparams="fp32"),
    TableConfig(3_000, 32, name="t_3", optimizer="adagrad"),
]
POWERS = (1, 4, 1, 8)  # ids rand ** power * rows: 1 uniform, larger more skewed
# what dlrm plan and dlrm train share; a training run adds "--threads", "1"
SMALL = ["--synthetic-scale", "0.001", "--batch-size", "256", "--no-progress"]


def _ids(tables, powers, steps=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        t.name: (torch.rand(steps * BATCH, generator=gen) ** p * t.num_embeddings).long()
        for t, p in zip(tables, powers)
    }


@pytest.fixture(scope="module")
def ids():
    return _ids(TABLES, POWERS)


@pytest.fixture(scope="module")
def bounds():
    """(smallest budget, FP32 bytes) of TABLES."""
    return smallest_budget(TABLES), sum(fp32_bytes(t) for t in TABLES)


def _proxy(p):
    """The proxy as plan's docstring states it, from the plan's own figures."""
    error = sum(
        round(t["lookups"] * (1 - t["hit_rate"])) * t["dim"] * rounding_noise(t["precision"])
        for t in p["tables"]
    )
    return error / sum(t["lookups"] * t["dim"] for t in p["tables"])


def test_a_plan_fits_its_budget_in_the_bytes_the_tables_allocate(ids, bounds, one_thread):
    low, high = bounds
    for budget in (low, (2 * low + high) // 3, (low + high) // 2, high):
        p = plan(TABLES, budget, ids, batch_size=BATCH)
        assert p["budget"] == budget and p["total_bytes"] <= budget
        assert p["total_bytes"] == sum(t["bytes"] for t in p["tables"])
        assert p["proxy"] == pytest.approx(_proxy(p), rel=1e-12, abs=0)
        for base, t in zip(TABLES, p["tables"]):
            options = {**base.to_dict(), **overrides(p)[base.name]}
            built = CachedLowPrecisionEmbedding(
                options.pop("num_embeddings"), options.pop("embedding_dim"), **options
            )
            assert sum(b.nbytes for b in built.buffers()) == t["bytes"], t
            assert built.config.stored_precision == t["precision"]
            assert built.config.num_slots == t["cache_slots"]
    assert p["total_bytes"] > (low + high) // 2  # the largest budget was used, not only met


def test_a_larger_budget_never_gives_a_larger_proxy(ids, bounds, one_thread):
    low, high = bounds
    budgets = [low + (high - low) * k // 12 for k in range(13)] + [high * 2]
    proxies = [plan(TABLES, b, ids, batch_size=BATCH)["proxy"] for b in budgets]
    assert all(a >= b for a, b in zip(proxies, proxies[1:])), proxies
    assert proxies[0] > proxies[len(budgets) // 2] > proxies[-1] == 0


def test_a_plan_is_the_best_combination_but_for_a_grid_step_per_table(ids, one_thread):
    """Against every combination of candidates (a small grid; hits replayed here, the proxy as
    plan's docstring defines it): the plan is never better than the best that fits its budget
    (it is honest) and never worse than the best that fits a slightly smaller one (the search
    may leave one step of 1/65536 of the bytes' spread per table unused)."""
    grid = {"cache_ratios": (0.02, 0.1), "associativities": (1, 32)}
    per_table = []
    for t in TABLES:
        found = []
        for c in candidates(t, **grid):
            hits = replay(ids[t.name], t.num_embeddings, BATCH, c.cache_ratio, c.policy, c.ways)
            misses = len(ids[t.name]) - (hits[0]["hits"] if c.num_slots else 0)
            error = misses * t.embedding_dim * rounding_noise(c.stored_precision)
            found.append((memory_breakdown(c)["total"], error))
        per_table.append(found)
    scale = sum(len(ids[t.name]) * t.embedding_dim for t in TABLES)
    combos = [(sum(b for b, _ in c), sum(e for _, e in c)) for c in itertools.product(*per_table)]
    spread = sum(max(b for b, _ in f) - min(b for b, _ in f) for f in per_table)

    def best(budget):
        return min(e for b, e in combos if b <= budget) / scale

    low = sum(min(b for b, _ in f) for f in per_table)
    for budget in [low + spread * k // 29 for k in range(30)]:
        p = plan(TABLES, budget, ids, batch_size=BATCH, **grid)
        slack = len(TABLES) * (spread // 65536 + 1)
        assert best(budget) <= p["proxy"] * (1 + 1e-12)
        assert p["proxy"] <= best(max(low, budget - slack)) * (1 + 1e-12), budget


def test_an_unmeetable_budget_is_refused_naming_the_smallest(ids):
    # each table in its cheapest format without a cache: INT2, or FP16 at dim 4 with FP32
    # qparams (INT2's 8 bytes of scale and bias outweigh the codes); FP32 for a table below
    # the minimum rows
    cheapest = [
        min(
            (dataclasses.replace(t, precision=x, cache_ratio=0) for x in PRECISION_BITS),
            key=lambda c: memory_breakdown(c)["total"],
        )
        for t in TABLES
    ]
    least = sum(memory_breakdown(t)["total"] for t in cheapest)
    assert smallest_budget(TABLES) == least
    with pytest.raises(ValueError) as e:
        plan(TABLES, least - 1, ids, batch_size=BATCH)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and f"the smallest that can is {least:,} bytes" in message
    p = plan(TABLES, least, ids, batch_size=BATCH)
    assert p["total_bytes"] == least
    assert [t["precision"] for t in p["tables"]] == ["fp32", "int2", "fp16", "int2"]


def test_a_sample_that_does_not_fit_the_tables_is_refused(ids, bounds):
    budget = bounds[1]
    with pytest.raises(ValueError, match="ids_sample must name each table once"):
        plan(TABLES, budget, {**ids, "t_9": ids["t_0"]}, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"'t_2': the sample holds ids outside \[0, 40000\)"):
        plan(TABLES, budget, {**ids, "t_2": ids["t_2"] + 40_000}, batch_size=BATCH)


def test_a_table_whose_sample_fits_a_small_cache_gets_one(one_thread):
    """Two tables of the same size under one budget: the one whose sample reads 64 rows gets
    the smallest cache, which takes nearly every lookup, and a coarser precision than the one
    read uniformly, whose cache would take few."""
    tables = [TableConfig(100_000, 16, name="hot"), TableConfig(100_000, 16, name="flat")]
    gen = torch.Generator().manual_seed(1)
    ids = {
        "hot": torch.randint(0, 64, (40 * BATCH,), generator=gen) * 1009,
        "flat": torch.randint(0, 100_000, (40 * BATCH,), generator=gen),
    }
    budget = sum(fp32_bytes(t) for t in tables) // 4
    hot, flat = plan(tables, budget, ids, batch_size=BATCH)["tables"]
    assert hot["cache_ratio"] == min(CACHE_RATIOS) and hot["hit_rate"] > 0.9, hot
    assert flat["hit_rate"] < 0.1, flat
    assert PRECISION_BITS[flat["precision"]] > PRECISION_BITS[hot["precision"]]


def test_a_plan_is_plain_json_and_per_table_options_of_a_run(ids, bounds):
    p = plan(TABLES, sum(bounds) // 2, ids, batch_size=BATCH)
    assert json.loads(json.dumps(p, allow_nan=False)) == p
    cfg = RunConfig(tables=overrides(json.loads(json.dumps(p))))
    cfg.validate()
    for t, base in zip(p["tables"], TABLES):
        planned = TableConfig(**{**base.to_dict(), **cfg.tables[t["name"]]})
        assert memory_breakdown(planned)["total"] == t["bytes"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("synthetic") / "data"
    assert main(["generate", str(data), "--rows", "20000", "--scale", "0.001"]) == 0
    return data


@pytest.fixture(scope="module")
def criteo_data(tmp_path_factory):
    """The first 10,000 lines of Kaggle's train.txt, preprocessed."""
    if not CRITEO.exists():
        pytest.skip(f"{CRITEO} is not there")
    data = tmp_path_factory.mktemp("criteo") / "data"
    preprocess_criteo(CRITEO, data)
    return data


def _plan_lines(capsys, argv) -> list[str]:
    capsys.readouterr()
    assert main(["plan", *argv, "--no-progress"]) == 0
    return capsys.readouterr().out.strip().splitlines()


@pytest.mark.parametrize("source", ["synthetic", "criteo"])
def test_dlrm_plan_prints_every_table_and_the_total(request, capsys, source):
    data = request.getfixturevalue(f"{source}_data" if source == "criteo" else "tiny_data")
    lines = _plan_lines(
        capsys, ["--data", str(data), "--memory-budget", "1MiB", "--batch-size", "128"]
    )
    head, rows, total = lines[0].split(), lines[1:-1], lines[-1]
    assert head[:4] == ["table", "rows", "dim", "precision"] and len(rows) == 26
    cells = [r.split() for r in rows]
    assert [c[0] for c in cells] == [f"t_{i}" for i in range(26)]
    assert all(c[3] in PRECISION_BITS for c in cells)
    assert any(c[4] != "none" and c[-3].endswith("%") for c in cells)  # some cache, its hit rate
    assert total.startswith("total ") and "of a 1.0 MiB budget" in total and "loss proxy" in total
    planned_kib = float(total.split()[1].replace(",", ""))
    assert total.split()[2] == "KiB" and planned_kib <= 1024


@pytest.mark.parametrize(
    "size, bytes_",
    [
        ("4096", 4096),
        ("1.5KiB", 1536),
        ("0.4MB", 400_000),
        ("0.25MiB", 262_144),
        ("0.0001GiB", 107_374),
    ],
)
def test_sizes_are_read_as_bytes(tmp_path, capsys, monkeypatch, size, bytes_):
    """Each is below the smallest budget of the tiny synthetic tables: the refusal names the
    bytes read, before any data are generated."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *SMALL, "--memory-budget", size]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--memory-budget: a budget of {bytes_:,} bytes" in err
    assert "the smallest that can is" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", ["0", "-1", "lots", "700XB", "1.5.5GiB", "", "1e9"])
def test_a_bad_size_is_one_line_naming_the_option(tmp_path, capsys, monkeypatch, size):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["plan", *SMALL, "--memory-budget", size])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--memory-budget" in err, err
    assert list(tmp_path.iterdir()) == []


def test_dlrm_plan_needs_a_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *SMALL]) == 2
    assert "--memory-budget is required" in capsys.readouterr().err


def test_dlrm_train_with_a_budget_trains_the_plan_and_reports_it(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--data", str(tiny_data), "--out", str(out), *SMALL[2:], "--threads", "1"]
    argv += ["--memory-budget", "1MiB", "--plan-rows", "5000", "--steps", "3", "--eval-every", "0"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    p = report["plan"]
    assert p["budget"] == 2**20 and p["total_bytes"] <= 2**20
    assert {t["lookups"] for t in p["tables"]} == {(5000 // 256) * 256}
    assert report["config"]["memory_budget"] == 2**20
    assert report["config"]["tables"] == overrides(p)
    assert report["embeddings"]["memory_bytes"] == p["total_bytes"]
    reported = report["embeddings"]["tables"]
    assert {n: e["precision"] for n, e in reported.items()} == {
        t["name"]: t["precision"] for t in p["tables"]
    }
    # the plan is the run's configuration: resuming re-plans the same and continues
    assert main([*argv[:-4], "--steps", "4", "--eval-every", "0", "--resume"]) == 0
    assert json.loads((out / "report.json").read_text())["plan"] == p


def test_a_budget_under_a_launcher_of_ones_own_is_refused(tiny_data, tmp_path, monkeypatch):
    """A rank of a run that another launcher started (the process group already made) cannot
    plan alone: a budget there is refused, naming the option, before anything is written."""
    from dlrm import distributed
    from dlrm.errors import RunError
    from dlrm.train import train

    monkeypatch.setattr(distributed.Ranks, "current", classmethod(lambda cls: cls(0, 2)))
    cfg = RunConfig(data=str(tiny_data), memory_budget=2**20, nproc_per_node=2)
    with pytest.raises(RunError, match="--memory-budget .* --nproc-per-node"):
        train(cfg, tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


def test_a_budget_per_process_plans_every_process_and_each_holds_at_most_its_own(
    tiny_data, tmp_path, capsys
):
    """Two processes: the tables are planned to twice the budget, and TorchRec's planner
    places them so that each process's shards take at most one budget (the same bytes)."""
    tables = RunConfig(synthetic_scale=0.001).table_configs(
        json.loads((tiny_data / "meta.json").read_text())["cardinalities"]
    )
    least, full = smallest_budget(tables), sum(fp32_bytes(t) for t in tables)
    budget = (least + full) // 4  # a process's: the two between the smallest plan and FP32
    out = tmp_path / "run"
    argv = ["--data", str(tiny_data), *SMALL[2:], "--memory-budget", str(budget)]
    argv += ["--nproc-per-node", "2", "--plan-rows", "5000"]
    train = [
        "train",
        *argv,
        "--out",
        str(out),
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--threads",
        "1",
    ]
    assert main(train) == 0
    report = json.loads((out / "report.json").read_text())
    p, emb = report["plan"], report["embeddings"]
    assert p["budget"] == 2 * budget and least < p["total_bytes"] <= 2 * budget
    assert emb["memory_bytes"] == p["total_bytes"]
    assert len(emb["memory_bytes_per_rank"]) == 2 and max(emb["memory_bytes_per_rank"]) <= budget
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    total = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"budget, {budget / 1024:,.1f} KiB for each of 2 processes" in total
