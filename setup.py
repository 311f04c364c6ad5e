"""Builds the C++ kernels in csrc/ as torch extensions:

* `embcache._C`: the CPU kernels (ops under torch.ops.embcache) and, when torch has CUDA and
  nvcc is found, the CUDA kernels of csrc/cuda registered for CUDA tensors under the same ops;
* `embcache._cuda_emu`: the CUDA kernels compiled as C++ on the warp emulator
  (torch.ops.embcache_emu, CPU tensors), so that the tests run the kernel code without a GPU.
  Set EMBCACHE_NO_EMULATOR=1 to skip it.
"""

import os
import platform
import re
import shlex
import subprocess
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = [os.path.join(ROOT, "csrc", "include")]
# No FMA contraction: row arithmetic must round exactly as the reference does.
# -fno-trapping-math changes no value (it lets selects on floats vectorize; FP exception
# flags are never read here).
# -fno-finite-loops: C++ lets the compiler assume every loop ends and has an effect, and GCC
# then deletes loops that only issue prefetches (__builtin_prefetch is not an effect to it),
# which would take every prefetch out of the lookup and most out of the update.
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-finite-loops"]
# sm_80 and sm_90 binaries, and sm_90 PTX for newer GPUs (JIT-compiled by the driver).
NVCC_FLAGS = [
    "-O3",
    "--fmad=false",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
]


def _simd_flags():
    """SSE4.1 turns floorf/rintf into single instructions (same IEEE results) and enables
    the SIMD Philox of embcache/random_stream.h on x86-64; SSE4.2 adds the int64 compare that
    vectorizes the index and offset checks (every x86-64 CPU since 2008 has both)."""
    return ["-msse4.2"] if platform.machine() in ("x86_64", "AMD64") else []


def _with_cuda() -> bool:
    """CUDA kernels are built when torch is a CUDA build and nvcc is available."""
    return (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("EMBCACHE_NO_CUDA") != "1"
    )


def _check_cxx() -> None:
    """Refuses, in one line, a C++ compiler that links libstdc++ statically into shared
    libraries (a wrapper adding -static-libstdc++, as one CUDA image's $CXX does): the extension
    then carries its own copy of libstdc++, whose streams crash in torch's process the first
    time they format a number, i.e. at the first error message with an index in it."""
    cxx = os.environ.get("CXX", "c++")
    named_by = "$CXX" if "CXX" in os.environ else "the default"
    dry_run = [*shlex.split(cxx), "-shared", "-###", "-x", "c++", os.devnull, "-o", os.devnull]
    try:
        done = subprocess.run(dry_run, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return  # no such compiler: the build itself says so
    if re.search(r'-Bstatic\s+"?-lstdc\+\+', done.stderr):
        raise SystemExit(
            f"embcache: the C++ compiler {cxx!r} ({named_by}) links libstdc++ statically into shared "
            "libraries, and an extension built so crashes inside torch; set CXX (and CC) to one "
            "that links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc"
        )


def _main_extension():
    # each file of csrc/cpu is one phase (or the library's definition) and registers its ops
    sources = sorted(str(p.relative_to(ROOT)) for p in Path(ROOT, "csrc", "cpu").glob("*.cpp"))
    cxx = CXX_FLAGS + ["-fopenmp"] + _simd_flags()
    if not _with_cuda():
        return CppExtension(
            "embcache._C",
            sources,
            include_dirs=INCLUDE,
            extra_compile_args=cxx,
            extra_link_args=["-fopenmp"],
        )
    from torch.utils.cpp_extension import CUDAExtension

    return CUDAExtension(
        "embcache._C",
        sources + ["csrc/cuda/cache_cuda.cu", "csrc/cuda/binding.cpp"],
        include_dirs=INCLUDE,
        extra_compile_args={"cxx": cxx, "nvcc": NVCC_FLAGS},
        extra_link_args=["-fopenmp"],
    )


def _emulator_extension():
    return CppExtension(
        "embcache._cuda_emu",
        ["csrc/emulated/emu_ops.cpp"],
        include_dirs=INCLUDE,
        # EMBCACHE_PORTABLE: the header's portable code, the code the GPU runs (no SSE paths).
        extra_compile_args=["-O2", "-ffp-contract=off", "-pthread", "-DEMBCACHE_PORTABLE"]
        + _simd_flags(),
        extra_link_args=["-pthread"],
    )


_check_cxx()
extensions = [_main_extension()]
if os.environ.get("EMBCACHE_NO_EMULATOR") != "1":
    extensions.append(_emulator_extension())

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtension},
)
