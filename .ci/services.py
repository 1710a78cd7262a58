"""CI: install the programs the slow checks use, where this machine can: Debian's `prometheus`
(tests/test_grafana_prometheus_ray.py, tests/test_grafana_dashboard.py's promtool check) and
`chromium` (realloc_tools/observe/screenshots.py). Tests that need one skip with a reason where it is missing.

Never fails CI: prints why it installed nothing (no apt-get, not root, apt-get failed) and exits 0.
Quick where the programs are already there: it looks them up on PATH first and runs nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

#: Debian package -> the program the checks look for.
PACKAGES = {"prometheus": "prometheus", "chromium": "chromium"}


def main() -> int:
    missing = [pkg for pkg, program in PACKAGES.items() if shutil.which(program) is None]
    if not missing:
        print(f"services: {', '.join(PACKAGES.values())} already installed")
        return 0
    if shutil.which("apt-get") is None:
        print(f"services: no apt-get here; {missing} not installed (their checks skip)")
        return 0
    prefix = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            print(f"services: not root and no sudo; {missing} not installed (their checks skip)")
            return 0
        prefix = ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # bounded: a mirror that does not answer costs CI at most 12 minutes, then the checks skip
    for command, timeout_s in (
        ([*prefix, "apt-get", "update", "-q"], 180),
        ([*prefix, "apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], 540),
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"services: {' '.join(command)} failed ({exc}); {missing} not installed (their checks skip)")
            return 0
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            print(f"services: {' '.join(command)} exited {done.returncode}: {tail}; their checks skip")
            return 0
    print(f"services: installed {missing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
