"""Builds the C++ kernels in csrc/ as the torch extension `embcache._C` (ops under torch.ops.embcache)."""
import os
import platform

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

def _simd_flags():
    """SSE4.1 turns floorf/rintf into single instructions (same IEEE results) on x86-64."""
    return ["-msse4.1"] if platform.machine() in ("x86_64", "AMD64") else []


setup(
    ext_modules=[
        CppExtension(
            "embcache._C",
            ["csrc/cpu/embcache_cpu.cpp"],
            include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "include")],
            # No FMA contraction: row arithmetic must round exactly as the reference does.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fopenmp"] + _simd_flags(),
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
