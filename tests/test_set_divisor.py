"""The cache's set hash divides by a table's set count with a multiply and shifts
(csrc/include/embcache/rowquant.h, SetDivisor): its remainders equal Python's exact ``x % d``
for divisors and 64-bit hashes chosen to hit every branch and edge (powers of two and their
neighbours, the largest values, multiples of d and their neighbours) and for fresh random ones."""

import random
import shutil
import subprocess
from pathlib import Path

import pytest

INCLUDE = Path(__file__).resolve().parents[1] / "csrc" / "include"
CXX = shutil.which("c++") or shutil.which("g++")
U64 = 2**64 - 1

PROGRAM = r"""
#include <stdio.h>
#include "embcache/rowquant.h"
// stdin: lines "d x"; stdout: x % d by SetDivisor
int main() {
  unsigned long long d, x;
  while (scanf("%llu %llu", &d, &x) == 2)
    printf("%llu\n", (unsigned long long)embcache::SetDivisor::of(d).rem(x));
}
"""


def divisors(rng: random.Random) -> list[int]:
    edges = set(range(1, 300))
    for k in range(1, 64):
        edges |= {2**k - 1, 2**k, 2**k + 1}
    edges |= {U64, U64 - 1, 2**31 - 1, 3 * 2**40 + 7}
    return sorted(
        edges
        | {rng.randrange(1, 2**31) for _ in range(300)}
        | {rng.randrange(1, 2**64) for _ in range(100)}
    )


def numerators(d: int, rng: random.Random) -> list[int]:
    xs = {0, 1, d - 1, d, d + 1, U64, U64 - 1, 2**63, 2**63 - 1, rng.randrange(2**64)}
    for _ in range(4):
        k = rng.randrange(1, U64 // d + 1)
        xs |= {k * d - 1, k * d, k * d + 1}
    return [x for x in xs if 0 <= x <= U64]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_set_divisor_remainders_equal_exact_modulo(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    source, exe = tmp_path / "rem.cpp", tmp_path / "rem"
    source.write_text(PROGRAM)
    subprocess.run(
        [CXX, "-std=c++20", "-O2", f"-I{INCLUDE}", str(source), "-o", str(exe)], check=True
    )
    pairs = [(d, x) for d in divisors(rng) for x in numerators(d, rng)]
    out = subprocess.run(
        [str(exe)],
        input="".join(f"{d} {x}\n" for d, x in pairs),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(out) == len(pairs)
    wrong = [(d, x, int(r)) for (d, x), r in zip(pairs, out) if int(r) != x % d]
    assert not wrong, f"seed {seed}: {len(wrong)} of {len(pairs)} wrong, e.g. {wrong[:3]}"
