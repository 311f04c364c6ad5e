// The optimizers' arithmetic (docs/contract.md §4.5, docs/design.md "Optimizer arithmetic"),
// written once for C++ and CUDA (csrc/include/embcache/portable.h): the CPU update
// (csrc/cpu/update.h, a row at a time) and the CUDA one (csrc/cuda/kernels/update.cuh, a
// warp per row, a lane per element) call these, so both compute the same operations in the
// same order and store bit-identical values and states.
#pragma once

#include "embcache/portable.h"

namespace embcache {

/// An element's new value from its value v and gradient g: v - step * g, where step is lr
/// for SGD and adagrad_step(...) for both AdaGrads.
EMBCACHE_HD float descend(float v, float step, float g) { return v - step * g; }

/// The step size of both AdaGrads for the accumulator acc (the row's, or the element's):
/// lr / (sqrt(acc) + eps), FBGEMM's form.
EMBCACHE_HD float adagrad_step(float lr, float eps, float acc) { return lr / (sqrtf(acc) + eps); }

/// AdaGrad: an element's new accumulator from its accumulator acc and its gradient g.
EMBCACHE_HD float adagrad_accumulator(float acc, float g) { return acc + g * g; }

/// The sum of the squares of a row's gradient g[0, dim), added in element order (the one
/// order: a warp has one lane compute it).
EMBCACHE_HD float sum_of_squares(const float* g, int64_t dim) {
  float sum_sq = 0.f;
  for (int64_t j = 0; j < dim; ++j) sum_sq += g[j] * g[j];
  return sum_sq;
}

/// Row-wise AdaGrad: the row's new accumulator from its accumulator acc and
/// sum_of_squares(g, dim) of its gradient: acc + sum_sq / dim.
EMBCACHE_HD float rowwise_adagrad_accumulator(float acc, float sum_sq, int64_t dim) {
  return acc + sum_sq / (float)dim;
}

}  // namespace embcache
