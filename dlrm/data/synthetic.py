"""Synthetic Criteo-like data: the default data of ``dlrm train``, so it runs on a fresh machine.

Each row has 13 dense features and 26 categorical ids, as preprocessed Criteo, and a label
from a hidden teacher model, so the data are learnable and the best achievable AUC (the
Bayes AUC: the AUC of the teacher's true probabilities on the generated labels) is known.

Generative model (parameters of ``SyntheticCriteo``):

* Cardinalities: the Kaggle ones (``criteo.KAGGLE_CARDINALITIES``) times ``scale``, rounded,
  but at least ``min(K, MIN_CARDINALITY)`` for a Kaggle cardinality K, so the small tables
  (3, 4, 10, ... up to 32) stay as they are.
* Ids of table t (n ids): rank r in [0, n) with probability proportional to
  ``(r + 1) ** -alpha`` (Zipf-like; ``alpha`` = 1.05 by default), id = ``perm_t[r]`` for a
  random permutation ``perm_t``, so the hot ids are not 0, 1, 2, ...
* Dense feature j: a latent ``z ~ N(mu_j, sigma_j)`` (mu_j ~ U(0, 3), sigma_j ~ U(0.5, 2));
  missing with probability ``p_j ~ U(0, 0.5)``; the feature is ``log(floor(exp(z)) + 1)``
  like Criteo's ``log(x + 1)`` of a count, and 0 when missing.
* Teacher: ``logit = bias + sum_j w_j [present_j] (z_j - mu_j) / sigma_j + sum_t b_t[id_t]
  + sum_{t < s} <v_t[id_t], v_s[id_s]>`` with ``w_j ~ N(0, 0.2^2)``, per-id biases
  ``b ~ N(0, 0.2^2)`` and per-id vectors ``v ~ N(0, 0.17^2 I)`` of ``teacher_dim``
  components (a factorization machine, like DLRM's dot interaction); the label is
  ``Bernoulli(sigmoid(logit))``. ``bias`` is set (by bisection on a calibration block) so
  that the mean probability is ``positive_rate`` (0.25 by default, about Criteo's). With the
  defaults the Bayes AUC is about 0.82.

Determinism: the model comes from ``numpy.random.default_rng([seed, 0, t])``, and rows
``[i * BLOCK_ROWS, (i + 1) * BLOCK_ROWS)`` from ``default_rng([seed, 1, i])``, so the same seed
gives identical arrays however the rows are requested (whole or in chunks). The model holds
32 bytes per id (at ``scale=1`` the 33.8M Kaggle ids take about 1.1 GB).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from sklearn.metrics import roc_auc_score

from dlrm.data.batches import Batch, make_batch, num_batches
from dlrm.data.criteo import KAGGLE_CARDINALITIES, NUM_DENSE, DatasetWriter, split_ranges

MIN_CARDINALITY = 32
BLOCK_ROWS = 16384


def scaled_cardinalities(scale: float) -> list[int]:
    """The Kaggle cardinalities times ``scale``, small ones kept (module docstring)."""
    return [max(round(k * scale), min(k, MIN_CARDINALITY)) for k in KAGGLE_CARDINALITIES]


class SyntheticCriteo:
    """The generator; ``rows(start, stop)`` gives any range of the infinite row sequence."""

    def __init__(
        self,
        scale: float = 0.001,
        alpha: float = 1.05,
        teacher_dim: int = 4,
        positive_rate: float = 0.25,
        seed: int = 0,
    ) -> None:
        self.params = {
            "scale": scale,
            "alpha": alpha,
            "teacher_dim": teacher_dim,
            "positive_rate": positive_rate,
            "seed": seed,
        }
        self.cardinalities = scaled_cardinalities(scale)
        self.seed = seed
        self.cdf, self.perm, self.b, self.v = [], [], [], []
        for t, n in enumerate(self.cardinalities):
            rng = np.random.default_rng([seed, 0, t])
            weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
            self.cdf.append(np.cumsum(weights) / weights.sum())
            self.perm.append(rng.permutation(n).astype(np.int32))
            self.b.append(rng.normal(0, 0.2, n).astype(np.float32))
            self.v.append(rng.normal(0, 0.17, (n, teacher_dim)).astype(np.float32))
        rng = np.random.default_rng([seed, 0, len(self.cardinalities)])
        self.mu = rng.uniform(0, 3, NUM_DENSE)
        self.sigma = rng.uniform(0.5, 2, NUM_DENSE)
        self.p_missing = rng.uniform(0, 0.5, NUM_DENSE)
        self.w = rng.normal(0, 0.2, NUM_DENSE)
        # The bias that gives the wanted mean probability on a calibration block (bisection).
        logit = self._features(np.random.default_rng([seed, 2]))[2]
        lo, hi = -20.0, 20.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _sigmoid(logit + mid).mean() < positive_rate else (lo, mid)
        self.bias = self.params["bias"] = (lo + hi) / 2

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        """Rows ``[start, stop)``: dense float32 [n, 13], sparse int32 [n, 26], labels float32
        [n] and the teacher's probabilities float64 [n]."""
        first, last = start // BLOCK_ROWS, -(-stop // BLOCK_ROWS)
        blocks = [self._block(i) for i in range(first, last)]
        offset = first * BLOCK_ROWS
        return tuple(
            np.concatenate(parts)[start - offset : stop - offset] for parts in zip(*blocks)
        )

    def _block(self, i: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([self.seed, 1, i])
        dense, sparse, logit = self._features(rng)
        prob = _sigmoid(logit + self.bias)
        labels = (rng.random(BLOCK_ROWS) < prob).astype(np.float32)
        return dense, sparse, labels, prob

    def _features(self, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """A block of dense float32, sparse int32 and the teacher's logit less its bias."""
        n = BLOCK_ROWS
        z = rng.normal(self.mu, self.sigma, (n, NUM_DENSE))
        present = rng.random((n, NUM_DENSE)) >= self.p_missing
        dense = np.where(present, np.log1p(np.floor(np.exp(z))), 0).astype(np.float32)
        logit = (present * (z - self.mu) / self.sigma) @ self.w

        u = rng.random((n, len(self.cardinalities)))
        sparse = np.empty((n, len(self.cardinalities)), np.int32)
        v_sum = np.zeros((n, self.v[0].shape[1]))
        v_sq = np.zeros(n)
        for t, cdf in enumerate(self.cdf):
            rank = np.minimum(np.searchsorted(cdf, u[:, t], side="right"), len(cdf) - 1)
            ids = sparse[:, t] = self.perm[t][rank]
            logit += self.b[t][ids]
            v = self.v[t][ids]
            v_sum += v
            v_sq += (v * v).sum(axis=1)
        logit += 0.5 * ((v_sum * v_sum).sum(axis=1) - v_sq)  # sum over pairs t < s
        return dense, sparse, logit

    def batches(
        self,
        num_rows: int,
        split: str,
        batch_size: int,
        *,
        drop_last: bool = False,
        start_batch: int = 0,
    ) -> Iterator[Batch]:
        """Batches of ``split`` of a ``num_rows``-row data set generated on the fly, split as
        preprocessed Criteo (``criteo.split_ranges``); same batches as ``iterate_batches``
        over ``write(dir, num_rows)`` without shuffling (the rows are i.i.d. anyway)."""
        start, stop = split_ranges(num_rows)[split]
        per_step = batch_size * max(1, BLOCK_ROWS // batch_size)
        end = min(stop, start + num_batches(stop - start, batch_size, drop_last) * batch_size)
        for lo in range(start + start_batch * batch_size, end, per_step):
            dense, sparse, labels, _ = self.rows(lo, min(lo + per_step, end))
            for b in range(0, len(labels), batch_size):
                rows = slice(b, b + batch_size)
                yield make_batch(dense[rows], sparse[rows], labels[rows])

    def bayes_auc(self, num_rows: int) -> float | None:
        """The AUC of the teacher's probabilities on the labels of the first ``num_rows`` rows."""
        _, _, labels, prob = self.rows(0, num_rows)
        return _auc(labels, prob)

    def write(self, out_dir: str | os.PathLike, num_rows: int) -> dict:
        """Generate ``num_rows`` rows into ``out_dir`` in the layout of ``dlrm.data.criteo``
        (atomically, see ``DatasetWriter``); returns the metadata written, including the Bayes
        AUC per split and the dataset's ``fingerprint``."""
        if num_rows < 1:
            raise ValueError("num_rows must be positive")
        labels, prob = np.empty(num_rows, np.float32), np.empty(num_rows)
        with DatasetWriter(out_dir, num_rows) as out:
            for lo in range(0, num_rows, 16 * BLOCK_ROWS):
                hi = min(lo + 16 * BLOCK_ROWS, num_rows)
                dense, sparse, labels[lo:hi], prob[lo:hi] = self.rows(lo, hi)
                out.append(dense, sparse, labels[lo:hi])
            splits = split_ranges(num_rows)
            meta = {
                "source_format": "synthetic",
                "rows": num_rows,
                "cardinalities": self.cardinalities,
                "splits": splits,
                "generator": self.params,
                "positive_rate": float(labels.mean()),
                "bayes_auc": _auc(labels, prob),
                "bayes_auc_splits": {
                    name: _auc(labels[a:b], prob[a:b]) for name, (a, b) in splits.items()
                },
            }
            out.commit(meta)
        return meta


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """ROC AUC, or None when only one class is present."""
    return float(roc_auc_score(labels, scores)) if 0 < labels.sum() < len(labels) else None
