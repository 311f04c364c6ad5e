"""FP16 products as tensor cores compute them (docs/contract.md §6): :func:`linear`,
:func:`bmm` and the :class:`Linear` module take FP16 operands, accumulate in FP32 and round
the result to FP16 once. On CUDA that is the native FP16 kernel. On CPU it is emulated
exactly by an FP32 GEMM over the FP16-valued operands, rounded once (native CPU FP16 GEMM is
far slower). The backward pass is FP16 as well: the gradient of an FP16 tensor is FP16, so
gradients underflow (below 2^-24) and overflow (above 65504) exactly where they would on a
GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


def _emulated(t: Tensor) -> bool:
    return t.dtype == torch.float16 and t.device.type == "cpu"


def _check_same_dtype(*tensors: Tensor | None) -> None:
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) > 1:
        raise TypeError(f"operands must share one dtype, got {sorted(map(str, dtypes))}")


class _EmulatedHalfLinear(torch.autograd.Function):
    """``y = fp16(x @ W^T + b)`` with FP32 accumulation; backward likewise (see :func:`linear`)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        y = x.float() @ weight.float().t()
        if bias is not None:
            y += bias.float()
        return y.half()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, weight = ctx.saved_tensors
        g = grad_y.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).half()
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).half()
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).half()
        return grad_x, grad_w, grad_b


class _EmulatedHalfBmm(torch.autograd.Function):
    """``c = fp16(a @ b)`` batched, with FP32 accumulation; backward likewise (see :func:`bmm`)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return torch.bmm(a.float(), b.float()).half()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_c: Tensor):
        a, b = ctx.saved_tensors
        g = grad_c.float()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.bmm(g, b.float().transpose(1, 2)).half()
        if ctx.needs_input_grad[1]:
            grad_b = torch.bmm(a.float().transpose(1, 2), g).half()
        return grad_a, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` whose FP16 version is what a tensor core computes, on CPU too.

    For FP16 operands on CPU the result is ``fp16(fp32(x) @ fp32(W)^T + fp32(b))``: an FP32
    GEMM over the FP16 values, the bias added in FP32 before the single rounding to FP16 (the
    bias epilogue of a tensor-core GEMM). The backward pass computes
    ``grad_x = fp16(g @ W)``, ``grad_W = fp16(g^T @ x)`` and ``grad_b = fp16(sum_rows g)``, each
    accumulated in FP32 and rounded once, so all gradients are FP16. Everywhere else (FP32
    operands, or CUDA, where FP16 is native) this is ``F.linear``. Operands must share a dtype.
    (On CUDA, PyTorch lets cuBLAS use reduced-precision split-K reductions for FP16 by default;
    set ``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False`` for strict
    FP32 accumulation.) Under ``torch.autocast`` this is ``F.linear``, its operands' dtype
    autocast's to choose.
    """
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    _check_same_dtype(x, weight, bias)
    if _emulated(weight):
        return _EmulatedHalfLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.bmm`` whose FP16 version is what a tensor core computes, on CPU too.

    For FP16 operands on CPU the result is ``fp16(bmm(fp32(a), fp32(b)))`` and the backward
    pass returns ``fp16(g @ b^T)`` and ``fp16(a^T @ g)``, each accumulated in FP32 and rounded
    once. Everywhere else this is ``torch.bmm``. Operands must share a dtype, but under
    ``torch.autocast``, which chooses it.
    """
    if torch.is_autocast_enabled(a.device.type):
        return torch.bmm(a, b)
    _check_same_dtype(a, b)
    if _emulated(a):
        return _EmulatedHalfBmm.apply(a, b)
    return torch.bmm(a, b)


class Linear(nn.Linear):
    """``nn.Linear`` that computes with :func:`linear`: after ``.half()`` it is a tensor-core layer."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
