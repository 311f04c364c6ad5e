"""Every ```python block of README.md runs as written, in a fresh interpreter in an empty
directory: what a newcomer copies must work. The README stays short enough to read whole."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    """The contents of the ```python fenced blocks of a Markdown text, in order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_readme_has_python_blocks():
    assert python_blocks(README.read_text()), "README.md has no ```python block"


def test_readme_is_under_1500_words():
    words = len(README.read_text().split())
    assert words < 1500, f"README.md has {words} words: move detail to docs/"


def test_block_extraction():
    text = "x\n```python\nprint(1)\n```\n```bash\nls\n```\n```python\nprint(2)\n```\n"
    assert python_blocks(text) == ["print(1)\n", "print(2)\n"]


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_python_block_runs(index: int, tmp_path: Path):
    code = python_blocks(README.read_text())[index]
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"README.md python block {index + 1} exited with {done.returncode}\n"
        f"--- code ---\n{code}\n--- stderr ---\n{done.stderr}"
    )
