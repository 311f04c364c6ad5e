"""setup.py refuses, before compiling anything, a C++ compiler that links libstdc++ statically
into shared libraries: an extension built so carries its own libstdc++, whose streams crash in
torch's process at the first error message with a number in it (found on a GPU machine whose
$CXX is such a wrapper)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++")


def _version_with(cxx: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CXX": str(cxx)}
    return subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _wrapper(tmp_path: Path, extra: str) -> Path:
    script = tmp_path / "g++"
    script.write_text(f'#!/bin/sh\nexec {CXX} "$@" {extra}\n')
    script.chmod(0o755)
    return script


@pytest.mark.skipif(CXX is None, reason="no C++ compiler here")
def test_a_compiler_linking_libstdcxx_statically_is_refused(tmp_path):
    done = _version_with(_wrapper(tmp_path, "-static-libstdc++"))
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert str(tmp_path / "g++") in line and "links libstdc++ statically" in line


@pytest.mark.skipif(CXX is None, reason="no C++ compiler here")
def test_a_compiler_linking_it_dynamically_is_taken(tmp_path):
    done = _version_with(_wrapper(tmp_path, ""))
    assert done.returncode == 0, done.stderr
    assert "statically" not in done.stderr
