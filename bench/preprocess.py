"""Benchmark: our Criteo TSV preprocessing versus TorchRec's ``BinaryCriteoUtils.tsv_to_npys``.

Writes a random Criteo-format TSV of ``--lines`` lines (about 5% ragged: the last two
categorical fields empty and their tabs left out), then runs each preprocessing in a fresh
subprocess and reports wall time, lines/s and peak RSS (``ru_maxrss`` of that subprocess,
read with ``resource.getrusage(RUSAGE_CHILDREN)`` in a wrapper process around it).

TorchRec's row mapper indexes all 40 fields and fails on ragged lines, so both tools are
compared on a padded copy of the file; ours also runs on the ragged original. Note that
``tsv_to_npys`` only parses (raw hex values, no contiguous ids: that is TorchRec's separate
``sparse_to_contiguous`` step), while ours also counts values and maps them to ids.

Prints a table under the command, commit, machine and library versions
(bench/_common.environment); --out DIR also writes it to DIR/preprocess.md and
DIR/preprocess.json.

    python bench/preprocess.py --lines 2000000 [--workdir DIR] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# Runs argv[1:] and prints its peak RSS in KiB (Linux ru_maxrss unit).
MEASURE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def write_random_tsv(
    path: Path, lines: int, seed: int = 0, ragged: bool = True, chunk: int = 100_000
) -> None:
    """A random Criteo-format TSV: 0/1 label, 13 ints (some empty or negative), 26 hex fields.

    5% of the lines have their last two categorical fields empty; with ``ragged`` their two
    trailing tabs are left out, as in the real files (the same seed gives the same content).
    """
    rng = np.random.default_rng(seed)
    # Per column a pool of hex strings, drawn with a skew (Criteo ids are heavy-tailed).
    pools = [
        np.array([f"{v:08x}" for v in rng.integers(0, 2**32, size=n)], dtype=object)
        for n in rng.integers(3, 50_000, size=26)
    ]
    with open(path, "w") as f:
        for start in range(0, lines, chunk):
            n = min(chunk, lines - start)
            cols = [np.where(rng.random(n) < 0.25, "1", "0").astype(object)]
            for j in range(13):
                x = np.floor(rng.lognormal(1.0, 2.0, n)).astype(np.int64) - (j == 1)
                cols.append(np.where(rng.random(n) < 0.3, "", x.astype(str)).astype(object))
            for pool in pools:
                pick = np.minimum(rng.zipf(1.3, n) - 1, len(pool) - 1)
                cols.append(np.where(rng.random(n) < 0.1, "", pool[pick]))
            short = rng.random(n) < 0.05
            cols[-2][short] = cols[-1][short] = ""
            rows = ["\t".join(r) for r in zip(*cols)]
            f.write("\n".join(r[:-2] if s and ragged else r for r, s in zip(rows, short)) + "\n")


def _child(tool: str, src: str, out: str) -> None:
    if tool == "ours":
        sys.path.insert(0, str(ROOT))
        from dlrm.data.criteo import preprocess_criteo

        preprocess_criteo(src, out, progress=False)
    else:
        from torchrec.datasets.criteo import BinaryCriteoUtils

        Path(out).mkdir(parents=True, exist_ok=True)
        BinaryCriteoUtils.tsv_to_npys(
            src,
            f"{out}/dense.npy",
            f"{out}/sparse.npy",
            f"{out}/labels.npy",
            dataset_name="criteo_1tb",
        )


def _measure(tool: str, src: Path, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of one preprocessing run in a fresh subprocess."""
    start = time.perf_counter()
    rss = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE,
            sys.executable,
            __file__,
            "--child",
            tool,
            str(src),
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - start, int(rss.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp directory")
    parser.add_argument("--child", nargs=3, metavar=("TOOL", "SRC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", type=Path, help="write preprocess.md and preprocess.json in this directory"
    )
    args = parser.parse_args()
    if args.child:
        return _child(*args.child)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import environment, environment_markdown, write_text

    env = environment(__file__)

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        ragged, padded = tmp / "ragged.tsv", tmp / "padded.tsv"
        start = time.perf_counter()
        write_random_tsv(ragged, args.lines, args.seed, ragged=True)
        write_random_tsv(padded, args.lines, args.seed, ragged=False)
        size_mib = padded.stat().st_size / 2**20
        print(
            f"wrote 2 x {args.lines} lines in {time.perf_counter() - start:.1f} s "
            f"({size_mib:.0f} MiB each)"
        )
        runs = {
            (tool, src.stem): _measure(tool, src, tmp / f"out_{tool}_{src.stem}")
            for tool, src in (("ours", ragged), ("ours", padded), ("torchrec", padded))
        }

    (ours_s, ours_rss), (tr_s, tr_rss) = runs["ours", "padded"], runs["torchrec", "padded"]
    md = "\n".join(
        [
            "# Criteo TSV preprocessing",
            "",
            environment_markdown(env),
            "",
            f"A random Criteo-format TSV of {args.lines:,} lines (seed {args.seed}; 5% ragged), "
            f"{size_mib:.0f} MiB padded; each tool in a fresh subprocess; peak RSS of that process.",
            "",
            "| tool | input | seconds | lines/s | peak RSS MiB |",
            "|---|---|---:|---:|---:|",
            *(
                f"| {tool} | {src} | {sec:.2f} | {args.lines / sec:,.0f} | {rss:.0f} |"
                for (tool, src), (sec, rss) in runs.items()
            ),
            "",
            f"torchrec / ours on the padded file: time x{tr_s / ours_s:.2f}, "
            f"peak RSS x{tr_rss / ours_rss:.2f}",
            "",
        ]
    )
    print("\n" + md)
    if args.out:
        result = {
            "environment": env,
            "lines": args.lines,
            "seed": args.seed,
            "padded_mib": size_mib,
            "runs": [
                {
                    "tool": tool,
                    "input": src,
                    "seconds": sec,
                    "lines_per_second": args.lines / sec,
                    "peak_rss_mib": rss,
                }
                for (tool, src), (sec, rss) in runs.items()
            ],
            "torchrec_over_ours_time": tr_s / ours_s,
            "torchrec_over_ours_peak_rss": tr_rss / ours_rss,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        write_text(args.out / "preprocess.md", md)
        write_text(args.out / "preprocess.json", json.dumps(result, indent=2))
        print(f"wrote {args.out}/preprocess.md, preprocess.json")


if __name__ == "__main__":
    main()
