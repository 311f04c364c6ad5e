"""Host placement (docs/design.md, "Host placement") as far as a machine without CUDA sees it:
the option and its checks, old checkpoints and checkpoints across placements, the refusal of a
host-placed table where torch has no CUDA (in the library and in one line of ``dlrm``), the ops'
rule for where a table's state may lie (reached with meta tensors), the memory split by tier,
and the planner placing tables under a device and a host budget. What needs a GPU is in
test_cuda_placement.py."""

import dataclasses
import itertools
import json

import pytest
import torch
from torch import nn

from dlrm.cli import main
from dlrm.config import RunConfig
from embcache import (
    CachedLowPrecisionEmbedding,
    CachedLowPrecisionEmbeddingBags,
    TableConfig,
    memory_breakdown,
    plan,
    swap,
)
from embcache.config import ADDED_FIELDS, STATE_TENSORS
from embcache.multi_table import BagTable
from embcache.planner import (
    candidates,
    check_budget,
    least_host_bytes,
    replay,
    rounding_noise,
    smallest_budget,
)

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
OPS = torch.ops.embcache
BATCH = 256
# what dlrm plan and dlrm train share (as test_planner's); a training run adds "--threads", "1"
SMALL = ["--synthetic-scale", "0.001", "--batch-size", "256", "--no-progress"]


# ----------------------------------------------------------------------------- the option


def test_placement_is_a_checked_field_that_old_checkpoints_lack():
    assert TableConfig(10, 4).placement == "device"  # today's behaviour by default
    assert TableConfig(10, 4, placement="host").placement == "host"  # planning needs no GPU
    with pytest.raises(ValueError) as e:
        TableConfig(10, 4, placement="gpu", name="C1")
    assert str(e.value) == "table 'C1': placement='gpu' is not one of device, host"
    assert ADDED_FIELDS["placement"] == "device"
    # where a table lives is not what it computes
    assert TableConfig(10, 4, placement="host").identity() == TableConfig(10, 4).identity()
    assert "placement" not in TableConfig(10, 4).identity()


def _trained(**options) -> CachedLowPrecisionEmbedding:
    m = CachedLowPrecisionEmbedding(3000, 8, mode="sum", cache_ratio=0.1, seed=5, **options)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = (torch.rand(300, generator=gen) ** 2 * 3000).long()
        m(idx, torch.arange(0, 300, 3)).sum().backward()
        m.step()
    return m


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, b[k]), k
        else:
            assert x == b[k], k


def test_a_checkpoint_without_a_placement_loads_as_a_device_table():
    """A table's state saved before placements existed has none in its configuration: it
    loads into a table of today, and ``from_state`` rebuilds it on the device."""
    m = _trained(policy="lfu", optimizer="rowwise_adagrad")
    old = m.state_dict()
    del old["_extra_state"]["config"]["placement"]
    fresh = CachedLowPrecisionEmbedding(
        3000, 8, mode="sum", cache_ratio=0.1, seed=5, optimizer="rowwise_adagrad"
    )
    fresh.load_state_dict(old)
    _same(fresh.state_dict(), m.state_dict())
    rebuilt = CachedLowPrecisionEmbedding.from_state(old)
    assert rebuilt.config.placement == "device"
    _same(rebuilt.state_dict(), m.state_dict())


def test_a_checkpoint_loads_across_placements():
    """The state of a host-placed table (its configuration says so) loads into a table on the
    device, bytes and statistics unchanged; its placement is the loading table's. (The other
    way round needs CUDA: test_cuda_placement.py.)"""
    m = _trained(policy="lru")
    saved = m.state_dict()
    saved["_extra_state"]["config"]["placement"] = "host"
    into = CachedLowPrecisionEmbedding(3000, 8, mode="sum", cache_ratio=0.1, seed=5, policy="lru")
    into.load_state_dict(saved)
    assert into.config.placement == "device"
    _same(into.state_dict(), m.state_dict())
    assert CachedLowPrecisionEmbedding.from_state(saved).config.placement == "device"
    # another configuration in anything else is still refused
    other = CachedLowPrecisionEmbedding(3000, 8, mode="sum", cache_ratio=0.1, seed=6, policy="lru")
    with pytest.raises(ValueError, match="another configuration"):
        other.load_state_dict(saved)


# ----------------------------------------------------------------------------- without CUDA


@NO_CUDA
def test_a_host_placed_table_is_refused_without_cuda_naming_it():
    def refused(build, name):
        with pytest.raises(ValueError) as e:
            build()
        message = str(e.value)
        assert len(message.splitlines()) == 1, message
        assert message.startswith(f"table '{name}': placement='host'") and "CUDA" in message

    refused(lambda: CachedLowPrecisionEmbedding(3000, 8, placement="host", name="C7"), "C7")
    refused(  # also built without memory (the meta device): it could never be used here
        lambda: CachedLowPrecisionEmbedding(3000, 8, placement="host", device="meta"), "table"
    )
    bags = [BagTable("a", 3000, 8, ("fa",)), BagTable("b", 2000, 8, ("fb",))]
    refused(
        lambda: CachedLowPrecisionEmbeddingBags(bags, per_table={"b": {"placement": "host"}}), "b"
    )
    # swap refuses before it replaces anything
    model = nn.Sequential(nn.EmbeddingBag(3000, 8), nn.Linear(8, 1))
    refused(lambda: swap(model, placement="host"), "0")
    assert type(model[0]) is nn.EmbeddingBag


# ----------------------------------------------------------------------------- the ops' rule


def _state(m: CachedLowPrecisionEmbedding, meta=()) -> list[torch.Tensor]:
    return [
        t.to("meta") if name in meta else t for name, t in zip(STATE_TENSORS, m.state_tensors())
    ]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_the_ops_rule_of_where_a_tables_state_lies(optimizer):
    """``state_placement`` applies the rule every op checks its tables' state with: the cache
    (with the LFU counts and an optimizer state of one value a row) on one device, the op's;
    the storage (the stored rows, and AdaGrad's per-element state) with it or (only beside a
    device that is not the CPU) all of it in pinned host memory. The CPU build has no second
    memory space to offer, so the refusals are reached with meta tensors standing for a
    device's. The op's tiers are the configuration's (``storage_tensors``)."""
    m = CachedLowPrecisionEmbedding(3000, 8, cache_ratio=0.1, policy="lfu", optimizer=optimizer)
    storage = m.config.storage_tensors
    per_element = optimizer == "adagrad"
    assert storage == (("weights", "optimizer_state") if per_element else ("weights",))
    assert OPS.state_placement(_state(m)) == ["device"]  # all on the CPU
    assert OPS.state_placement(_state(m, STATE_TENSORS)) == ["device"]  # all on one device
    cache = [n for n in STATE_TENSORS if n not in storage]

    def refused(state, table, tensor, why):
        with pytest.raises(RuntimeError) as e:
            OPS.state_placement(state)
        first = str(e.value).splitlines()[0]
        assert first.startswith(f"embcache: table {table}: {tensor} is on ") and why in first, first

    # the storage in ordinary host memory beside a device: neither with the cache nor pinned
    refused(_state(m, cache), 0, "weights", "or all of it in pinned host memory")
    # the cache split: the counts and a per-row optimizer state are the cache's
    refused(
        _state(m, ["cache_rows"]), 0, "cache_rows", "must all be on the device of its cache_tags"
    )
    refused(_state(m, ["counts"]), 0, "counts", "must all be on the device of its cache_tags")
    if per_element:  # the storage split: a part of it elsewhere
        refused(_state(m, ["optimizer_state"]), 0, "optimizer_state", "storage must be on")
    else:
        refused(_state(m, ["optimizer_state"]), 0, "optimizer_state", "must all be on the device")
    # on the CPU there is no other place: the storage must be with the cache
    refused(_state(m, storage), 0, "weights", "its cache, cpu")
    # the table is named by its place in the op's list
    refused(_state(m) + _state(m, ["cache_priority"]), 1, "cache_priority", "all be on")
    # and the ops check their tables with it before anything is read or written
    before = [t.clone() for t in m.state_tensors()]
    counters = torch.zeros_like(m.counters)
    with pytest.raises(RuntimeError):
        OPS.cache_flush(_state(m, ["counts"]), m.spec[None], [counters])
    assert all(torch.equal(a, b) for a, b in zip(before, m.state_tensors()))


# ----------------------------------------------------------------------------- memory by tier


@pytest.mark.parametrize("precision", ["fp32", "int8", "int2"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_memory_splits_into_device_and_host_bytes_by_tier(precision, policy, optimizer):
    """A host-placed table's host bytes are its storage tensors' (weights, and AdaGrad's
    state), its device bytes its cache tensors' (with the LFU counts); a table on the device has
    no host bytes. The tensors' bytes are the same whatever the placement, so a device table
    measures both."""
    options = dict(precision=precision, policy=policy, optimizer=optimizer, cache_ratio=0.1)
    m = CachedLowPrecisionEmbedding(3000, 12, **options)
    nbytes = {name: t.nbytes for name, t in zip(STATE_TENSORS, m.state_tensors())}
    storage = sum(nbytes[n] for n in m.config.storage_tensors)
    on_device = m.memory_bytes()
    assert on_device["device"] == on_device["total"] == sum(nbytes.values())
    assert on_device["host"] == 0
    host = memory_breakdown(dataclasses.replace(m.config, placement="host"))
    assert host["host"] == storage and host["device"] == on_device["total"] - storage
    assert host["total"] == on_device["total"]
    assert {k: v for k, v in host.items() if k not in ("device", "host")} == {
        k: v for k, v in on_device.items() if k not in ("device", "host")
    }


# ----------------------------------------------------------------------------- the planner

TABLES = [
    TableConfig(300, 8, name="t_0"),  # below min_rows_for_low_precision: FP32
    TableConfig(40_000, 16, name="t_1", optimizer="rowwise_adagrad"),
    TableConfig(6_000, 8, name="t_2", policy="lru"),
]
GRID = {"cache_ratios": (0.1,), "associativities": (32,)}


@pytest.fixture(scope="module")
def ids():
    gen = torch.Generator().manual_seed(0)
    return {
        t.name: (torch.rand(30 * BATCH, generator=gen) ** p * t.num_embeddings).long()
        for t, p in zip(TABLES, (1, 4, 2))
    }


def _device_and_host(p) -> tuple[int, int]:
    return p["device_bytes"], p["host_bytes"]


def test_a_table_that_the_device_cannot_hold_goes_to_host_memory(ids, one_thread):
    """With a device budget below what the tables need on the device, even in their cheapest
    formats, a host budget takes the rest: a table goes to host memory (its cache stays on
    the device), each budget holds, and every table's bytes are those it allocates."""
    device_only = sum(min(memory_breakdown(c)["total"] for c in candidates(t)) for t in TABLES)
    budget = device_only // 2
    with pytest.raises(ValueError, match="cannot be met"):
        plan(TABLES, budget, ids, batch_size=BATCH)
    p = plan(TABLES, budget, ids, batch_size=BATCH, host_budget=10 * device_only)
    assert p["budget"] == budget and p["host_budget"] == 10 * device_only
    assert p["device_bytes"] <= budget and 0 < p["host_bytes"] <= 10 * device_only
    assert p["total_bytes"] == p["device_bytes"] + p["host_bytes"]
    assert any(t["placement"] == "host" for t in p["tables"])
    for t, base in zip(p["tables"], TABLES):
        planned = dataclasses.replace(
            base, **{k: t[k] for k in ("precision", "cache_ratio", "associativity", "policy")}
        )
        planned = dataclasses.replace(planned, placement=t["placement"])
        m = memory_breakdown(planned)
        assert (m["total"], m["device"], m["host"]) == (
            t["bytes"],
            t["device_bytes"],
            t["host_bytes"],
        )
        assert (t["host_bytes"] > 0) == (t["placement"] == "host")
    assert json.loads(json.dumps(p, allow_nan=False)) == p


def test_host_memory_is_used_only_where_it_lowers_the_proxy(ids, one_thread):
    """Given room on the device, a host budget changes nothing: the plan is the device-only
    plan (ties go to the device, whose rows do not cross PCIe); below that, it is never worse
    than the device-only plan of the same device budget, which uses no host memory."""
    fp32 = sum(memory_breakdown(dataclasses.replace(t, precision="fp32"))["total"] for t in TABLES)
    roomy = plan(TABLES, 2 * fp32, ids, batch_size=BATCH)
    with_host = plan(TABLES, 2 * fp32, ids, batch_size=BATCH, host_budget=fp32)
    assert with_host["host_bytes"] == 0 and with_host["proxy"] == roomy["proxy"] == 0
    assert [t["placement"] for t in with_host["tables"]] == ["device"] * len(TABLES)
    least = smallest_budget(TABLES)
    for budget in (least, (2 * least + fp32) // 3, (least + fp32) // 2):
        device = plan(TABLES, budget, ids, batch_size=BATCH)
        placed = plan(TABLES, budget, ids, batch_size=BATCH, host_budget=fp32)
        assert placed["proxy"] <= device["proxy"] * (1 + 1e-9), budget
        assert placed["device_bytes"] <= budget
    # more host memory never makes the plan worse
    proxies = [
        plan(TABLES, least // 2, ids, batch_size=BATCH, host_budget=h)["proxy"]
        for h in (least, 2 * least, fp32 // 2, fp32)
    ]
    assert all(a >= b for a, b in zip(proxies, proxies[1:])), proxies
    assert proxies[0] > proxies[-1], proxies


def test_a_placed_plan_is_the_best_using_no_more_host_memory(ids, one_thread):
    """Against every combination of candidates in both placements (a small grid; the proxy as
    plan's docstring defines it): the plan fits both budgets and is never better than the best
    that fits them (honest); and no combination that fits a slightly smaller device budget
    with no more host bytes than the plan's is better (the multiplier's optimality: what it
    gives up, if anything, is only host memory it did not need)."""
    per_table = []
    for t in TABLES:
        found = []
        for c in candidates(t, **GRID, placements=("device", "host")):
            hits = replay(ids[t.name], t.num_embeddings, BATCH, c.cache_ratio, c.policy, c.ways)
            misses = len(ids[t.name]) - (hits[0]["hits"] if c.num_slots else 0)
            m = memory_breakdown(c)
            found.append(
                (
                    m["device"],
                    m["host"],
                    misses * t.embedding_dim * rounding_noise(c.stored_precision),
                )
            )
        per_table.append(found)
    scale = sum(len(ids[t.name]) * t.embedding_dim for t in TABLES)
    combos = [tuple(map(sum, zip(*c))) for c in itertools.product(*per_table)]
    spread = sum(max(d for d, _, _ in f) - min(d for d, _, _ in f) for f in per_table)
    slack = len(TABLES) * (spread // 65536 + 1)

    def best(device, host):
        return min((e for d, h, e in combos if d <= device and h <= host), default=None)

    most = sum(max(d + h for d, h, _ in f) for f in per_table)
    for device, host in [(most // 8, most // 4), (most // 5, most // 10)]:
        p = plan(TABLES, device, ids, batch_size=BATCH, host_budget=host, **GRID)
        assert p["device_bytes"] <= device and p["host_bytes"] <= host
        assert best(device, host) / scale <= p["proxy"] * (1 + 1e-12)
        rival = best(device - slack, p["host_bytes"])
        assert rival is None or p["proxy"] <= rival / scale * (1 + 1e-12), (device, host)
        # and the host budget is spent where it helps: better than the plan that uses the
        # least host memory (here the host budget binds: the plan without it would use more)
        need = least_host_bytes(TABLES, device, **GRID)
        least = plan(TABLES, device, ids, batch_size=BATCH, host_budget=need, **GRID)
        assert p["proxy"] < least["proxy"] and p["host_bytes"] > least["host_bytes"]


def test_budgets_that_cannot_be_met_together_are_refused_naming_the_host_memory_needed():
    # what no placement takes off the device: row-wise AdaGrad's accumulators (t_1's)
    least_device = sum(
        min(memory_breakdown(c)["device"] for c in candidates(t, placements=("device", "host")))
        for t in TABLES
    )
    assert least_device == 40_000 * 4
    assert least_host_bytes(TABLES, least_device - 1) is None
    need = least_host_bytes(TABLES, least_device)
    assert need > 0
    check_budget(TABLES, least_device, need)  # every table in host memory, but that state
    with pytest.raises(ValueError) as e:
        check_budget(TABLES, least_device, need - 1)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert f"the tables need at least {need:,} bytes" in message and "of host memory" in message


# ----------------------------------------------------------------------------- dlrm


def test_placement_is_bookkeeping_in_a_run_not_identity():
    """A run resumes, and is evaluated, in another placement: neither ``--placement`` nor a
    table's ``placement=`` is part of what a checkpoint must match."""
    base = RunConfig(tables={"t_2": {"precision": "int4"}})
    moved = RunConfig(placement="host", tables={"t_2": {"precision": "int4", "placement": "host"}})
    also = RunConfig(tables={"t_2": {"precision": "int4"}, "t_3": {"placement": "host"}})
    assert base.identity() == moved.identity() == also.identity()
    assert RunConfig(tables={"t_2": {"precision": "int8"}}).identity() != base.identity()
    assert "placement" not in RunConfig.ADDED_FIELDS  # the command line's, not the checkpoint's
    assert RunConfig.ADDED_FIELDS["host_memory_budget"] is None


@pytest.mark.parametrize(
    "options, message",
    [
        (["--placement", "host", "--device", "cpu"], "--placement host puts every table's rows"),
        (["--table", "t_4:placement=host", "--device", "cpu"], "--table t_4: placement=host"),
        (["--placement", "gpu"], "--placement"),
        (["--table", "t_4:placement=gpu"], "--table t_4: placement='gpu' is not one of"),
        (["--host-memory-budget", "1GiB"], "--host-memory-budget plans the tables with"),
        (["--host-memory-budget", "lots"], "--host-memory-budget"),
        (["--placement", "host", "--nproc-per-node", "2"], "--placement host: host placement"),
        (["--placement", "host", "--embeddings", "torchrec"], "--placement host places our"),
        (["--memory-budget", "1GiB", "--table", "t_4:placement=host"], "--table t_4: placement"),
    ],
)
def test_a_host_placement_that_cannot_run_is_one_line_before_any_work(
    tmp_path, capsys, options, message
):
    out = tmp_path / "run"
    try:
        code = main(["train", "--out", str(out), *SMALL, "--synthetic-rows", "30000", *options])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "error" in err, err
    assert list(tmp_path.iterdir()) == []  # no data generated, no run directory made


@NO_CUDA
@pytest.mark.parametrize(
    "options, message",
    [
        (["--placement", "host"], "--placement host puts every table's rows in pinned host"),
        (["--table", "t_9:placement=host"], "--table t_9: placement=host puts the table's rows"),
    ],
)
def test_host_placement_without_cuda_is_refused_naming_the_table(
    tmp_path, capsys, options, message
):
    commands = [("train", [*SMALL, *options])]
    if options[0] == "--placement":  # evaluate takes the placement, not the tables
        commands.append(("evaluate", options))
    for command, argv in commands:
        out = tmp_path / command
        assert main([command, "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "sees no CUDA GPU" in err and err.count("\n") == 1, err
        assert list(tmp_path.iterdir()) == []


def test_dlrm_plan_places_tables_in_host_memory_on_a_machine_without_a_gpu(
    tmp_path, capsys, monkeypatch
):
    """Planning is arithmetic: ``dlrm plan`` with a host budget runs anywhere, and prints each
    table's placement and host bytes beside the totals of both budgets."""
    monkeypatch.chdir(tmp_path)
    argv = ["plan", *SMALL, "--synthetic-rows", "20000", "--plan-rows", "5000"]
    argv += ["--memory-budget", "200KiB", "--host-memory-budget", "2MiB"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head, rows, total = lines[0].split(), lines[1:-1], lines[-1]
    assert head[-3:] == ["placement", "host", "bytes"] and len(rows) == 26
    hosted = [r.split()[0] for r in rows if " host " in r]
    assert 0 < len(hosted) < 26, rows  # some tables in host memory, not all
    assert total.startswith("total ") and "KiB budget on the device, " in total, total
    assert "of a 2.0 MiB budget in host memory" in total, total
