"""Host placement on a GPU (docs/design.md, "Host placement"): a host-placed table keeps its
storage in pinned host memory and its cache in GPU memory, trains bit for bit as the same table
on the device, and its checkpoints load across placements; ``dlrm train --placement host``
and a plan with a host budget train on the GPU. Runs only where torch has CUDA, a GPU and the
CUDA build of the kernels (what a machine without them checks is in test_placement.py)."""

import copy
import io
import json

import pytest
import torch
from torch import nn

from dlrm.cli import main
from dlrm.run_dir import latest_checkpoint
from embcache import (
    CachedLowPrecisionEmbedding,
    CachedLowPrecisionEmbeddingBags,
    TableOptimizer,
    swap,
)
from embcache.config import STATE_TENSORS
from embcache.multi_table import BagTable
from embcache.serialization import load
from tests._runs import SMALL_RUN

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or not torch._C._dispatch_has_kernel_for_dispatch_key("embcache::multi_lookup_forward", "CUDA"),
    reason="needs a CUDA GPU and a CUDA build of the kernels",
)
OPS = torch.ops.embcache
ROWS, DIM = 5000, 12
SMALL = SMALL_RUN


def _table(placement: str, device="cuda", **options) -> CachedLowPrecisionEmbedding:
    defaults = dict(mode="sum", cache_ratio=0.1, rounding="stochastic", lr=0.05, seed=3)
    return CachedLowPrecisionEmbedding(
        ROWS, DIM, placement=placement, device=device, **{**defaults, **options}
    )


def _assert_host_placed(m: CachedLowPrecisionEmbedding) -> None:
    for name, t in zip(STATE_TENSORS, m.state_tensors()):
        if name in m.config.storage_tensors:
            assert t.device.type == "cpu" and (t.numel() == 0 or t.is_pinned()), name
        else:
            assert t.device.type == "cuda", name
    assert m.device.type == "cuda"
    assert OPS.state_placement(list(m.state_tensors())) == ["host"]


def _batches(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = (torch.rand(600, generator=gen) ** 3 * ROWS).long()
        yield idx, torch.arange(0, 600, 3), torch.randn(200, DIM, generator=gen) * 0.1


def _step_both(a, b, steps: int, seed: int = 0) -> None:
    """Trains ``a`` and ``b`` on the same batches, their outputs equal bit for bit each step,
    with an evaluation forward and a flush on the way."""
    for s, (idx, off, grad) in enumerate(_batches(steps, seed)):
        outs = [m(idx.cuda(), off.cuda()) for m in (a, b)]
        assert torch.equal(outs[0], outs[1]), f"step {s}: forward"
        for m, out in zip((a, b), outs):
            out.backward(grad.cuda())
            m.step()
        if s == steps // 2:
            for m in (a, b):
                m.eval()
            assert torch.equal(a(idx.cuda(), off.cuda()), b(idx.cuda(), off.cuda()))
            for m in (a, b):
                m.train()
            assert a.flush() == b.flush()


def _assert_same_tables(a, b) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.cpu(), y.cpu()), name
    assert a.stats() == b.stats()
    assert torch.equal(a.current_weight(), b.current_weight())


def test_storage_lies_in_pinned_host_memory_and_the_cache_on_the_gpu():
    built_there = _table("host")
    _assert_host_placed(built_there)
    m = _table("host", device="cpu")

    def storage_addresses() -> list[int]:
        tensors = [getattr(m, name) for name in m.config.storage_tensors]
        return [t.data_ptr() for t in tensors if t.numel()]

    storage = storage_addresses()
    assert all(t.device.type == "cpu" for t in m.state_tensors())
    assert m.weights.is_pinned()  # pinned from the start: moving copies none of it
    m.cuda()
    _assert_host_placed(m)
    assert storage_addresses() == storage
    m.cpu()  # on the CPU it is all CPU
    assert all(t.device.type == "cpu" for t in m.state_tensors())
    assert OPS.state_placement(list(m.state_tensors())) == ["device"]
    m.to("cuda")
    _assert_host_placed(m)
    device = _table("device")
    assert all(t.device.type == "cuda" for t in device.state_tensors())
    assert OPS.state_placement(list(device.state_tensors())) == ["device"]


def test_only_the_cache_takes_gpu_memory():
    rows, dim = 400_000, 64
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    m = CachedLowPrecisionEmbedding(rows, dim, placement="host", device="cuda", cache_ratio=0.05)
    torch.cuda.synchronize()
    taken = torch.cuda.memory_allocated() - before
    memory = m.memory_bytes()
    assert memory["host"] > 4 * memory["device"] > 0
    assert memory["device"] <= taken <= memory["device"] + (2 << 20), (taken, memory)


@pytest.mark.parametrize(
    "precision,policy,ways,optimizer",
    [
        ("int8", "lfu", 32, "rowwise_adagrad"),
        ("fp16", "lru", 4, "sgd"),
        ("int4", "lfu", 1, "adagrad"),
        ("int2", "lru", 32, "rowwise_adagrad"),
        ("fp32", "lfu", 8, "sgd"),
    ],
)
def test_a_host_placed_table_trains_bit_identically_to_one_on_the_device(
    precision, policy, ways, optimizer
):
    options = dict(precision=precision, policy=policy, associativity=ways, optimizer=optimizer)
    device, host = _table("device", **options), _table("host", **options)
    _step_both(device, host, 8)
    _assert_host_placed(host)
    _assert_same_tables(device, host)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_prefetching_on_a_side_stream_changes_no_value(optimizer):
    """A host table given each next batch after its forward (the stage made on the side
    stream, read by the next forward and its update) trains as the device table without,
    bit for bit, and stages rows."""
    device, host = _table("device", optimizer=optimizer), _table("host", optimizer=optimizer)
    batches = list(_batches(8, seed=1))
    staged = 0
    for s, (idx, off, grad) in enumerate(batches):
        outs = [m(idx.cuda(), off.cuda()) for m in (device, host)]
        if s + 1 < len(batches):
            host.prefetch(batches[s + 1][0].cuda(), batches[s + 1][1].cuda())
            staged += int((host.group._stage.slots[:, 0] != (1 << 63) - 1).sum())
        for m, out in zip((device, host), outs):
            out.backward(grad.cuda())
            m.step()
        assert torch.equal(outs[0], outs[1]), f"step {s}"
    assert staged > 0
    _assert_same_tables(device, host)


def test_a_host_placed_table_without_a_cache_reads_its_rows_in_place():
    """The uncached host table (the unified-memory baseline of the benchmark): every lookup
    reads host memory, and it trains as on the device."""
    device, host = _table("device", cache_ratio=0), _table("host", cache_ratio=0)
    assert host.cache_tags.numel() == 0
    _step_both(device, host, 5)
    _assert_same_tables(device, host)


def test_tables_of_both_placements_in_one_collection_train_as_all_on_the_device():
    bags = [
        BagTable("a", 4000, 8, ("fa",)),
        BagTable("b", 6000, 8, ("fb",)),
        BagTable("c", 300, 8, ("fc",)),  # small: FP32 without a cache
    ]
    options = dict(precision="int8", cache_ratio=0.05, lr=0.05, seed=7, device="cuda")
    mixed_placements = {"b": {"placement": "host"}, "c": {"placement": "host"}}
    mixed = CachedLowPrecisionEmbeddingBags(bags, per_table=mixed_placements, **options)
    plain = CachedLowPrecisionEmbeddingBags(bags, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.stack(
            [(torch.rand(512, generator=gen) ** 2 * b.num_embeddings).long() for b in bags], 1
        ).cuda()
        grad = torch.randn(512, 24, generator=gen).cuda()
        outs = [m(ids) for m in (mixed, plain)]
        assert torch.equal(outs[0], outs[1])
        for m, out in zip((mixed, plain), outs):
            out.backward(grad)
            m.step()
    for name in ("b", "c"):
        _assert_host_placed(mixed.embedding_bags[name])
    for name in ("a", "b", "c"):
        _assert_same_tables(mixed.embedding_bags[name], plain.embedding_bags[name])


def test_checkpoints_load_across_placements():
    """Saved from either placement (as a file, read back as CPU tensors), loaded into the
    other: the tables continue identically, and a host-placed table's storage stays pinned."""
    host, device = _table("host"), _table("device")
    _step_both(host, device, 4)

    def saved(m):
        buffer = io.BytesIO()
        torch.save(m.state_dict(), buffer)
        buffer.seek(0)
        return load(buffer)

    host_to_device, device_to_host = _table("device"), _table("host")  # their initial rows
    host_to_device.load_state_dict(saved(host))
    device_to_host.load_state_dict(saved(device))
    _assert_host_placed(device_to_host)
    rebuilt = CachedLowPrecisionEmbedding.from_state(saved(device), placement="host").cuda()
    _assert_host_placed(rebuilt)
    for m in (host_to_device, device_to_host, rebuilt):
        _assert_same_tables(m, host)
    _step_both(host, host_to_device, 4, seed=1)
    _step_both(device_to_host, rebuilt, 4, seed=1)
    _assert_same_tables(host_to_device, device_to_host)


def test_a_copy_of_a_host_placed_table_is_pinned_again():
    m = _table("host")
    _step_both(m, _table("device"), 2)
    twin = copy.deepcopy(m)
    _assert_host_placed(twin)
    _step_both(m, twin, 3, seed=2)
    _assert_same_tables(m, twin)


def test_swap_places_a_models_tables_in_host_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(ROWS, DIM, mode="sum"), nn.Linear(DIM, 1))
    twin = copy.deepcopy(model)
    summary = swap(model, placement="host", lr=0.05)
    swap(twin, lr=0.05)
    assert summary["0"]["placement"] == "host" and summary["0"]["host_bytes_after"] > 0
    model.cuda()
    twin.cuda()
    _assert_host_placed(model[0])
    tables = [TableOptimizer(m) for m in (model, twin)]
    for idx, off, _ in _batches(4):
        for m, t in zip((model, twin), tables):
            m[1](m[0](idx.cuda(), off.cuda())).sum().backward()
            t.step()
    _assert_same_tables(model[0], twin[0])


def test_dlrm_trains_host_placed_tables_and_resumes_them_on_the_device(tmp_path, capsys):
    """A run with every table in host memory reports where its bytes are; resumed with the
    tables on the device it continues as the run that never left the device."""
    host, device = tmp_path / "host", tmp_path / "device"
    common = ["--device", "cuda", "--steps", "6", *SMALL]
    first = ["train", "--out", str(host), *common, "--placement", "host", "--stop-after", "3"]
    assert main(first) == 0
    assert main(["train", "--out", str(host), *common, "--resume"]) == 0
    assert main(["train", "--out", str(device), *common]) == 0
    placed = json.loads((host / "report.json").read_text())
    plain = json.loads((device / "report.json").read_text())
    # the report is of the resumed part: on the device
    assert placed["embeddings"]["host_memory_bytes"] == 0
    assert placed["embeddings"]["memory_bytes"] == plain["embeddings"]["memory_bytes"]
    a = load(latest_checkpoint(host) / "state.pt")["trainer"]["model"]
    b = load(latest_checkpoint(device) / "state.pt")["trainer"]["model"]
    tables = [k for k in b if k.endswith((".weights", ".cache_rows", ".optimizer_state"))]
    assert tables and all(torch.equal(a[k], b[k]) for k in tables)
    # a whole run in host memory: the report says where each table's bytes are
    whole = tmp_path / "whole"
    assert main(["train", "--out", str(whole), *common, "--placement", "host"]) == 0
    report = json.loads((whole / "report.json").read_text())
    emb = report["embeddings"]
    assert emb["host_memory_bytes"] > 0
    assert emb["device_memory_bytes"] + emb["host_memory_bytes"] == emb["memory_bytes"]
    assert {t["placement"] for t in emb["tables"].values()} == {"host"}
    assert "of it in host memory" in capsys.readouterr().out


def test_a_plan_with_a_host_budget_trains_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--device", "cuda", "--steps", "3", *SMALL]
    argv += ["--memory-budget", "200KiB", "--host-memory-budget", "4MiB", "--plan-rows", "5000"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    p, emb = report["plan"], report["embeddings"]
    assert p["device_bytes"] <= 200 * 1024 and 0 < p["host_bytes"] <= 4 * 2**20
    assert emb["host_memory_bytes"] == p["host_bytes"]
    assert emb["device_memory_bytes"] == p["device_bytes"]
    planned = {t["name"]: t["placement"] for t in p["tables"]}
    assert {n: t["placement"] for n, t in emb["tables"].items()} == planned
