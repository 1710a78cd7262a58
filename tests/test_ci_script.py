"""CI's script fails when the formatter or the linter does (before, `ruff format --check . && ruff
check .` under `set -e` let a format failure through: bash ignores a failure inside an `&&` list,
and CI ran the tests and exited 0 with README.md unformatted)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(folder: Path, name: str, status: int) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("failing", ["format", "check"])
def test_ci_fails_when_ruff_fails(tmp_path, failing):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _tool(bin_, "python", 0)  # pip install and pytest succeed
    ruff = bin_ / "ruff"
    ruff.write_text(f'#!/bin/sh\nif [ "$1" = "{failing}" ]; then exit 1; fi\nexit 0\n')
    ruff.chmod(ruff.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, timeout=60)
    assert done.returncode != 0, "CI passed although ruff failed"


def test_ci_passes_when_everything_passes(tmp_path):
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _tool(bin_, "python", 0)
    _tool(bin_, "ruff", 0)
    env = {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
