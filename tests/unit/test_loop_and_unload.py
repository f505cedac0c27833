"""Where the proxy's own address is refused as its upstream (and where it is not), which
Via fields name it, and which Ollama ``keep_alive`` values unload a model: the small
decisions behind the fourth hostile pass's loop and admin fixes."""

from __future__ import annotations

import pytest

from proxy.core.headers import looped, via
from proxy.engines import unload_field
from proxy.settings import Settings
from proxy.settings.checks import own_address


@pytest.mark.parametrize(
    "url, host, port, own",
    [
        ("http://127.0.0.1:8090", "127.0.0.1", 8090, True),
        ("http://localhost:8090/v1", "127.0.0.1", 8090, True),
        ("http://127.0.0.2:8090", "0.0.0.0", 8090, True),
        ("http://[::1]:8090", "::", 8090, True),
        ("http://10.0.0.5:8090", "10.0.0.5", 8090, True),
        ("http://127.0.0.1:8000", "127.0.0.1", 8090, False),  # another port
        ("http://10.0.0.5:8090", "127.0.0.1", 8090, False),  # another host
        ("http://127.0.0.1:8090", "10.0.0.5", 8090, False),  # listening elsewhere
        ("https://127.0.0.1:8090", "127.0.0.1", 8090, False),  # the proxy serves http
        ("http://127.0.0.1:80", "127.0.0.1", 80, True),  # the default port
        ("http://127.0.0.1:0", "127.0.0.1", 0, False),  # a port chosen at start
    ],
)
def test_own_address(url, host, port, own):
    assert own_address(url, host, port) is own


def test_settings_refuse_the_proxys_own_address():
    with pytest.raises(ValueError, match="own address"):
        Settings(upstream=["http://127.0.0.1:8090"], port=8090)
    assert Settings(upstream=["http://127.0.0.1:8000"], port=8090).upstreams


def test_a_request_that_names_this_proxy_in_via_is_a_loop():
    name, mine = via("abc123")
    assert name == b"via" and mine == b"1.1 phasewatch-abc123"
    assert looped([(b"via", mine)], mine)
    assert looped([(b"via", b"1.1 nginx, " + mine + b", 1.1 other")], mine)
    assert not looped([(b"via", b"1.1 phasewatch-abc1234")], mine)  # another proxy
    assert not looped([(b"x-via", mine)], mine)
    assert not looped([], mine)


@pytest.mark.parametrize(
    "path, value, unloads",
    [
        ("/api/generate", 0, True),
        ("/api/chat", 0.0, True),
        ("/api/chat", "0", True),
        ("/api/generate", "0s", True),
        ("/api/generate", "0m", True),
        ("/api/embed", " 0ms ", True),
        ("/api/generate", -1, False),
        ("/api/generate", "5m", False),
        ("/api/generate", "0.5s", False),
        ("/api/generate", False, False),
        ("/api/generate", None, False),
        ("/api/generate", "zero", False),
        ("/v1/chat/completions", 0, False),  # not a field of that path
    ],
)
def test_which_keep_alive_unloads(path, value, unloads):
    got = unload_field(path, {"model": "m", "keep_alive": value})
    assert got == ("keep_alive" if unloads else None)
    assert unload_field(path, {"model": "m"}) is None
    assert unload_field(path, ["keep_alive", 0]) is None
