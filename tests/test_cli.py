"""The `dlrm` command: every option's help shows its default, and each command offers only
the options it uses; under bad options and failing runs, one line naming the option and exit
status 2 before any work; a diverging run stops naming the step, writes a strict-JSON report
marked diverged and keeps its last good checkpoint; undefined metrics are reported as such."""

import argparse
import json
import random
import re

import pytest

from dlrm.cli import main, make_parser
from dlrm.run_dir import latest_checkpoint

SMALL = [
    "--synthetic-scale",
    "0.001",
    "--synthetic-rows",
    "30000",
    "--batch-size",
    "256",
    "--no-progress",
    "--threads",
    "1",
]


def _strict_json(path):
    """The file parsed as strict JSON: NaN and Infinity tokens are refused."""

    def refuse(token):
        raise AssertionError(f"{path} holds the non-JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Each dlrm command's parser, by name."""
    (commands,) = [a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


@pytest.mark.parametrize("command", list(_commands()))
def test_every_option_says_what_it_means_and_its_default(command):
    """Every argument but --help has help; an option that takes a value shows its default
    (argparse's %(default)s, or in words when it is None)."""
    parser = _commands()[command]
    parser.format_help()  # every help string formats
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = f"dlrm {command} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), name
        if action.option_strings and action.nargs != 0:
            shown = "%(default)s" if action.default is not None else "default: "
            assert shown in action.help, name


# options that only a training run reads, which dlrm plan does not offer
TRAINING_ONLY = {
    "--embeddings",
    "--precision",
    "--cache-ratio",
    "--associativity",
    "--policy",
    "--dense-precision",
    "--loss-scaler",
    "--static-scale",
    "--optimizer",
    "--lr",
    "--epochs",
    "--steps",
    "--eval-every",
    "--eval-batches",
    "--max-skipped-in-a-row",
    "--compare-fp32",
    "--checkpoint-every",
    "--stop-after",
    "--log-every",
    "--tensorboard",
    "--threads",
    "--out",
    "--resume",
}


def _help_options(capsys, command: str) -> set[str]:
    """The options ``dlrm COMMAND --help`` names."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return set(re.findall(r"--[a-z0-9-]+", capsys.readouterr().out))


def test_plan_and_evaluate_offer_only_what_they_use(capsys):
    assert TRAINING_ONLY <= _help_options(capsys, "train")
    plan = _help_options(capsys, "plan")
    assert not plan & TRAINING_ONLY, sorted(plan & TRAINING_ONLY)
    planning = {"--data", "--synthetic-rows", "--synthetic-scale", "--table", "--emb-optimizer"}
    planning |= {"--memory-budget", "--plan-rows", "--batch-size", "--seed", "--nproc-per-node"}
    assert planning <= plan
    assert "--device" not in plan  # planning runs on the CPU
    # the run's configuration comes from its checkpoint; where it runs does not
    evaluate = _help_options(capsys, "evaluate")
    assert evaluate == {
        "--help",
        "--out",
        "--split",
        "--device",
        "--placement",
        "--nproc-per-node",
        "--no-progress",
    }


@pytest.mark.parametrize(
    "argv, option",
    [
        (["train", "--batch-size", "0"], "--batch-size"),
        (["train", "--batch-size", "-4"], "--batch-size"),
        (["train", "--batch-size", "many"], "--batch-size"),
        (["train", "--checkpoint-every", "0"], "--checkpoint-every"),
        (["train", "--threads", "-1"], "--threads"),
        (["train", "--steps", "0"], "--steps"),
        (["train", "--steps", "-5"], "--steps"),
        (["train", "--eval-every", "-1"], "--eval-every"),
        (["train", "--stop-after", "0"], "--stop-after"),
        (["train", "--epochs", "0"], "--epochs"),
        (["train", "--synthetic-scale", "-1"], "--synthetic-scale"),
        (["train", "--lr", "nan"], "--lr"),
        (["train", "--cache-ratio", "1.5"], "--cache-ratio"),
        (["train", "--emb-lr", "-1"], "--emb-lr"),
        (["train", "--table", "t_2:bogus=1"], "--table t_2: unknown option 'bogus'"),
        (["train", "--table", "t_99:precision=int4"], "--table t_99: no such table"),
        (["train", "--table", "t_2:associativity=3"], "--table t_2: associativity=3"),
        (["train", "--table", "t_2"], "--table"),
        (["train", "--nproc-per-node", "0"], "--nproc-per-node"),
        (["train", "--nproc-per-node", "2", "--batch-size", "255"], "--nproc-per-node (2)"),
        (["train", "--memory-budget", "1KiB"], "--memory-budget: a budget of 1,024 bytes"),
        (["train", "--memory-budget", "lots"], "--memory-budget"),
        (["train", "--memory-budget", "1GiB", "--table", "t_2:cache_ratio=0.1"], "--table t_2"),
        (
            ["train", "--memory-budget", "1KiB", "--nproc-per-node", "2"],
            "--memory-budget: 1,024 bytes a process cannot be met by 2 processes",
        ),
        (["train", "--plan-rows", "0"], "--plan-rows"),
        # SMALL's 30,000 synthetic rows have a train split of 25,715 (six days of seven)
        (["train", "--batch-size", "25716"], "--batch-size 25716: more than the 25715 rows"),
        (  # a global batch: each of the 2 processes would read 12,858 rows of it
            ["train", "--nproc-per-node", "2", "--batch-size", "25716"],
            "--batch-size 25716: more than the 25715 rows of the train split",
        ),
        (["generate", "OUT", "--synthetic-scale", "-1"], "--synthetic-scale"),
        (["generate", "OUT", "--rows", "0"], "--synthetic-rows"),  # its old name, the same check
        (["preprocess", "SRC", "OUT", "--min-count", "0"], "--min-count"),
    ],
)
def test_invalid_option_is_one_line_exit_2_before_any_work(tmp_path, capsys, argv, option):
    argv = [str(tmp_path / a) if a in ("OUT", "SRC") else a for a in argv]
    if argv[0] == "train":  # the option under test last: it overrides SMALL's
        argv = ["train", "--out", str(tmp_path / "run"), *SMALL, *argv[1:]]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and "error" in err, err
    assert list(tmp_path.iterdir()) == []  # no data generated, no run directory made


def test_a_batch_larger_than_the_train_split_is_refused_before_any_work(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    assert main(["generate", str(data), "--rows", "700", "--scale", "0.0005"]) == 0
    capsys.readouterr()
    argv = ["train", "--out", str(out), "--data", str(data), "--no-progress"]
    assert main([*argv, "--batch-size", "601"]) == 2  # 700 rows: a train split of 600
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--batch-size 601: more than the 600 rows of the train split ({data})" in err, err
    (data / "meta.json").write_text("{}")  # no splits to check it against
    assert main([*argv, "--batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{data / 'meta.json'}: no train split" in err, err
    assert not out.exists()


def test_dense_divergence_stops_at_step_1_with_a_strict_report(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), *SMALL, "--steps", "6", "--lr", "1e30"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "diverged at step 1" in err and "FP16" in err, err
    report = _strict_json(out / "report.json")
    assert report["status"] == "diverged" and report["diverged"]["step"] == 1
    assert report["diverged"]["last_checkpoint_step"] is None
    assert report["test"] is None and report["undefined"]["test"]
    # no step was applied: no gradient statistics, null with the reason (not Infinity)
    assert report["grad_abs"]["min"] is None and report["grad_abs"]["min_undefined"]
    assert latest_checkpoint(out) is None


def test_run_that_only_skips_is_diverged_and_writes_no_checkpoint_of_it(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), *SMALL, "--steps", "10", "--checkpoint-every", "2"]
    # a static loss scale of 1e30 overflows every FP16 gradient: every step is skipped
    argv += ["--loss-scaler", "static", "--static-scale", "1e30", "--max-skipped-in-a-row", "3"]
    assert main(argv) == 1
    assert "diverged at step 3: steps 1 to 3 were all skipped" in capsys.readouterr().err
    report = _strict_json(out / "report.json")
    assert report["status"] == "diverged" and report["skipped_steps"] == 3
    # the checkpoint due at step 2 fell among skipped steps: it was never written
    assert report["diverged"]["last_checkpoint_step"] is None
    assert latest_checkpoint(out) is None


def _criteo_tsv(path, rows: int, no_click_from: int, no_click_to: int) -> None:
    """Criteo-format lines (label, 13 integers, 26 hex ids); no click in the given rows."""
    rng = random.Random(0)
    lines = []
    for r in range(rows):
        label = 0 if no_click_from <= r < no_click_to else int(rng.random() < 0.3)
        ints = [str(rng.randrange(0, 50)) for _ in range(13)]
        ids = [f"{rng.randrange(0, 40):08x}" for _ in range(26)]
        lines.append("\t".join([str(label), *ints, *ids]))
    path.write_text("\n".join(lines) + "\n")


def test_metrics_of_a_split_with_one_class_are_undefined_and_the_report_is_written(tmp_path):
    # 1000 rows: the test split is rows 857-928 (the first half of the last of 7 days)
    _criteo_tsv(tmp_path / "train.txt", 1000, 857, 929)
    data = tmp_path / "data"
    assert main(["preprocess", str(tmp_path / "train.txt"), str(data)]) == 0
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--data", str(data), "--batch-size", "64"]
    assert main([*argv, "--steps", "4", "--eval-every", "2", "--no-progress"]) == 0
    report = _strict_json(out / "report.json")
    test = report["test"]
    assert report["status"] == "completed"
    assert test["auc"] is None and test["normalized_entropy"] is None
    assert "only one class: 0 clicks" in test["undefined"]["auc"]
    assert test["accuracy"] == 1.0 and test["log_loss"] > 0  # defined, and all "no click"


def test_evaluate_refuses_a_checkpoint_of_other_data_at_the_same_path(tmp_path, capsys):
    data, out = tmp_path / "data", tmp_path / "run"
    assert main(["generate", str(data), "--rows", "5000", "--scale", "0.0005"]) == 0
    argv = ["--out", str(out), "--no-progress"]
    train = ["train", *argv, "--data", str(data), "--batch-size", "64", "--eval-every", "0"]
    assert main([*train, "--steps", "2"]) == 0
    assert main(["evaluate", *argv]) == 0
    assert main(["generate", str(data), "--rows", "5000", "--scale", "0.0005", "--seed", "1"]) == 0
    capsys.readouterr()
    assert main(["evaluate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds other data" in err, err


def test_compare_fp32_trains_the_same_run_with_fp32_tables(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), *SMALL, "--steps", "6", "--eval-every", "0"]
    assert main([*argv, "--compare-fp32"]) == 0
    assert "FP32 tables, same run: test auc" in capsys.readouterr().out
    report = _strict_json(out / "report.json")
    fp32 = _strict_json(out / "fp32" / "report.json")
    assert fp32["config"]["precision"] == "fp32" and fp32["config"]["cache_ratio"] == 0.0
    assert fp32["data"]["dir"] == report["data"]["dir"]  # the same data, not generated again
    compared = report["compare_fp32"]
    assert compared["test"] == fp32["test"]
    assert compared["auc_difference"] == report["test"]["auc"] - fp32["test"]["auc"]
    # what the run reports as the FP32 equivalent is what the FP32 run really allocated
    assert report["embeddings"]["fp32_bytes"] == fp32["embeddings"]["memory_bytes"]
    assert report["embeddings"]["memory_bytes"] < 0.6 * fp32["embeddings"]["memory_bytes"]
    assert report["peak_rss_bytes"] > report["embeddings"]["memory_bytes"]
