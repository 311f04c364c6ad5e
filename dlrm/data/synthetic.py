"""Synthetic Criteo-like data: the default data of ``dlrm train``, so it runs on a fresh machine.

Each row has 13 dense features and 26 categorical ids, as preprocessed Criteo, and a label
from a hidden teacher model, so the data are learnable and the best achievable AUC (the
Bayes AUC: the AUC of the teacher's true probabilities on the generated labels) is known.

The model stores nothing per id: whatever an id needs (its place in the popularity order,
its teacher parameters) is a function of a hash of (seed, column, id), so memory does not
grow with the cardinalities (at ``scale=1``, Kaggle's full 33.8M ids, the model holds a few
hundred numbers and a 256 KB table; generating takes some 40 MB of temporaries per thread)
and is built at once.

Generative model (parameters of ``SyntheticCriteo``):

* Cardinalities: the Kaggle ones (``criteo.KAGGLE_CARDINALITIES``) times ``scale``, rounded,
  but at least ``min(K, MIN_CARDINALITY)`` for a Kaggle cardinality K, so the small tables
  (3, 4, 10, ... up to 32) stay as they are.
* Ids of table t (n ids): a popularity rank r in [0, n), then id = ``(a_t * r + c_t) mod n``
  (a bijection: ``a_t`` coprime with n, both drawn from the seed), so the hot ids are not
  0, 1, 2, .... The rank is 0 with probability ``head_t``, else it follows a power law: with
  probability ``1 - head_t``, ``r = floor(x) - 1`` where x has density proportional to
  ``x ** -alpha_t`` on [1, n + 1] (drawn by inverting its CDF; the continuous version of a
  Zipf law ``(r + 1) ** -alpha_t``). So the hottest k ids take the share
  ``head_t + (1 - head_t) * (1 - (k + 1) ** (1 - alpha_t)) / (1 - (n + 1) ** (1 - alpha_t))``
  of the accesses (``SyntheticCriteo.share_of_hottest``). ``head_t`` models a value much more
  frequent than the rest (in Criteo often the missing value, 45% of some columns).
  The defaults ``KAGGLE_ALPHA`` and ``KAGGLE_HEAD`` are fitted per column to the first
  10,000 rows of Kaggle's train.txt by ``bench/calibrate_synthetic.py`` (shares of the
  hottest 1% and 10% of the values seen, share of values seen once;
  bench/results/synthetic_calibration/).
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
* Per-id parameters: ``h_k = splitmix64(id + s_{t,k})`` (the 64-bit finalizer of
  SplitMix64, in numpy uint64 arithmetic; salts ``s_{t,k}`` drawn from the seed) gives
  4 independent 16-bit fields per hash; field f is mapped to the normal quantile
  ``Phi^-1((f + 0.5) / 65536)`` (a table, rescaled to unit variance), so b and the
  components of v are normals quantized to 65,536 levels (|x| < 4.2). b is field 0,
  v_i field i + 1 (``ceil((teacher_dim + 1) / 4)`` hashes per id).

Determinism: the per-column constants come from ``numpy.random.default_rng([seed, 0, t])``,
and rows ``[i * BLOCK_ROWS, (i + 1) * BLOCK_ROWS)`` from ``default_rng([seed, 1, i])``, so
the same seed gives identical arrays however the rows are requested (whole or in chunks,
with any number of ``threads``: blocks are generated independently, in parallel, and put in
order).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm import tqdm

from dlrm.data.batches import Batch, make_batch, num_batches
from dlrm.data.criteo import KAGGLE_CARDINALITIES, NUM_DENSE, DatasetWriter, split_ranges

MIN_CARDINALITY = 32
BLOCK_ROWS = 16384
PROGRESS_MIN_ROWS = 1_000_000  # write() shows a progress bar from this many rows

# Per column C1..C26: (alpha, head) of the power law (module docstring), fitted to the first
# 10,000 rows of Kaggle's train.txt by `python bench/calibrate_synthetic.py --fit`.
KAGGLE_SKEW = (
    (1.94, 0.01),  # C1
    (1.06, 0.0),  # C2
    (1.02, 0.05),  # C3
    (1.08, 0.0),  # C4
    (2.56, 0.0),  # C5
    (0.2, 0.42),  # C6
    (0.72, 0.0),  # C7
    (1.9, 0.0),  # C8
    (0.62, 0.8),  # C9
    (1.02, 0.08),  # C10
    (0.72, 0.0),  # C11
    (1.02, 0.06),  # C12
    (0.78, 0.0),  # C13
    (1.8, 0.0),  # C14
    (0.86, 0.0),  # C15
    (1.02, 0.1),  # C16
    (1.04, 0.19),  # C17
    (0.84, 0.0),  # C18
    (1.7, 0.53),  # C19
    (1.06, 0.01),  # C20
    (1.02, 0.1),  # C21
    (0.2, 0.8),  # C22
    (1.78, 0.0),  # C23
    (1.12, 0.11),  # C24
    (1.88, 0.02),  # C25
    (1.32, 0.08),  # C26
)
KAGGLE_ALPHA = tuple(a for a, _ in KAGGLE_SKEW)
KAGGLE_HEAD = tuple(h for _, h in KAGGLE_SKEW)

_B_STD, _V_STD = 0.2, 0.17
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_NORMAL_TABLE: np.ndarray | None = None


def scaled_cardinalities(scale: float) -> list[int]:
    """The Kaggle cardinalities times ``scale``, small ones kept (module docstring)."""
    return [max(round(k * scale), min(k, MIN_CARDINALITY)) for k in KAGGLE_CARDINALITIES]


def _one_minus(alpha: float) -> float:
    """1 - alpha; alpha = 1 (x = (n + 1) ** u, the limit) is nudged to avoid dividing by 0."""
    return 1 - alpha if abs(1 - alpha) > 1e-6 else -1e-6


def power_law_ranks(
    u: np.ndarray, n: np.ndarray, alpha: Sequence[float], head: Sequence[float]
) -> np.ndarray:
    """int64 popularity ranks in [0, n) from uniforms u in [0, 1), per column (the last axis;
    ``n``, ``alpha``, ``head`` one value per column): rank 0 with probability ``head``, else
    ``floor(x) - 1``, x of density proportional to ``x ** -alpha`` on [1, n + 1] (by the
    inverse CDF, in float64 so that the tails of 10M-id columns stay reachable)."""
    n = np.asarray(n, np.int64)
    head = np.asarray(head, np.float64)
    one_minus = np.array([_one_minus(a) for a in alpha])
    scale = 1 - (n + 1.0) ** one_minus
    u = np.maximum((u - head) / (1 - head), 0)
    x = (1 - u * scale) ** (1 / one_minus)
    return np.minimum(x.astype(np.int64) - 1, n - 1)


def _per_column(value: float | Sequence[float], name: str) -> list[float]:
    values = [float(value)] * len(KAGGLE_CARDINALITIES) if np.isscalar(value) else list(value)
    if len(values) != len(KAGGLE_CARDINALITIES):
        raise ValueError(f"{name}: one value or {len(KAGGLE_CARDINALITIES)}, got {len(values)}")
    return [float(v) for v in values]


class SyntheticCriteo:
    """The generator; ``rows(start, stop)`` gives any range of the infinite row sequence.

    ``alpha`` and ``head``: one value for all columns or one per column (module docstring);
    ``threads``: blocks generated in parallel by ``rows`` and ``write`` (the data do not
    depend on it; default: the CPU count, at most 4)."""

    def __init__(
        self,
        scale: float = 0.001,
        alpha: float | Sequence[float] = KAGGLE_ALPHA,
        head: float | Sequence[float] = KAGGLE_HEAD,
        teacher_dim: int = 4,
        positive_rate: float = 0.25,
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        alpha, head = _per_column(alpha, "alpha"), _per_column(head, "head")
        if not all(0 <= h < 1 for h in head) or not all(a > 0 for a in alpha):
            raise ValueError("head must be in [0, 1) and alpha positive")
        self.params = {
            "scale": scale,
            "alpha": alpha,
            "head": head,
            "teacher_dim": teacher_dim,
            "positive_rate": positive_rate,
            "seed": seed,
        }
        self.cardinalities = scaled_cardinalities(scale)
        self.seed = seed
        self.teacher_dim = teacher_dim
        self.threads = threads or min(4, os.cpu_count() or 1)
        self._head = np.array(head)
        self._one_minus = np.array([_one_minus(a) for a in alpha])
        hashes = -(-(teacher_dim + 1) // 4)
        mult, offset, salt = [], [], []
        for t, card in enumerate(self.cardinalities):
            rng = np.random.default_rng([seed, 0, t])
            a = int(rng.integers(1, card)) if card > 1 else 1
            while math.gcd(a, card) != 1:
                a = a + 1 if a + 1 < card else 1
            mult.append(a)
            offset.append(int(rng.integers(0, card)))
            salt.append(rng.integers(0, 2**63, hashes))
        self._mult = np.array(mult, np.int64)
        self._offset = np.array(offset, np.int64)
        self._n = np.array(self.cardinalities, np.int64)
        self._salt = np.array(salt, np.uint64).T  # [hashes, 26]
        rng = np.random.default_rng([seed, 0, len(self.cardinalities)])
        self.mu = rng.uniform(0, 3, NUM_DENSE).astype(np.float32)
        self.sigma = rng.uniform(0.5, 2, NUM_DENSE).astype(np.float32)
        self.p_missing = rng.uniform(0, 0.5, NUM_DENSE).astype(np.float32)
        self.w = rng.normal(0, 0.2, NUM_DENSE).astype(np.float32)
        # The bias that gives the wanted mean probability on a calibration block (bisection).
        logit = self._features(np.random.default_rng([seed, 2]))[2].astype(np.float64)
        lo, hi = -20.0, 20.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _sigmoid(logit + mid).mean() < positive_rate else (lo, mid)
        self.bias = self.params["bias"] = (lo + hi) / 2

    def share_of_hottest(self, table: int, k: int) -> float:
        """The model's share of table ``table``'s accesses taken by its ``k`` hottest ids."""
        n, head = self.cardinalities[table], self._head[table]
        if k <= 0:
            return 0.0
        k = min(k, n)
        om = self._one_minus[table]
        return float(head + (1 - head) * (1 - (k + 1) ** om) / (1 - (n + 1) ** om))

    def ranks(self, u: np.ndarray) -> np.ndarray:
        """int64 popularity ranks [rows, 26] from uniforms u in [0, 1) [rows, 26]."""
        return power_law_ranks(u, self._n, self.params["alpha"], self.params["head"])

    def ids_of_ranks(self, ranks: np.ndarray) -> np.ndarray:
        """The ids (int64) of popularity ranks [rows, 26]: the bijection of the docstring."""
        return (ranks * self._mult + self._offset) % self._n

    def id_params(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The teacher's per-id bias b [rows, 26] and vector v [rows, 26, teacher_dim]
        (float32) of ids [rows, 26] (int64), from their hash (module docstring)."""
        values = self._id_values(ids)
        return values[0] * np.float32(_B_STD), np.moveaxis(values[1:], 0, -1) * np.float32(_V_STD)

    def _id_values(self, ids: np.ndarray) -> np.ndarray:
        """float32 [1 + teacher_dim, rows, 26]: b / 0.2 and the components of v / 0.17."""
        keys = ids.astype(np.uint64)
        hashes = np.empty((len(self._salt), *ids.shape), np.uint64)
        for k, salt in enumerate(self._salt):
            np.add(keys, salt, out=hashes[k])
            _splitmix64(hashes[k])
        fields = hashes.view(np.uint16).reshape(*hashes.shape, 4)  # [hashes, rows, 26, 4]
        fields = np.moveaxis(fields, -1, 1).reshape(-1, *ids.shape)[: 1 + self.teacher_dim]
        return _normal_table()[fields]

    def rows(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        """Rows ``[start, stop)``: dense float32 [n, 13], sparse int32 [n, 26], labels float32
        [n] and the teacher's probabilities float32 [n]."""
        first, last = start // BLOCK_ROWS, -(-stop // BLOCK_ROWS)
        blocks = list(self._blocks(first, last))
        offset = first * BLOCK_ROWS
        return tuple(
            np.concatenate(parts)[start - offset : stop - offset] for parts in zip(*blocks)
        )

    def _blocks(self, first: int, last: int) -> Iterator[tuple[np.ndarray, ...]]:
        """Blocks ``first`` to ``last - 1`` in order, generated by ``threads`` threads (at
        most twice as many blocks in flight, so memory stays bounded)."""
        if self.threads <= 1 or last - first <= 1:
            yield from (self._block(i) for i in range(first, last))
            return
        with ThreadPoolExecutor(self.threads) as pool:
            pending = deque()
            for i in range(first, last):
                pending.append(pool.submit(self._block, i))
                if len(pending) >= 2 * self.threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _block(self, i: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([self.seed, 1, i])
        dense, sparse, logit = self._features(rng)
        prob = _sigmoid(logit + np.float32(self.bias))
        labels = (rng.random(BLOCK_ROWS, np.float32) < prob).astype(np.float32)
        return dense, sparse, labels, prob

    def _features(self, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """A block of dense float32, sparse int32 and the teacher's logit (float32) less its
        bias."""
        n = BLOCK_ROWS
        s = rng.standard_normal((n, NUM_DENSE), np.float32)
        present = rng.random((n, NUM_DENSE), np.float32) >= self.p_missing
        z = s * self.sigma + self.mu
        dense = np.where(present, np.log1p(np.floor(np.exp(z))), np.float32(0))
        logit = (present * s) @ self.w

        ids = self.ids_of_ranks(self.ranks(rng.random((n, len(self.cardinalities)))))
        values = self._id_values(ids)  # unit normals: b / 0.2, v / 0.17
        v_sum = values[1:] @ np.ones(values.shape[2], np.float32)  # [teacher_dim, n]
        v_sq = np.einsum("knt,knt->n", values[1:], values[1:])
        logit += np.float32(_B_STD) * values[0].sum(axis=1)
        logit += np.float32(0.5 * _V_STD**2) * ((v_sum * v_sum).sum(axis=0) - v_sq)  # t < s
        return dense, ids.astype(np.int32), logit

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

    def write(self, out_dir: str | os.PathLike, num_rows: int, progress: bool = True) -> dict:
        """Generate ``num_rows`` rows into ``out_dir`` in the layout of ``dlrm.data.criteo``
        (atomically, see ``DatasetWriter``); returns the metadata written, including the Bayes
        AUC per split and the dataset's ``fingerprint``. ``progress``: a progress bar on
        stderr (from ``PROGRESS_MIN_ROWS`` rows)."""
        if num_rows < 1:
            raise ValueError("num_rows must be positive")
        labels, prob = np.empty(num_rows, np.float32), np.empty(num_rows, np.float32)
        bar = tqdm(
            total=num_rows,
            desc="synthetic data",
            unit="rows",
            unit_scale=True,
            disable=not progress or num_rows < PROGRESS_MIN_ROWS,
        )
        with bar, DatasetWriter(out_dir, num_rows) as out:
            for i, block in enumerate(self._blocks(0, -(-num_rows // BLOCK_ROWS))):
                lo, hi = i * BLOCK_ROWS, min((i + 1) * BLOCK_ROWS, num_rows)
                dense, sparse, labels[lo:hi], prob[lo:hi] = (a[: hi - lo] for a in block)
                out.append(dense, sparse, labels[lo:hi])
                bar.update(hi - lo)
            splits = split_ranges(num_rows)
            meta = {
                "source_format": "synthetic",
                "rows": num_rows,
                "cardinalities": self.cardinalities,
                "splits": splits,
                "generator": self.params,
                "positive_rate": float(labels.mean(dtype=np.float64)),
                "bayes_auc": _auc(labels, prob),
                "bayes_auc_splits": {
                    name: _auc(labels[a:b], prob[a:b]) for name, (a, b) in splits.items()
                },
            }
            out.commit(meta)
        return meta


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (a bijection of uint64 with good avalanche), in place on x."""
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return x


def _normal_table() -> np.ndarray:
    """float32 [65536]: the normal quantiles of (f + 0.5) / 65536, rescaled to unit variance."""
    global _NORMAL_TABLE
    if _NORMAL_TABLE is None:
        from scipy.special import ndtri  # scipy comes with scikit-learn

        q = ndtri((np.arange(65536) + 0.5) / 65536)
        _NORMAL_TABLE = (q / q.std()).astype(np.float32)
    return _NORMAL_TABLE


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _auc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """ROC AUC (ties count one half, as ``sklearn.metrics.roc_auc_score``) of binary
    ``labels`` and float32 ``scores``, or None when only one class is present. One sort of
    int64 keys (the score's order-preserving bits, then the label), several times faster
    than sklearn's."""
    positive = np.asarray(labels) > 0.5
    num_pos = int(positive.sum())
    num_neg = len(positive) - num_pos
    if num_pos == 0 or num_neg == 0:
        return None
    scores = np.asarray(scores, np.float32) + np.float32(0)  # -0.0 becomes +0.0
    bits = scores.view(np.int32).astype(np.int64)
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats: reverse their order
    key = np.sort((bits << 1) | positive)
    score, pos = key >> 1, key & 1
    starts = np.flatnonzero(np.concatenate([[True], score[1:] != score[:-1]]))
    pos_in = np.add.reduceat(pos, starts)
    neg_in = np.diff(np.append(starts, len(key))) - pos_in
    neg_below = np.cumsum(neg_in) - neg_in
    return float((pos_in * (neg_below + 0.5 * neg_in)).sum() / num_pos / num_neg)
