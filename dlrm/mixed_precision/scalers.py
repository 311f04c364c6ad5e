"""Loss scalers (docs/contract.md §6): :class:`StaticScaler`, :class:`BackoffScaler` and
:class:`LogMaxScaler` (common base :class:`LossScaler`) choose the loss scale ``S`` of the
next step from the overflow decision and the largest gradient of the current one."""

from __future__ import annotations

import math

MIN_SCALE = 1.0
MAX_SCALE = 2.0**24
_FP16_MIN_SUBNORMAL = 2.0**-24


class LossScaler:
    """Holds the loss scale ``S`` and updates it once per training step.

    ``scale`` is the factor by which the next step's loss is multiplied. After that step's
    overflow decision the trainer calls ``update(found_inf, max_abs_grad)`` exactly once, on
    applied and skipped steps alike: ``found_inf`` is true iff a dense or embedding gradient was
    non-finite, and ``max_abs_grad`` is the largest unscaled |gradient| (non-finite on overflow,
    0 when every gradient is zero). The new ``scale`` is used from the next step on.
    ``state_dict`` holds the mutable state only, the attributes named by ``state_keys``; the
    configuration comes from the constructor. Scales are Python floats (double precision).
    """

    state_keys: tuple[str, ...] = ("scale",)

    def __init__(self, scale: float) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale must be finite and positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool, max_abs_grad: float) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.state_keys}

    def load_state_dict(self, state: dict) -> None:
        for name in self.state_keys:
            setattr(self, name, state[name])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale})"


class StaticScaler(LossScaler):
    """A constant loss scale ``S``. Overflowing steps are still skipped; ``S`` never changes."""

    def update(self, found_inf: bool, max_abs_grad: float) -> None:
        pass


class BackoffScaler(LossScaler):
    """Dynamic loss scaling by backoff and growth (``torch.amp.GradScaler``'s rule).

    Start at ``init_scale``. On a step with a non-finite gradient: ``S *= backoff_factor`` and the
    count of clean steps restarts at 0. On a clean step the count grows by one; when it reaches
    ``growth_interval``, ``S *= growth_factor`` and the count restarts at 0. With ``clamp`` the
    result is then clamped to ``[MIN_SCALE, MAX_SCALE] = [1, 2^24]``. With ``clamp=False`` the
    sequence of scales is ``torch.amp.GradScaler``'s for the same overflow pattern and
    arguments, as long as the scale stays within the float32 range (GradScaler keeps its scale
    as a float32 tensor and refuses a growth to inf; here scales are doubles).
    """

    state_keys = ("scale", "growth_tracker")

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        clamp: bool = True,
    ) -> None:
        super().__init__(init_scale)
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clamp = clamp
        self.growth_tracker = 0

    def update(self, found_inf: bool, max_abs_grad: float) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        if self.clamp:
            self.scale = min(max(self.scale, MIN_SCALE), MAX_SCALE)


class LogMaxScaler(LossScaler):
    """OpenSeq2Seq's ``LogMaxScaler``: aim the largest scaled gradient at ``2^log_max``.

    Each step ``t = 1, 2, ...`` observes ``x_t = log2(max_abs_grad)`` of the unscaled gradients,
    with two special cases: a non-finite step counts as ``x_t = log_max`` (16); a step whose
    gradients are all zero (every one underflowed in FP16) counts as
    ``x_t = log2(2^-24 / S_t)``, the bound below which the scaled gradients vanish (OpenSeq2Seq
    would take ``log2(0)`` and poison its statistics). Then, with statistics initialised to 0::

        m1  = beta1 * m1 + (1 - beta1) * x_t          mu    = m1 / (1 - beta1^t)
        m1s = beta2 * m1s + (1 - beta2) * x_t         mu_s  = m1s / (1 - beta2^t)
        m2  = beta2 * m2 + (1 - beta2) * x_t^2        sigma = sqrt(max(m2 / (1 - beta2^t) - mu_s^2, 0))
        S_{t+1} = clamp(2^(log_max - (mu + overflow_std_dev * sigma)), MIN_SCALE, MAX_SCALE)

    i.e. the mean ``mu`` is the fast (``beta1``) bias-corrected average and ``sigma`` the standard
    deviation under the slow (``beta2``) average, as OpenSeq2Seq computes it. Step ``t``'s own
    ``x_t`` is included in the statistics that set the scale of step ``t + 1``. The scale of the
    first step is ``init_scale`` (OpenSeq2Seq: 1). The scale is not rounded to a power of two,
    so scaling and unscaling are not exact (they are for the other scalers' powers of two).
    Arithmetic is in double precision (OpenSeq2Seq: float32).
    """

    state_keys = ("scale", "t", "m1", "m1s", "m2")

    def __init__(
        self,
        init_scale: float = 1.0,
        beta1: float = 0.99,
        beta2: float = 0.999,
        overflow_std_dev: float = 3.09,
        log_max: float = 16.0,
    ) -> None:
        super().__init__(init_scale)
        self.beta1 = beta1
        self.beta2 = beta2
        self.overflow_std_dev = overflow_std_dev
        self.log_max = log_max
        self.t = 0
        self.m1 = self.m1s = self.m2 = 0.0

    def update(self, found_inf: bool, max_abs_grad: float) -> None:
        if found_inf or not math.isfinite(max_abs_grad):
            x = self.log_max
        elif max_abs_grad == 0.0:
            x = math.log2(_FP16_MIN_SUBNORMAL / self.scale)
        else:
            x = math.log2(max_abs_grad)
        b1, b2 = self.beta1, self.beta2
        self.t += 1
        self.m1 = b1 * self.m1 + (1 - b1) * x
        self.m1s = b2 * self.m1s + (1 - b2) * x
        self.m2 = b2 * self.m2 + (1 - b2) * x * x
        mu = self.m1 / (1 - b1**self.t)
        mu_s = self.m1s / (1 - b2**self.t)
        sigma = math.sqrt(max(self.m2 / (1 - b2**self.t) - mu_s * mu_s, 0.0))
        log_scale = self.log_max - (mu + self.overflow_std_dev * sigma)
        self.scale = 2.0 ** min(
            max(log_scale, math.log2(MIN_SCALE)), math.log2(MAX_SCALE)
        )  # clamp(2^log_scale)


_SCALERS = {"static": StaticScaler, "backoff": BackoffScaler, "logmax": LogMaxScaler}
SCALERS = tuple(_SCALERS)


def make_scaler(kind: str, **kwargs) -> LossScaler:
    """Build a scaler by name: ``"static"`` (needs ``scale=``), ``"backoff"`` or ``"logmax"``."""
    try:
        cls = _SCALERS[kind]
    except KeyError:
        raise ValueError(f"unknown loss scaler {kind!r}; choose from {sorted(_SCALERS)}") from None
    return cls(**kwargs)
