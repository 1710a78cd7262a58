""".ci/services.py installs the dashboard checks' programs where apt-get can, and never fails CI
(run here with a fake apt-get on PATH: nothing is installed for real)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "services.py"


def run(bin_: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": str(bin_)}  # none of prometheus, chromium, sudo, apt-get but the fakes
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def fake(bin_: Path, name: str, body: str) -> None:
    path = bin_ / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_without_apt_get_it_says_so_and_passes(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 0 and "no apt-get here" in done.stdout, done


def test_nothing_to_do_when_the_programs_are_there(tmp_path):
    fake(tmp_path, "prometheus", "exit 0")
    fake(tmp_path, "chromium", "exit 0")
    fake(tmp_path, "apt-get", f"echo called >> {tmp_path}/log; exit 1")
    done = run(tmp_path)
    assert done.returncode == 0 and "already installed" in done.stdout, done
    assert not (tmp_path / "log").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user it goes through sudo -n")
def test_installs_only_what_is_missing_and_a_failure_does_not_fail_ci(tmp_path):
    fake(tmp_path, "chromium", "exit 0")
    fake(tmp_path, "apt-get", f'echo "$@" >> {tmp_path}/log; exit 0')
    done = run(tmp_path)
    assert done.returncode == 0 and "installed ['prometheus']" in done.stdout, done
    calls = (tmp_path / "log").read_text().splitlines()
    assert calls[0].startswith("update") and calls[1].split()[-1] == "prometheus" and "install" in calls[1], calls
    fake(tmp_path, "apt-get", "echo 'E: Unable to locate package prometheus' >&2; exit 100")
    done = run(tmp_path)
    assert done.returncode == 0 and "exited 100" in done.stdout and "Unable to locate" in done.stdout, done
