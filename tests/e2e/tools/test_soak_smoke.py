"""The load/soak script runs briefly in CI: every byte of 200 concurrent streams checked."""

import re
import subprocess
import sys

from ...support.servers import ROOT


def test_soak_smoke():
    res = subprocess.run(
        [sys.executable, "tests/bench/soak.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(
        r"200 concurrent streams x 16 tokens through phasewatch: 0 lost, 0 corrupted", res.stdout
    )
    m = re.search(r"proxy RSS start (\d+) MiB, max (\d+) MiB", res.stdout)
    assert m and int(m.group(2)) < 200, res.stdout
    assert "stalled readers: 20 clients" in res.stdout
