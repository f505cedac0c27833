"""Keys from files and keyed reading, through the real command line.

``serve`` reads keys from a file, one a line, as secrets are mounted in containers and
Kubernetes (``--api-key-file``, ``PHASEWATCH_API_KEY_FILE``, ``--api-key @FILE``); a
``--api-key`` value that names a file is refused at start, never taken for the key.
``report`` and ``advise`` read a keyed phasewatch with the one key option ``bench`` has
too, say what to do on a 401 (never httpx's text), take a key in the URL without printing
it, and say so when ``--from`` names an engine or a client's ``/v1``, not a phasewatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from ...support.servers import ROOT, sample, start_proxy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BARE = "file-bare-key-3141"
NAMED = "file-named-key-2718"
FLAG_KEY = "flag-key-1618"


def run(*args, env=None, timeout=60, cwd=ROOT):
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("PHASEWATCH_API_KEY", "OPENAI_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def error_line(res: subprocess.CompletedProcess) -> str:
    """The one error line of a refused start."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("phasewatch: error:")]
    assert len(errors) == 1 and res.stderr.rstrip().endswith(errors[0]), res.stderr
    return errors[0]


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secrets") / "keys.txt"
    # the form a mounted secret takes: a comment, a blank line, a trailing newline
    path.write_text(f"# phasewatch keys\n{BARE}\n\nteam-a={NAMED}\n")
    return path


def status(url: str, key: str) -> int:
    return httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}).status_code


# --- serve: keys from a file -----------------------------------------------------------------


@pytest.mark.parametrize("form", ["relative", "absolute", "named", "missing-relative"])
def test_a_key_that_names_a_file_is_refused_at_start(sim, key_file, form):
    value = {
        "relative": "./keys.txt",
        "absolute": str(key_file),
        "named": f"team-a={key_file}",
        "missing-relative": "./no-such-keys.txt",
    }[form]
    res = run(
        "serve", "--upstream", sim.url, "--port", "0", "--api-key", value, cwd=key_file.parent
    )
    line = error_line(res)
    assert "--api-key" in line and "names a file" in line and "--api-key-file FILE" in line, line
    assert "keys.txt" not in res.stderr  # the value is not shown: it might be a key after all


def test_the_variable_naming_a_file_is_refused_too(sim, key_file):
    res = run(
        "serve", "--upstream", sim.url, "--port", "0", env={"PHASEWATCH_API_KEY": str(key_file)}
    )
    line = error_line(res)
    assert "PHASEWATCH_API_KEY" in line and "names a file" in line, line


def test_an_empty_key_file_is_refused(sim, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    line = error_line(
        run("serve", "--upstream", sim.url, "--port", "0", "--api-key-file", str(empty))
    )
    assert "--api-key-file" in line and "holds no key" in line, line
    line = error_line(
        run("serve", "--upstream", sim.url, "--port", "0", "--api-key-file", str(tmp_path / "x"))
    )
    assert "--api-key-file" in line and "is not a file" in line, line


@pytest.mark.parametrize("how", ["flag", "variable", "at"])
def test_every_key_of_a_key_file_opens_the_proxy_and_its_path_does_not(sim, key_file, how):
    args, env = ["--api-key", FLAG_KEY], None
    if how == "flag":
        args += ["--api-key-file", str(key_file)]
    elif how == "variable":
        env = {"PHASEWATCH_API_KEY_FILE": str(key_file)}
    else:
        args += ["--api-key", f"@{key_file}"]
    proxy = start_proxy(f"sim={sim.url}", args=args, env=env)
    try:
        for key in (BARE, NAMED, FLAG_KEY):
            assert status(proxy.url, key) == 200, key
        for not_key in (str(key_file), f"@{key_file}", f"team-a={NAMED}", "wrong"):
            assert status(proxy.url, not_key) == 401, not_key
        # the named line names its client, as a named --api-key does
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        headers = {"authorization": f"Bearer {NAMED}"}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        s = metric_samples_keyed(proxy.url, BARE)
        assert sample(s, "phasewatch_requests_total", client="team-a", outcome="ok") == 1
        log = proxy.log()
        assert not any(k in log for k in (BARE, NAMED, FLAG_KEY)), "a key reached the log"
        assert "PHASEWATCH_API_KEY_FILE" not in log  # a setting now, no near-miss
    finally:
        proxy.stop()


def metric_samples_keyed(url: str, key: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# --- report and advise on a keyed phasewatch ---------------------------------------------------


@pytest.fixture(scope="module")
def keyed(sim, key_file):
    proxy = start_proxy(f"sim={sim.url}", args=["--api-key-file", str(key_file)])
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "alpha beta gamma"}],
        "max_tokens": 8,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {BARE}"}
    for _ in range(3):
        with httpx.stream(
            "POST", proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                pass
    yield proxy
    proxy.stop()


def _requests(keyed_url: str) -> float:
    return sample(metric_samples_keyed(keyed_url, BARE), "phasewatch_requests_total", model=MODEL)


@pytest.mark.parametrize("command", ["report", "advise"])
def test_without_a_key_the_reader_says_which_option_takes_it(keyed, command):
    res = run(command, "--from", keyed.url)
    assert res.returncode == 1, res.stdout
    err = res.stderr.strip()
    assert "this phasewatch needs a key: --api-key or PHASEWATCH_API_KEY" in err, err
    assert "mozilla" not in err.lower() and "Traceback" not in err and "\n" not in err
    res = run(command, "--from", keyed.url, "--api-key", "wrong-key")
    assert res.returncode == 1 and "the key given was refused (HTTP 401" in res.stderr, res.stderr
    assert "mozilla" not in res.stderr.lower()


@pytest.mark.parametrize(
    "how", ["flag", "at-file", "key-file", "variable", "variable-file", "in-url"]
)
def test_report_reads_a_keyed_phasewatch_every_way_and_never_prints_the_key(keyed, key_file, how):
    url, args, env = keyed.url, [], None
    if how == "flag":
        args = ["--api-key", NAMED]
    elif how == "at-file":
        args = ["--api-key", f"@{key_file}"]
    elif how == "key-file":
        args = ["--api-key-file", str(key_file)]
    elif how == "variable":
        env = {"PHASEWATCH_API_KEY": f"team-a={NAMED}"}  # serve's form: the KEY is sent
    elif how == "variable-file":
        env = {"PHASEWATCH_API_KEY_FILE": str(key_file)}
    else:
        url = keyed.url.replace("http://", f"http://any:{BARE}@")
    res = run("report", "--from", url, "--format", "json", *args, env=env)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    (row,) = [r for r in rep["rows"] if r["model"] == MODEL]
    assert row["requests"] == _requests(keyed.url) >= 3
    assert rep["source"] == keyed.url  # the URL as given, less its key
    out = res.stdout + res.stderr
    assert BARE not in out and NAMED not in out


def test_advise_and_bench_refuse_a_key_that_names_a_file(keyed, key_file):
    for command, flag in (("advise", "--from"), ("report", "--from"), ("bench", "--url")):
        res = run(command, flag, keyed.url, "--api-key", str(key_file))
        assert res.returncode in (1, 2), (command, res.stdout)
        assert "--api-key: the value names a file" in res.stderr, (command, res.stderr)
        assert "--api-key-file FILE" in res.stderr


@pytest.mark.parametrize("command", ["report", "advise"])
def test_an_engine_or_a_v1_url_is_not_a_phasewatch(sim, keyed, command):
    res = run(command, "--from", sim.url)
    assert res.returncode == 1
    assert "this is not a phasewatch" in res.stderr and "vLLM's own metrics" in res.stderr
    assert "No measured requests" not in res.stdout
    res = run(command, "--from", keyed.url + "/v1", "--api-key", BARE)
    assert res.returncode == 1
    assert f"give phasewatch's own, {keyed.url}" in res.stderr, res.stderr
    assert "404" not in res.stderr
    res = run(command, "--from", keyed.url + "/metrics", "--api-key", BARE)
    assert res.returncode == 0, res.stderr


def test_bench_reads_the_same_key_option(keyed, key_file):
    """bench takes the one key option report and advise take: a key file, here."""
    args = [
        "bench",
        "--url",
        keyed.url,
        "--model",
        MODEL,
        "--repeat",
        "1",
        "--prompt-tokens",
        "64",
        "--concurrency",
        "",
        "--decode-tokens",
        "8",
        "--idle-seconds",
        "0",
        "--json",
        "--quiet",
    ]
    before = _requests(keyed.url)
    res = run(*args, "--api-key-file", str(key_file), timeout=120)
    assert res.returncode == 0, res.stderr
    (model,) = json.loads(res.stdout)["models"]
    assert model["model"] == MODEL
    assert _requests(keyed.url) > before  # its requests went through the keyed proxy
    assert BARE not in res.stdout + res.stderr
    res = run(*args, timeout=120)
    assert res.returncode == 1 and "401" in res.stderr, res.stderr
