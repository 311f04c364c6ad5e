// abs_range and unscale_abs_range (csrc/op_schemas.h): the gradient range of the trainer's
// overflow check, one read of each gradient instead of the half-dozen passes torch's amax /
// where / amin make; unscale_abs_range multiplies each element by the scale in the same pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace embcache {
namespace cpu {
namespace {

struct Range {
  float max = 0.f;
  float min_nonzero = std::numeric_limits<float>::infinity();
  bool nan = false;
};

constexpr int64_t kChunk = 1 << 16;  // elements per task

// kLanes independent accumulators, each element's lane fixed by its position, so that the
// compiler keeps them in vector registers (a single running max / min is a loop-carried
// dependence it will not vectorize without -ffast-math); max and min are exact in any order.
constexpr int kLanes = 16;

// The range of g[i] * scale (Scaled) or of g[i]; with Scaled the products are written back.
template <bool Scaled>
Range range_of(float* g, int64_t n, float scale) {
  const float inf = std::numeric_limits<float>::infinity();
  float mx[kLanes], mn[kLanes];
  int32_t nan[kLanes];
  for (int l = 0; l < kLanes; ++l) mx[l] = 0.f, mn[l] = inf, nan[l] = 0;
  auto add = [&](int l, float& x) {
    if (Scaled) x = x * scale;
    const float a = std::fabs(x);
    nan[l] |= a != a;
    mx[l] = a > mx[l] ? a : mx[l];
    const float nonzero = a == 0.f ? inf : a;
    mn[l] = nonzero < mn[l] ? nonzero : mn[l];
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) add(l, g[i + l]);
  for (int l = 0; i < n; ++i, ++l) add(l, g[i]);
  Range r;
  for (int l = 0; l < kLanes; ++l) {
    r.nan |= nan[l] != 0;
    r.max = std::max(r.max, mx[l]);
    r.min_nonzero = std::min(r.min_nonzero, mn[l]);
  }
  return r;
}

template <bool Scaled>
std::tuple<double, double> range(at::TensorList tensors, float scale, const char* op) {
  std::vector<std::pair<float*, int64_t>> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const at::Tensor& g = tensors[t];
    TORCH_CHECK(g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous(),
                "embcache: ", op, " takes contiguous float32 CPU tensors; tensor ", t, " is ",
                g.scalar_type(), " on ", g.device());
    float* p = g.data_ptr<float>();
    for (int64_t at = 0; at < g.numel(); at += kChunk)
      chunks.emplace_back(p + at, std::min(kChunk, g.numel() - at));
  }
  std::vector<Range> part(chunks.size());
  at::parallel_for(0, (int64_t)chunks.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      part[c] = range_of<Scaled>(chunks[c].first, chunks[c].second, scale);
  });
  Range all;
  for (const Range& r : part) {
    all.nan |= r.nan;
    all.max = std::max(all.max, r.max);
    all.min_nonzero = std::min(all.min_nonzero, r.min_nonzero);
  }
  if (all.nan) return {std::nan(""), std::nan("")};
  return {all.max, all.min_nonzero};
}

std::tuple<double, double> abs_range(at::TensorList tensors) {
  return range<false>(tensors, 1.f, "abs_range");
}

std::tuple<double, double> unscale_abs_range(at::TensorList tensors, double scale) {
  return range<true>(tensors, (float)scale, "unscale_abs_range");
}

}  // namespace

TORCH_LIBRARY_IMPL(embcache, CPU, m) {
  m.impl("abs_range", &abs_range);
  m.impl("unscale_abs_range", &unscale_abs_range);
}

}  // namespace cpu
}  // namespace embcache
