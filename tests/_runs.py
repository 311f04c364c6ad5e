"""What several tests' `dlrm train` runs share: a run of seconds on synthetic data."""

SMALL_RUN = [
    "--synthetic-scale",
    "0.001",
    "--synthetic-rows",
    "20000",
    "--batch-size",
    "256",
    "--eval-every",
    "0",
    "--no-progress",
]
