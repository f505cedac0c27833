"""The command line: documented flags, env vars, one clear line for a bad setting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxy.settings import Settings

from ...support.servers import ROOT


def run(*args, env=None, timeout=30):
    import os

    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_documents_every_setting():
    out = run("serve", "--help").stdout
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
        assert "PHASEWATCH_" + name.upper() in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--upstream", "localhost:8000"],
            "--upstream: upstream 'localhost:8000' is not an http(s)://host[:port][/base-path] URL",
        ),
        (["--upstream", "http://a:1", "--max-concurrency", "-1"], "--max-concurrency"),
        (["--upstream", "http://a:99999"], "bad port"),
        (["--upstream", "http://a:1", "--port", "x"], "--port"),
        (["--upstream", "http://a:1", "--precision", "nopair"], "name=value"),
        ([], "no upstream"),
    ],
)
def test_bad_setting_is_one_clear_line(args, needle):
    res = run("serve", *args)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("phasewatch: error:")
    assert needle in lines[0]
    assert "Traceback" not in res.stderr


def test_env_vars_and_flags():
    s = Settings(_env_file=None)
    assert s.upstream == []
    import os

    old = dict(os.environ)
    try:
        os.environ["PHASEWATCH_UPSTREAM"] = "a=http://127.0.0.1:1, b=http://127.0.0.1:2"
        os.environ["PHASEWATCH_MAX_CONCURRENCY"] = "4"
        s = Settings()
        assert [(u.name, u.url) for u in s.upstreams] == [
            ("a", "http://127.0.0.1:1"),
            ("b", "http://127.0.0.1:2"),
        ]
        assert s.max_concurrency == 4
        s = Settings(max_concurrency=8)  # a flag wins over the environment
        assert s.max_concurrency == 8
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_env_var_error_is_one_line():
    res = run(
        "serve", env={"PHASEWATCH_UPSTREAM": "http://127.0.0.1:1", "PHASEWATCH_READ_TIMEOUT": "-5"}
    )
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "--read-timeout" in res.stderr


def test_python_m_proxy_is_phasewatch():
    import shutil

    exe = shutil.which("phasewatch") or str(ROOT / ".venv" / "bin" / "phasewatch")
    a = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    b = run("--version").stdout
    assert a == b and a.startswith("phasewatch ")
