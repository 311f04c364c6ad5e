// The cache kernels of docs/contract.md §2-4 and their host functions (csrc/cuda/cache_api.h),
// one file per phase under csrc/cuda/kernels/ (their common part says how they are built and
// why they agree with the CPU ops bit for bit). The CUDA build (cache_cuda.cu) and the
// warp-emulator build (csrc/emulated/emu_ops.cpp) include this once.
#pragma once

#include "kernels/dedup.cuh"
#include "kernels/lookup.cuh"
#include "kernels/rows.cuh"
#include "kernels/stage.cuh"
#include "kernels/update.cuh"
