"""Sizing of DLRM on Criteo's 1TB click logs over N GPUs: embedding memory per rank (FP32
against INT8 behind a 5% 32-way LFU cache) and bytes each rank sends per step, from our
memory formula and the shapes of TorchRec's communication; the basis of docs/scaling.md.

The model is MLPerf's DLRM: 26 tables hashed to at most 40M ids (``--max-ind-range
40000000`` of the reference DLRM), dim 128, bottom MLP 13-512-256-128, top MLP
479-1024-1024-512-256-1, row-wise AdaGrad for the tables (one FP32 accumulator per row).
Memory per rank assumes the planner balances the bytes evenly; the largest table is shown
apart, since table-wise sharding cannot split it (row-wise can).

Bytes sent per rank per step, global batch B over N ranks (each rank holds B/N samples and
1/N of the tables): the KJT all-to-all of its samples' ids (26 int64 ids and int32 lengths
per sample) to the ranks holding the tables; the pooled all-to-all of the bags it computed
for the other ranks' samples (FP32, 26 x 128 per sample), and the same size again for their
gradients on the way back; DDP's ring all-reduce of the FP16 dense gradients
(2 (N - 1) / N of their bytes); our 32-byte decision all-reduce. Each of the first three is
(N - 1) / N of the batch's total, the part that leaves the rank.

    python bench/scaling.py
"""

from __future__ import annotations

import argparse

from embcache.config import TableConfig
from embcache.memory import memory_breakdown

# Criteo 1TB with --max-ind-range 40000000 (the reference DLRM's MLPerf configuration)
CARDINALITIES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]  # fmt: skip
DIM = 128
BOTTOM = (13, 512, 256, 128)
TOP = (479, 1024, 1024, 512, 256, 1)
GiB = 2**30


def table_bytes(rows: int, **options) -> int:
    return memory_breakdown(TableConfig(rows, DIM, optimizer="rowwise_adagrad", **options))["total"]


def dense_params() -> int:
    return sum(a * b + b for w in (BOTTOM, TOP) for a, b in zip(w, w[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=65536, help="global batch")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = p.parse_args()
    fp32 = {n: table_bytes(n, precision="fp32", cache_ratio=0.0) for n in CARDINALITIES}
    ours = {n: table_bytes(n, precision="int8", cache_ratio=0.05) for n in CARDINALITIES}
    largest = max(CARDINALITIES)
    print(f"tables: {sum(CARDINALITIES):,} rows, dim {DIM}")
    print(
        f"all tables: FP32 {sum(fp32.values()) / GiB:.1f} GiB, INT8 + 5% LFU "
        f"{sum(ours.values()) / GiB:.1f} GiB (factor {sum(ours.values()) / sum(fp32.values()):.3f})"
    )
    print(
        f"largest table ({largest:,} rows): FP32 {fp32[largest] / GiB:.1f} GiB, "
        f"INT8 + 5% LFU {ours[largest] / GiB:.1f} GiB"
    )
    dense = dense_params()
    print(f"dense parameters: {dense:,} (FP16 gradients {2 * dense / 2**20:.1f} MiB)")
    print()
    b = args.batch_size
    print(
        "| ranks | FP32 tables per rank (GiB) | INT8 + 5% LFU per rank (GiB) | ids a2a (MiB) "
        "| pooled a2a fwd + bwd (MiB) | DDP all-reduce (MiB) | sent per rank per step (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        leaves = (n - 1) / n
        local = b / n
        ids = local * 26 * (8 + 4) * leaves
        pooled = 2 * local * 26 * DIM * 4 * leaves
        ddp = 2 * leaves * 2 * dense if n > 1 else 0
        total = ids + pooled + ddp + (32 if n > 1 else 0)
        print(
            f"| {n} | {sum(fp32.values()) / n / GiB:.1f} | {sum(ours.values()) / n / GiB:.1f} "
            f"| {ids / 2**20:.1f} | {pooled / 2**20:.1f} | {ddp / 2**20:.1f} "
            f"| {total / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
