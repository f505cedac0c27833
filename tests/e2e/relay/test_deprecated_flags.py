"""The settings kept for one more release without effect (proxy.settings.model.DEPRECATED):
``--handoff`` / ``--no-handoff`` (``PHASEWATCH_HANDOFF``) and ``--upstream-client lean``
(``PHASEWATCH_UPSTREAM_CLIENT``). A proxy started with any of them serves the same
deterministic stream as one started without, and says once at start that the setting does
nothing; a proxy started with none says nothing of the kind."""

from __future__ import annotations

import httpx

from proxy.settings.model import DEPRECATED

from ...support.servers import start_proxy

BODY = {
    "model": "RedHatAI/Llama-3.1-8B-Instruct-FP8",
    "messages": [{"role": "user", "content": "count to five"}],
    "max_tokens": 12,
    "stream": True,
    "seed": 7,
}


def _events(url: str) -> list[str]:
    """The stream's data lines, less what differs between two answers (id, created)."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=30) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    out = []
    for line in lines:
        if line == "data: [DONE]":
            out.append(line)
            continue
        event = httpx.Response(200, content=line[6:]).json()
        event.pop("id", None)
        event.pop("created", None)
        out.append(repr(event))
    return out


def test_deprecated_settings_are_accepted_and_change_nothing(proxy, sim):
    plain = _events(proxy.url)
    assert plain and plain[-1] == "data: [DONE]"
    assert not any(notice in proxy.log() for notice in DEPRECATED.values())
    for args, env, name in (
        (["--no-handoff"], None, "handoff"),
        (["--handoff"], None, "handoff"),
        (None, {"PHASEWATCH_HANDOFF": "false"}, "handoff"),
        (["--upstream-client", "lean"], None, "upstream_client"),
        (None, {"PHASEWATCH_UPSTREAM_CLIENT": "lean"}, "upstream_client"),
    ):
        flagged = start_proxy(f"sim={sim.url}", args=args, env=env)
        try:
            assert _events(flagged.url) == plain, (args, env)
        finally:
            flagged.stop()
        log = flagged.log()
        assert log.count(DEPRECATED[name]) == 1, (args, env, log)
        assert sum(log.count(notice) for notice in DEPRECATED.values()) == 1, (args, env, log)
