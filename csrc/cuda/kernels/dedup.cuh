// The backward kernels (docs/contract.md §4.3 step 2): every feature's lookups sorted at once
// by (feature, row, position), then one warp per unique row summing its contributions in
// lookup order.
#pragma once

#include <algorithm>
#include <vector>

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Rows below 2^31 (cache tags are int32): the sort key of lookup l is feature << 31 | row.
constexpr int kRowBits = 31;

/// Backward, step 1: the sort key and the bag of every lookup, with the position as the
/// sort's value. One thread per bag; feature f's bags are [f * batch, (f + 1) * batch).
/// flags[0] |= error bits.
__global__ void dedup_keys_kernel(Bags bags, int64_t batch, uint64_t* keys, int64_t* pos,
                                  int64_t* bag_of, unsigned long long* flags) {
  for (int64_t g = thread_global(); g < bags.nb; g += threads_in_grid()) {
    const int64_t start = bags.off[g], end = bags.off[g + 1];
    if (!bag_is_valid(start, end, g, bags.total, bags.n)) {
      atomicOr(&flags[kErrorFlag], (unsigned long long)kBadOffsets);
      continue;
    }
    const uint64_t feature = (uint64_t)(g / batch);
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = bags.idx[l];
      if (row < 0 || row >= (int64_t(1) << kRowBits))
        atomicOr(&flags[kErrorFlag], (unsigned long long)kBadIndex);
      keys[l] = (feature << kRowBits) | ((uint64_t)row & ((uint64_t(1) << kRowBits) - 1));
      pos[l] = l;
      bag_of[l] = g;
    }
  }
}

/// Backward, step 2: 1 where a new (feature, row) starts in the sorted keys.
__global__ void segment_flags_kernel(const uint64_t* keys, int64_t n, int64_t* flag) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid())
    flag[k] = (k == 0 || keys[k] != keys[k - 1]) ? 1 : 0;
}

/// Backward, step 3: starts[u] = the sorted position of unique row u, starts[nu] = n;
/// *nu = the number of unique rows.
__global__ void segment_starts_kernel(const int64_t* flag, const int64_t* excl, int64_t n,
                                      int64_t* starts, int64_t* nu) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid()) {
    if (flag[k]) starts[excl[k]] = k;
    if (k == n - 1) {
      *nu = excl[k] + flag[k];
      starts[excl[k] + flag[k]] = n;
    }
  }
}

/// Backward, step 4: feature_starts[f] (f = 0..nf) = the first unique row of feature f or
/// later (nu past the last): unique row u writes the entries of the features after u - 1's
/// up to its own. One thread per u in [0, nu].
__global__ void feature_starts_kernel(const uint64_t* keys, const int64_t* starts, int64_t n,
                                      int64_t nf, const int64_t* unique_rows,
                                      int64_t* feature_starts) {
  const int64_t nu = *unique_rows;
  auto feature = [&](int64_t u) {
    const int64_t f = (int64_t)(keys[starts[u]] >> kRowBits);
    return f < nf ? f : nf;
  };
  for (int64_t u = thread_global(); u <= nu && u <= n; u += threads_in_grid()) {
    const int64_t to = u < nu ? feature(u) : nf, from = u > 0 ? feature(u - 1) + 1 : 0;
    for (int64_t f = from; f <= to; ++f) feature_starts[f] = u;
  }
}

/// One feature's part of the backward's sums: its unique rows [u_start, u_end) of the op's,
/// its bags from `first`, its gradient's column in g, its argmax's column (max pooling), where
/// its gradient rows start in the output, its rows' dim and its pooling (a Pooling). The
/// host fills all but u_start, u_end and block, which place_features_kernel fills on the
/// device.
struct DedupFeature {
  int64_t u_start, u_end, first, col, argmax_col, block;
  int dim, pooling;
};

/// Backward, step 5: each feature's unique rows and gradient block from feature_starts (one
/// thread: a handful of features), into the features and the op's row_ranges ([nf, 3],
/// csrc/tables.h RowRange).
__global__ void place_features_kernel(DedupFeature* features, int64_t nf,
                                      const int64_t* feature_starts, int64_t* ranges) {
  if (thread_global() != 0) return;
  int64_t block = 0;
  for (int64_t f = 0; f < nf; ++f) {
    DedupFeature& F = features[f];
    F.u_start = feature_starts[f];
    F.u_end = feature_starts[f + 1];
    F.block = block;
    ranges[3 * f] = F.u_start;
    ranges[3 * f + 1] = F.u_end;
    ranges[3 * f + 2] = block;
    block += (F.u_end - F.u_start) * F.dim;
  }
}

/// The gradient rows whose loads a lane has in flight before adding them in dedup_sum_kernel
/// (a hot row's thousands of contributions; the adds stay in lookup order): 4 rows, or about
/// 8 chunks of 32 floats for wider tiles, whose registers would otherwise cost occupancy.
template <int Chunks>
constexpr int kRowsInFlight = Chunks >= 8 ? 1 : Chunks >= 4 ? 2 : 4;

/// Backward, step 6, every feature in one launch: one warp per unique row (the first
/// *unique_rows positions of the n the grid covers: those of the features) sums its
/// contributions in lookup order, the sums in registers (a tile
/// of Chunks * 32 elements at a time); the gradient of feature F's bag b is
/// g[F.col + (b - F.first) * g_stride + j]. The contributions come 32 at a time: lane i reads
/// the i-th one's bag and factor (one round of loads), then the warp loads
/// kRowsInFlight<Chunks> rows of g before adding them. One launch for every feature: a
/// feature's hot row (its warp walks thousands of contributions) overlaps the other
/// features' work. AnyMax (launched only when a feature is max-pooled): a max-pooled
/// feature's lookup l contributes element j of its bag b's gradient where
/// argmax[F.argmax_col + (b - F.first) * argmax_stride + j] == l, and 0 elsewhere.
template <int Chunks, bool AnyMax>
__device__ __forceinline__ void dedup_sum_warp(const uint64_t* keys, const int64_t* pos,
                                               const int64_t* starts,
                                               const DedupFeature* features, int64_t nf,
                                               int64_t n, const int64_t* unique_rows,
                                               const int64_t* bag_of,
                                               const int64_t* off, const float* psw,
                                               const float* g, int64_t g_stride,
                                               const int32_t* argmax, int64_t argmax_stride,
                                               int64_t* rows, float* grads, int64_t* occ) {
  const int lane = (int)lane_id();
  const int64_t nu = *unique_rows < n ? *unique_rows : n;
  for (int64_t u = warp_global(); u < nu; u += warps_in_grid()) {
    const DedupFeature& F = features[last_at<DedupFeature, &DedupFeature::u_start>(features, nf, u)];
    const int dim = F.dim;
    const bool mean = F.pooling == kMean;
    const bool by_max = AnyMax && F.pooling == kMax;
    const float* gf = g + F.col;  // bag b's gradient at (b - F.first) * g_stride
    float* out = grads + F.block + (u - F.u_start) * dim;
    const int64_t s = starts[u], e = starts[u + 1];
    if (lane == 0) {
      rows[u] = (int64_t)(keys[s] & ((uint64_t(1) << kRowBits) - 1));
      occ[u] = e - s;
    }
    for (int tile = 0; tile < dim; tile += Chunks * 32) {
      float acc[Chunks];
#pragma unroll
      for (int k = 0; k < Chunks; ++k) acc[k] = 0.f;
      for (int64_t c0 = s; c0 < e; c0 += 32) {
        const int n = e - c0 < 32 ? (int)(e - c0) : 32;
        // Lane i: contribution c0 + i's row of g and its factor (its weight, 1 / its bag's
        // length for mean, or none).
        int64_t row_at = 0, lookup = 0, argmax_at = 0;
        float weight = 0.f, len = 0.f;
        if (lane < n) {
          const int64_t l = pos[c0 + lane], bag = bag_of[l];
          row_at = (bag - F.first) * g_stride;
          if (psw) weight = psw[l];
          if (mean) len = (float)(off[bag + 1] - off[bag]);
          if constexpr (AnyMax) {
            lookup = l;
            argmax_at = F.argmax_col + (bag - F.first) * argmax_stride;
          }
        }
        constexpr int kInFlight = kRowsInFlight<Chunks>;
        for (int i0 = 0; i0 < n; i0 += kInFlight) {
          float v[kInFlight][Chunks];
#pragma unroll
          for (int i = 0; i < kInFlight; ++i) {
            const int64_t at = __shfl_sync(kFullMask, row_at, (i0 + i) & 31);
#pragma unroll
            for (int k = 0; k < Chunks; ++k) {
              const int j = tile + lane + 32 * k;
              v[i][k] = i0 + i < n && j < dim ? gf[at + j] : 0.f;
            }
            if constexpr (AnyMax) {
              const int64_t li = __shfl_sync(kFullMask, lookup, (i0 + i) & 31);
              const int64_t ai = __shfl_sync(kFullMask, argmax_at, (i0 + i) & 31);
#pragma unroll
              for (int k = 0; k < Chunks; ++k) {
                const int j = tile + lane + 32 * k;
                if (by_max && i0 + i < n && j < dim && argmax[ai + j] != li) v[i][k] = 0.f;
              }
            }
          }
#pragma unroll
          for (int i = 0; i < kInFlight; ++i) {
            const float wi = __shfl_sync(kFullMask, weight, (i0 + i) & 31);
            const float li = __shfl_sync(kFullMask, len, (i0 + i) & 31);
            if (i0 + i < n) {
#pragma unroll
              for (int k = 0; k < Chunks; ++k)
                acc[k] += psw ? v[i][k] * wi : mean ? v[i][k] / li : v[i][k];
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < Chunks; ++k) {
        const int j = tile + lane + 32 * k;
        if (j < dim) out[j] = acc[k];
      }
    }
  }
}

/// dedup_sum_warp without max-pooled features.
template <int Chunks>
__global__ void dedup_sum_kernel(const uint64_t* keys, const int64_t* pos, const int64_t* starts,
                                 const DedupFeature* features, int64_t nf, int64_t n,
                                 const int64_t* unique_rows, const int64_t* bag_of,
                                 const int64_t* off, const float* psw, const float* g,
                                 int64_t g_stride, int64_t* rows, float* grads, int64_t* occ) {
  dedup_sum_warp<Chunks, false>(keys, pos, starts, features, nf, n, unique_rows, bag_of, off,
                                psw, g, g_stride, nullptr, 0, rows, grads, occ);
}

/// dedup_sum_warp with max-pooled features.
template <int Chunks>
__global__ void dedup_max_sum_kernel(const uint64_t* keys, const int64_t* pos,
                                     const int64_t* starts, const DedupFeature* features,
                                     int64_t nf, int64_t n, const int64_t* unique_rows,
                                     const int64_t* bag_of, const int64_t* off, const float* psw,
                                     const float* g, int64_t g_stride, const int32_t* argmax,
                                     int64_t argmax_stride, int64_t* rows, float* grads,
                                     int64_t* occ) {
  dedup_sum_warp<Chunks, true>(keys, pos, starts, features, nf, n, unique_rows, bag_of, off,
                               psw, g, g_stride, argmax, argmax_stride, rows, grads, occ);
}

/// The number of low key bits the sort must order: the row's and the feature's.
inline int key_bits(int64_t nf) {
  int bits = kRowBits;
  while (nf > 1 && (int64_t(1) << (bits - kRowBits)) < nf) ++bits;
  return bits;
}

void dedup_features(const Bags& bags, int64_t batch, int64_t nf, const int64_t* feature_table,
                    const TableSpec* specs, const float* g, int64_t g_stride,
                    const int32_t* argmax, const int64_t* argmax_col, DedupOutputs out,
                    int64_t* ranges, unsigned long long* errors, Stream stream) {
  const int64_t n = bags.n;
  // [nu, the features' first unique rows (nf + 1)], from 0: no lookups, no unique rows.
  Scratch counts((1 + nf + 1) * sizeof(int64_t), stream);
  dev_fill(counts.p, 0, (1 + nf + 1) * sizeof(int64_t), stream);
  int64_t* nu = counts.as<int64_t>();
  int64_t* feature_starts = nu + 1;
  Scratch keys(n * 8, stream), pos(n * 8, stream), bag_of(n * 8, stream),
      starts((n + 1) * 8, stream);
  // Lookups of no valid bag (bad offsets) keep keys of all ones: past every feature, so that
  // no sum reads them (the error bits stop the update that would use the rest).
  if (n > 0) dev_fill(keys.p, 0xff, n * 8, stream);
  if (bags.nb > 0 && batch > 0)
    EC_LAUNCH(dedup_keys_kernel, grid_threads(bags.nb), block_dim(), stream, bags, batch,
              keys.as<uint64_t>(), pos.as<int64_t>(), bag_of.as<int64_t>(), errors);
  if (n > 0) {
    sort_pairs_u64_i64(keys.as<uint64_t>(), pos.as<int64_t>(), n, 0, key_bits(nf), stream);
    Scratch flag(n * 8, stream), excl(n * 8, stream);
    EC_LAUNCH(segment_flags_kernel, grid_threads(n), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), n, flag.as<int64_t>());
    exclusive_sum_i64(flag.as<int64_t>(), excl.as<int64_t>(), n, stream);
    EC_LAUNCH(segment_starts_kernel, grid_threads(n), block_dim(), stream,
              (const int64_t*)flag.as<int64_t>(), (const int64_t*)excl.as<int64_t>(), n,
              starts.as<int64_t>(), nu);
    EC_LAUNCH(feature_starts_kernel, grid_threads(n + 1), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)starts.as<int64_t>(), n,
              nf, (const int64_t*)nu, feature_starts);
  }
  std::vector<DedupFeature> features;
  int max_dim = 0;
  for (int64_t f = 0, col = 0; f < nf; ++f) {
    const TableSpec& t = specs[feature_table[f]];
    features.push_back({0, 0, f * batch, col, argmax_col[f], 0, t.f.dim, t.pooling});
    max_dim = std::max(max_dim, t.f.dim);
    col += t.f.dim;
  }
  if (nf == 0) return;
  const DeviceArray<DedupFeature> d(features.data(), nf, stream);
  EC_LAUNCH(place_features_kernel, 1, block_dim(), stream, const_cast<DedupFeature*>(d.get()),
            nf, (const int64_t*)feature_starts, ranges);
  if (n == 0) return;
  if (argmax_col[nf] > 0)
    EC_LAUNCH_TILED(dedup_max_sum_kernel, max_dim, grid_warps(n), block_dim(), stream,
                    (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)pos.as<int64_t>(),
                    (const int64_t*)starts.as<int64_t>(), d.get(), nf, n,
                    (const int64_t*)(feature_starts + nf),
                    (const int64_t*)bag_of.as<int64_t>(), bags.off, bags.psw, g, g_stride,
                    argmax, argmax_col[nf], out.rows, out.grads, out.occ);
  else
    EC_LAUNCH_TILED(dedup_sum_kernel, max_dim, grid_warps(n), block_dim(), stream,
                    (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)pos.as<int64_t>(),
                    (const int64_t*)starts.as<int64_t>(), d.get(), nf, n,
                    (const int64_t*)(feature_starts + nf),
                    (const int64_t*)bag_of.as<int64_t>(), bags.off, bags.psw, g, g_stride,
                    out.rows, out.grads, out.occ);
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
