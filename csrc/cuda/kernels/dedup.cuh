// The backward kernels (docs/contract.md §4.3 step 2): the lookups sorted by (row, position),
// one warp per unique row summing its contributions in lookup order.
#pragma once

#include "common.cuh"

namespace embcache {
namespace EMBCACHE_GPU_NS {

/// Backward, step 1: the bag of every lookup and the packed sort keys (row << 32 | position),
/// for positions [lo, hi) stored at [0, hi - lo). One thread per bag. flags[0] |= error bits.
__global__ void dedup_keys_kernel(const int64_t* idx, const int64_t* off, int64_t nb, int64_t lo,
                                  int64_t hi, int64_t* bag_of, uint64_t* keys,
                                  unsigned long long* flags) {
  for (int64_t b = thread_global(); b < nb; b += threads_in_grid()) {
    const int64_t start = off[b], end = off[b + 1];
    if (!bag_is_valid(start, end, b, nb, lo, hi)) {
      atomicOr(&flags[0], (unsigned long long)kBadOffsets);
      continue;
    }
    for (int64_t l = start; l < end; ++l) {
      const int64_t row = idx[l];
      if (row < 0 || row >= (int64_t(1) << 31)) atomicOr(&flags[0], (unsigned long long)kBadIndex);
      bag_of[l - lo] = b;
      keys[l - lo] = ((uint64_t)row << 32) | (uint64_t)l;
    }
  }
}

/// Backward, step 2: 1 where a new row starts in the sorted keys.
__global__ void segment_flags_kernel(const uint64_t* keys, int64_t n, int shift, int64_t* flag) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid())
    flag[k] = (k == 0 || (keys[k] >> shift) != (keys[k - 1] >> shift)) ? 1 : 0;
}

/// Backward, step 3: starts[u] = the position of unique row u; counters[1] = unique rows.
__global__ void segment_starts_kernel(const int64_t* flag, const int64_t* excl, int64_t n,
                                      int64_t* starts, unsigned long long* counters) {
  for (int64_t k = thread_global(); k < n; k += threads_in_grid()) {
    if (flag[k]) starts[excl[k]] = k;
    if (k == n - 1) {
      counters[1] = (unsigned long long)(excl[k] + flag[k]);
      starts[excl[k] + flag[k]] = n;
    }
  }
}

/// Backward, step 4: one warp per unique row sums its contributions in lookup order; the
/// gradient of bag b is g[b * g_stride + j].
__global__ void dedup_sum_kernel(const uint64_t* keys, const int64_t* starts, int64_t nu,
                                 const int64_t* bag_of, int64_t lo, const int64_t* off,
                                 const float* psw, const float* g, int64_t g_stride, int dim,
                                 bool mean, int64_t* rows, float* grads, int64_t* occ) {
  const unsigned lane = lane_id();
  for (int64_t u = warp_global(); u < nu; u += warps_in_grid()) {
    const int64_t s = starts[u], e = starts[u + 1];
    if (lane == 0) {
      rows[u] = (int64_t)(keys[s] >> 32);
      occ[u] = e - s;
    }
    for (int j = (int)lane; j < dim; j += 32) {
      float acc = 0.f;
      for (int64_t k = s; k < e; ++k) {
        const int64_t l = (int64_t)(keys[k] & 0xffffffffu), b = bag_of[l - lo];
        const float gb = g[b * g_stride + j];
        if (psw) {
          acc += gb * psw[l];
        } else if (mean) {
          const float len = (float)(off[b + 1] - off[b]);
          acc += gb / len;
        } else {
          acc += gb;
        }
      }
      grads[u * dim + j] = acc;
    }
  }
}

int64_t dedup_bags(const Bags& bags, const float* g, int64_t g_stride, int dim, bool mean,
                   DedupAlloc alloc, void* alloc_ctx, Stream stream) {
  const int64_t *idx = bags.idx, *off = bags.off, nb = bags.nb, lo = bags.lo, hi = bags.hi;
  const float* psw = bags.psw;
  if (hi >= (int64_t(1) << 32)) fail("at most 2^32 lookups per call");
  if (lo < 0 || hi < lo) fail("bad range of lookups");
  const int64_t n = hi - lo;
  Scratch keys(n * 8, stream), bag_of(n * 8, stream), starts((n + 1) * 8, stream);
  Scratch counters(2 * sizeof(unsigned long long), stream);
  dev_zero(counters.p, 2 * sizeof(unsigned long long), stream);
  unsigned long long* cnt = counters.as<unsigned long long>();
  // Sort (row, position) pairs packed in one key: rows ascending, positions in order.
  if (nb > 0)
    EC_LAUNCH(dedup_keys_kernel, grid_threads(nb), block_dim(), stream, idx, off, nb, lo, hi,
              bag_of.as<int64_t>(), keys.as<uint64_t>(), cnt);
  if (n > 0) {
    sort_keys_u64(keys.as<uint64_t>(), n, stream);
    Scratch flag(n * 8, stream), excl(n * 8, stream);
    EC_LAUNCH(segment_flags_kernel, grid_threads(n), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), n, 32, flag.as<int64_t>());
    exclusive_sum_i64(flag.as<int64_t>(), excl.as<int64_t>(), n, stream);
    EC_LAUNCH(segment_starts_kernel, grid_threads(n), block_dim(), stream,
              (const int64_t*)flag.as<int64_t>(), (const int64_t*)excl.as<int64_t>(), n,
              starts.as<int64_t>(), cnt);
  }
  unsigned long long host[2];
  copy_to_host(host, counters.p, sizeof(host), stream);
  throw_errors(host[0]);
  const int64_t nu = (int64_t)host[1];
  const DedupOutputs out = alloc(alloc_ctx, nu);
  if (nu > 0)
    EC_LAUNCH(dedup_sum_kernel, grid_warps(nu), block_dim(), stream,
              (const uint64_t*)keys.as<uint64_t>(), (const int64_t*)starts.as<int64_t>(), nu,
              (const int64_t*)bag_of.as<int64_t>(), lo, off, psw, g, g_stride, dim, mean,
              out.rows, out.grads, out.occ);
  return nu;
}

}  // namespace EMBCACHE_GPU_NS
}  // namespace embcache
