// Precision telemetry: what rounding did to the rows a table wrote, measured on a sample of
// them (docs/design.md, "Precision telemetry"). No torch, no STL: written for every build.
#pragma once

#include <stdint.h>

#include "embcache/rowquant.h"

namespace embcache {

/// A row written in update `step` is probed when (row + step) % kProbeEvery == 0: a 32nd of
/// the writes (a probe costs about what rounding the row did), each row in turn over the
/// steps, so that hot and cold rows are both seen.
constexpr int64_t kProbeEvery = 32;

EMBCACHE_HD bool is_probed(int64_t row, int64_t step) {
  return ((row + step) & (kProbeEvery - 1)) == 0;
}

/// The sums of the probes of a table's writes, in integers (each row's figures rounded once,
/// so that the sums do not depend on the order the threads add them in): the counters
/// kProbedRows .. kProbedExpectedUpE6 of embcache/table_spec.h.
struct RoundingProbe {
  int64_t rows = 0;          // rows probed (those of 16 or fewer bits)
  int64_t error_sum_e9 = 0;  // sum over the rows of mean_j |x_j - stored_j| / (max x - min x), x 1e9
  int64_t error_max_e9 = 0;  // max over the elements of |x_j - stored_j| / (max x - min x), x 1e9
  int64_t up = 0, down = 0;  // elements rounded up, down (not: exact)
  int64_t expected_up_e6 = 0;  // sum over the elements of the chance of being rounded up
                               // (stochastic rounding; 0 with nearest rounding), x 1e6

  /// Adds row x (float32, f.dim values) as `stored` (its bytes, just written) holds it.
  /// Rows of a constant value add no error (their range is 0). Up and down are the
  /// rounding's choices: for binary16 the neighbour above or below the value; for integer
  /// codes the code above or below (x - bias) * inv, the value quantize_row rounds (the
  /// decoded value can then sit a rounding error off the value, e.g. at the row's maximum).
  EMBCACHE_HD void add(const RowFormat& f, const float* x, const uint8_t* stored,
                       bool stochastic) {
    if (f.bits == 32) return;  // stored as it is
    float mn, mx;
    row_min_max(x, f.dim, &mn, &mx);
    const double range = (double)mx - (double)mn;
    // element errors in float32, relative to the range (per_range: its inverse, or 1 for a
    // constant row), summed per row in float64
    const float per_range = range > 0.0 ? (float)(1.0 / range) : 1.f;
    double error = 0.0, chance = 0.0;
    float worst = 0.f;
    int64_t n_up = 0, n_down = 0;  // locals: the members could alias the row's bytes
    if (f.is_int()) {
      float scale, bias;  // as stored; inv: the factor quantize_row computed the codes with
      load_qparams(f, stored, &scale, &bias);
      const float inv = row_qparams(f, mn, mx).inv, q_max = (float)((1 << f.bits) - 1);
      for (int j = 0; j < f.dim; ++j) {
        const float code = (float)load_code(f, stored, j);
        const float v = code * scale + bias;  // as dequantize_element
        const float e = fabsf(v - x[j]) * per_range;  // a branch would be a coin flip
        error += e;
        worst = e > worst ? e : worst;
        const float y = (x[j] - bias) * inv, below = floorf(y);
        n_up += code > y;
        n_down += code < y;
        if (stochastic && y > 0.f && below < q_max) chance += y - below;
      }
    } else {  // binary16
      for (int j = 0; j < f.dim; ++j) {
        const float v = half_to_float(load_u16(stored + 2 * j));
        const float e = fabsf(v - x[j]) * per_range;  // a branch would be a coin flip
        error += e;
        worst = e > worst ? e : worst;
        n_up += v > x[j];
        n_down += v < x[j];
        if (stochastic) chance += half_chance_up(x[j]);
      }
    }
    if (range > 0.0) {
      error_sum_e9 += (int64_t)(error / f.dim * 1e9 + 0.5);
      const int64_t w = (int64_t)((double)worst * 1e9 + 0.5);
      error_max_e9 = w > error_max_e9 ? w : error_max_e9;
    }
    expected_up_e6 += (int64_t)(chance * 1e6 + 0.5);
    up += n_up;
    down += n_down;
    ++rows;
  }

  EMBCACHE_HD void merge(const RoundingProbe& o) {
    rows += o.rows;
    error_sum_e9 += o.error_sum_e9;
    error_max_e9 = o.error_max_e9 > error_max_e9 ? o.error_max_e9 : error_max_e9;
    up += o.up;
    down += o.down;
    expected_up_e6 += o.expected_up_e6;
  }

  /// The chance that stochastic rounding rounds x up to its binary16 neighbour above: the
  /// distance to the lower neighbour over the neighbours' distance (docs/contract.md §3), in
  /// value order.
  EMBCACHE_HD static double half_chance_up(float x) {
    const uint32_t abs_bits = float_bits(x) & 0x7fffffffu;
    const uint16_t lo = half_bits_toward_zero(abs_bits);
    const float a = bits_float(abs_bits), lo_f = half_to_float(lo);
    if (a == lo_f) return 0.0;
    const float hi_f = lo == 0x7bffu ? 65536.f : half_to_float((uint16_t)(lo + 1));
    const double away = ((double)a - lo_f) / ((double)hi_f - lo_f);  // from zero
    return x > 0.f ? away : 1.0 - away;
  }
};

}  // namespace embcache
