"""Click-through-rate metrics (docs/contract.md §7).

Every function takes binary ``labels`` (0 or 1) and the model's ``logits`` (not probabilities:
the model has no sigmoid), as tensors or array-likes of one value per sample, and computes in
float64. The predicted click probability is ``sigmoid(logit)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

__all__ = [
    "NEUTRAL_DROP_PERCENT",
    "auc",
    "accuracy",
    "log_loss",
    "normalized_entropy",
    "relative_accuracy_drop",
    "evaluate",
]

# The paper calls a configuration accuracy-neutral when its relative drop is below 0.02 %.
NEUTRAL_DROP_PERCENT = 0.02


def _arrays(labels, logits) -> tuple[np.ndarray, np.ndarray]:
    def flat(a) -> np.ndarray:
        if torch.is_tensor(a):
            a = a.detach().cpu().double().numpy()
        return np.asarray(a, dtype=np.float64).reshape(-1)

    y, z = flat(labels), flat(logits)
    if y.shape != z.shape or y.size == 0:
        raise ValueError(f"need as many labels as logits, at least one; got {y.size} and {z.size}")
    return y, z


def auc(labels, logits) -> float:
    """Area under the ROC curve (scikit-learn's ``roc_auc_score``; ties count one half).
    Raises ``ValueError`` when only one class is present."""
    y, z = _arrays(labels, logits)
    return float(roc_auc_score(y, z))


def accuracy(labels, logits) -> float:
    """Fraction of samples whose prediction ``p > 0.5`` (i.e. ``logit > 0``) equals the label.
    ``p = 0.5`` counts as no click, as the reference DLRM's ``round(p)`` does."""
    y, z = _arrays(labels, logits)
    return float(np.mean((z > 0) == (y == 1)))


def log_loss(labels, logits) -> float:
    """Mean binary cross-entropy in nats, ``mean(log(1 + e^z) - y z)``, computed stably from
    the logits (no clipping of probabilities)."""
    y, z = _arrays(labels, logits)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def normalized_entropy(labels, logits) -> float:
    """Log loss divided by the entropy of the base rate ``p = mean(labels)``,
    ``-(p log p + (1 - p) log(1 - p))``: 1 for a model that always predicts the base rate,
    lower is better. Raises ``ValueError`` when only one class is present (entropy 0)."""
    y, _ = _arrays(labels, logits)
    p = float(np.mean(y))
    if not 0.0 < p < 1.0:
        raise ValueError("normalized entropy is undefined when only one class is present")
    base_entropy = -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))
    return log_loss(labels, logits) / base_entropy


def relative_accuracy_drop(acc_fp32: float, acc: float) -> float:
    """The paper's metric, in percent: ``(acc_fp32 - acc) / acc_fp32 * 100``. Negative when the
    model beats the FP32 reference; "neutral" means below :data:`NEUTRAL_DROP_PERCENT`."""
    if acc_fp32 <= 0:
        raise ValueError(f"reference accuracy must be positive, got {acc_fp32}")
    return (acc_fp32 - acc) / acc_fp32 * 100.0


METRICS = {
    "auc": auc,
    "accuracy": accuracy,
    "log_loss": log_loss,
    "normalized_entropy": normalized_entropy,
}


def evaluate(labels, logits) -> dict:
    """All per-run metrics at once: ``auc``, ``accuracy``, ``log_loss``, ``normalized_entropy``.

    A metric that is undefined on these samples is ``None``, and ``undefined`` maps its name
    to the reason: AUC and normalized entropy when only one class is present (a small split
    of click logs may hold no click at all), every metric when a logit is not finite. The
    result holds no NaN or infinity, so it is valid strict JSON.
    """
    y, z = _arrays(labels, logits)
    reasons = {}
    if not np.isfinite(z).all():
        bad = int(np.size(z) - np.isfinite(z).sum())
        reasons = {name: f"{bad} of {z.size} logits are not finite" for name in METRICS}
    else:
        clicks = int(np.sum(y == 1))
        if clicks in (0, y.size):
            why = f"only one class: {clicks} clicks in {y.size} samples"
            reasons = {"auc": why, "normalized_entropy": why}
    out = {name: None if name in reasons else f(y, z) for name, f in METRICS.items()}
    out["undefined"] = reasons
    return out
