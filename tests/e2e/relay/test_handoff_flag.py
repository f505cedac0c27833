"""``--handoff`` / ``--no-handoff`` (and ``PHASEWATCH_HANDOFF``): accepted for one more
release and without effect. A proxy started with either spelling serves the same
deterministic stream, byte for byte, as one started without it, and says once at start
that the flag does nothing; a proxy started without it says nothing of the kind."""

from __future__ import annotations

import httpx

from proxy.settings.model import DEPRECATED_HANDOFF

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


def test_handoff_flag_is_accepted_and_changes_nothing(proxy, sim):
    plain = _events(proxy.url)
    assert plain and plain[-1] == "data: [DONE]"
    assert DEPRECATED_HANDOFF not in proxy.log()
    for args, env in (
        (["--no-handoff"], None),
        (["--handoff"], None),
        (None, {"PHASEWATCH_HANDOFF": "false"}),
    ):
        flagged = start_proxy(f"sim={sim.url}", args=args, env=env)
        try:
            assert _events(flagged.url) == plain, (args, env)
        finally:
            flagged.stop()
        assert flagged.log().count(DEPRECATED_HANDOFF) == 1, (args, env, flagged.log())
