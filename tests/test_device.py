"""`dlrm train --device`: a device the machine lacks refused in one line before any work, the
device recorded per part of a run (a run resumes on any device), batches on their way to the
device, and -- where a GPU is present -- a run on it whose checkpoint the CPU resumes."""

import json

import pytest
import torch

from dlrm import checkpoint
from dlrm.build import build_trainer, process_model, resolve_dataset
from dlrm.checkpoint import open_checkpoint
from dlrm.cli import main
from dlrm.config import RunConfig
from dlrm.data import batches
from dlrm.data.synthetic import SyntheticCriteo
from dlrm.distributed import ONE_PROCESS
from dlrm.run_dir import latest_checkpoint
from tests._runs import SMALL_RUN

SMALL = [*SMALL_RUN, "--threads", "1"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device")
@pytest.mark.parametrize(
    "options, message",
    [
        (["--device", "cuda"], "--device cuda: torch"),
        (["--device", "cuda:3"], "--device cuda:3: torch"),
        (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["--device", "cuda:0", "--nproc-per-node", "2"], "--device cuda:0 names one GPU"),
    ],
)
def test_a_device_the_machine_lacks_is_refused_before_any_work(tmp_path, capsys, options, message):
    for command, extra in (("train", SMALL), ("evaluate", [])):
        out = tmp_path / command
        assert main([command, "--out", str(out), *extra, *options]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not out.exists() and not (tmp_path / "data").exists()


def test_the_report_says_where_each_part_of_a_run_trained(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--steps", "4", "--stop-after", "2", *SMALL]) == 0
    assert (
        main(["train", "--out", str(run), "--steps", "4", "--resume", "--device", "cpu", *SMALL])
        == 0
    )
    report = json.loads((run / "report.json").read_text())
    here = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert report["devices"][0]["step"] == 0 and report["devices"][0]["device"].startswith(here)
    assert report["devices"][1] == {"step": 2, "device": "cpu"}
    assert report["device"] == "cpu" and report["peak_device_memory_bytes"] is None
    assert report["config"]["device"] == "cpu"  # bookkeeping: the resumption's own


def test_batches_reach_the_device_unchanged():
    gen = SyntheticCriteo(scale=0.001, seed=0)
    source = list(gen.batches(3000, "train", 256))
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        moved = list(batches.on_device(iter(source), device))
        assert len(moved) == len(source)
        for a, b in zip(source, moved):
            assert all(t.device.type == device.type for t in b)
            assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_run_resumes_on_the_cpu_with_the_same_tables(tmp_path, device):
    """Trained on ``device`` (a GPU where there is one), checkpointed, then loaded, evaluated
    and resumed on the CPU: the CPU model holds the checkpoint's table bytes exactly (the
    tables are the same bytes on every device)."""
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--device", device, "--steps", "6", *SMALL]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["device"].startswith(device)
    assert (report["peak_device_memory_bytes"] is None) == (device == "cpu")

    path = latest_checkpoint(run)
    state = open_checkpoint(path, ONE_PROCESS)
    cfg = RunConfig(**state["config"])
    cards = list(resolve_dataset(cfg, run)[1].meta["cardinalities"])
    cpu = torch.device("cpu")
    model = process_model(cfg, cards, ONE_PROCESS, True, cpu)
    checkpoint.load_into(build_trainer(cfg, model), path, state, ONE_PROCESS, cpu)
    mine, saved = model.state_dict(), state["trainer"]["model"]
    tables = [k for k in saved if k.endswith(".weights")]
    assert len(tables) == 26
    assert all(mine[k].device == cpu and torch.equal(mine[k], saved[k]) for k in tables)

    assert main(["evaluate", "--out", str(run), "--device", "cpu", "--no-progress"]) == 0
    resume = ["train", "--out", str(run), "--device", "cpu", "--steps", "8", "--resume"]
    assert main([*resume, *SMALL]) == 0
    report = json.loads((run / "report.json").read_text())
    assert [d["device"][:4] for d in report["devices"]] == [device[:4], "cpu"]
    assert report["steps"] == 8
