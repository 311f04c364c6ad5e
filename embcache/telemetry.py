"""Precision telemetry: what the low precision costs a table (docs/design.md, "Precision
telemetry").

* The rounding of the rows a table writes (evicted or bypassing cache rows, the rows of a
  table without a cache, a flush): the ops probe every row whose ``(row + step) % 32 == 0``
  (a 32nd of the writes, every row in turn over the steps) into the counters ``probed_*``
  of :data:`embcache.config.COUNTERS`; :func:`rounding_figures` turns them into figures. The
  CPU ops measure them; the CUDA kernels leave them 0.
* The rows never updated: :class:`TouchedSample` follows a fixed random sample of a table's
  rows (all of them for small tables).
"""

from __future__ import annotations

import torch

from embcache.config import COUNTERS

PROBE_COUNTERS = tuple(name for name in COUNTERS if name.startswith("probed_"))
# rows followed by a TouchedSample: the share it estimates is within about 3 points (one
# standard error at a share of one half)
TOUCHED_SAMPLE_ROWS = 256


def rounding_figures(counts: dict) -> dict:
    """The figures of the probes counted in ``counts`` (a table's counters, or their change
    over an interval; the largest error is the largest so far):

    * ``rounding_error_mean``: the probed rows' mean of ``|x - stored| / (max x - min x)``;
    * ``rounding_error_max``: the largest element error, relative to its row's range;
    * ``rounded_up_share``: of the elements the rounding moved, the share it rounded up (to
      the binary16 or the code above the value); ``expected_up_share``: the share stochastic
      rounding should give (each element's chance of going up, summed; 0 with nearest
      rounding). The two stay within a few
      ``1 / sqrt(moved)`` of each other when the rounding is really stochastic.
    """
    rows, moved = counts["probed_rows"], counts["probed_up"] + counts["probed_down"]
    return {
        "rounding_error_mean": counts["probed_error_sum_e9"] / 1e9 / rows if rows else 0.0,
        "rounding_error_max": counts["probed_error_max_e9"] / 1e9,
        "rounded_up_share": counts["probed_up"] / moved if moved else 0.0,
        "expected_up_share": counts["probed_expected_up_e6"] / 1e6 / moved if moved else 0.0,
    }


class TouchedSample:
    """Which rows of a table of ``num_rows`` rows were ever updated, followed on a fixed
    sample of them (every row when there are at most ``TOUCHED_SAMPLE_ROWS``; else that many
    drawn with ``seed``), marked by the table's group after each committed update (every
    table's sample searched for in the update's rows at once: embcache.group's
    ``_mark_touched``); :meth:`untouched_share` is the estimate of the share never updated."""

    def __init__(self, num_rows: int, seed: int, device: torch.device | str = "cpu"):
        if num_rows <= TOUCHED_SAMPLE_ROWS:
            rows = torch.arange(num_rows)
        else:
            gen = torch.Generator().manual_seed(seed)
            rows = torch.randint(num_rows, (TOUCHED_SAMPLE_ROWS,), generator=gen).unique()
        self.rows = rows.to(device)
        self.touched = torch.zeros(rows.numel(), dtype=torch.bool, device=device)

    def untouched_share(self) -> float:
        n = self.touched.numel()
        return 1.0 - int(self.touched.sum()) / n if n else 0.0

    def state(self) -> list[int]:
        """The positions in the sample of the rows touched (for a checkpoint)."""
        return torch.nonzero(self.touched).flatten().tolist()

    def load(self, touched: list[int]) -> None:
        """Takes :meth:`state`'s positions (checked by the caller: ascending, in range)."""
        self.touched.zero_()
        if touched:
            self.touched[torch.tensor(touched, device=self.touched.device)] = True
