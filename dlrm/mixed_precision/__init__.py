"""Dense mixed precision (docs/contract.md §6): FP16 products, loss scalers and the training step.

Three ideas, one public piece each:

* **FP16 products.** :func:`linear`, :func:`bmm` and the :class:`Linear` module compute products
  of FP16 tensors the way tensor cores do: FP16 operands, FP32 accumulation, one rounding of the
  result to FP16. On CUDA that is the native FP16 kernel. On CPU it is emulated exactly by an
  FP32 GEMM over the FP16-valued operands, rounded once (native CPU FP16 GEMM is far slower).
  The backward pass is FP16 as well: the gradient of an FP16 tensor is FP16, so gradients
  underflow (below 2^-24) and overflow (above 65504) exactly where they would on a GPU.
* **Loss scalers.** :class:`StaticScaler`, :class:`BackoffScaler` and :class:`LogMaxScaler`
  (common base :class:`LossScaler`) choose the loss scale ``S`` of the next step from the
  overflow decision and the largest gradient of the current one.
* **The step.** :class:`MixedPrecisionTrainer` keeps FP16 dense weights with FP32 masters,
  scales the FP32 loss, unscales every gradient in FP32, makes one overflow decision per step
  for dense and embedding gradients together, and applies either all of the step or none of it.
  Embedding collections that keep their own sparse update take part through the
  :class:`MixedPrecisionEmbedding` protocol.
"""

from dlrm.mixed_precision.fp16 import Linear, bmm, linear
from dlrm.mixed_precision.scalers import (
    MAX_SCALE,
    MIN_SCALE,
    SCALERS,
    BackoffScaler,
    LogMaxScaler,
    LossScaler,
    StaticScaler,
    make_scaler,
)
from dlrm.mixed_precision.trainer import (
    DENSE_PRECISIONS,
    OPTIMIZERS,
    MixedPrecisionEmbedding,
    MixedPrecisionTrainer,
    ScalingReport,
    StepRefusedError,
)

__all__ = [
    "linear",
    "bmm",
    "Linear",
    "MixedPrecisionEmbedding",
    "LossScaler",
    "StaticScaler",
    "BackoffScaler",
    "LogMaxScaler",
    "make_scaler",
    "ScalingReport",
    "MixedPrecisionTrainer",
    "StepRefusedError",
    "MIN_SCALE",
    "MAX_SCALE",
    "SCALERS",
    "DENSE_PRECISIONS",
    "OPTIMIZERS",
]
