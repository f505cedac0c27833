"""What phasewatch borrows from uvicorn, and why, in one place.

phasewatch's connection guards (:mod:`proxy.runtime.protocol`, and how its connections
end: :mod:`proxy.runtime.ending`) sit inside uvicorn's
connection handling, which has no public extension point, so that module subclasses
``HttpToolsProtocol`` and uses
what :data:`BORROWED` lists: its parser callbacks and ``data_received`` pieces (the
parser, ``_unset_keepalive_if_required``, ``send_400_response``; and, to keep one
keep-alive timer a connection rather than one an answer, ``on_response_complete``'s steps:
``_start_asgi_task``, ``timeout_keep_alive``, ``timeout_keep_alive_task``,
``timeout_keep_alive_handler``, ``server_state``), its per-connection state
(``cycle``: the last parsed request; ``pipeline``: the queued ones; ``flow``: read
pausing), the upgrade hooks it is told not to follow (``_should_upgrade``,
``_unsupported_upgrade_warning``), and a cycle's state (``keep_alive``, ``more_body``,
``response_started``, ``response_complete``, ``disconnected``, ``message_event``; and for
the direct writer and the hang-up hook, :mod:`proxy.runtime.direct`, its ``flow`` (and
``resume_reading``), ``transport``, ``scope`` and ``chunked_encoding``, and room on it
for an attribute of phasewatch's own). These
are private and change between uvicorn releases: ``pyproject.toml`` bounds uvicorn to the
minor versions the hostile-wire tests pass on, and ``tests/e2e/wire/test_protocol_borrowed.py``
fails loudly when one of them is gone.
"""

from __future__ import annotations

#: What proxy.runtime.protocol uses of uvicorn's private protocol and request cycle.
BORROWED: dict[str, tuple[str, ...]] = {
    "HttpToolsProtocol": (
        "connection_made",
        "connection_lost",
        "data_received",
        "eof_received",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
        "pause_writing",
        "resume_writing",
        "send_400_response",
        "_should_upgrade",
        "_unsupported_upgrade_warning",
        "_unset_keepalive_if_required",
        "_start_asgi_task",
        "timeout_keep_alive_handler",
    ),
    "protocol state": (
        "parser",
        "cycle",
        "pipeline",
        "flow",
        "transport",
        "scope",
        "headers",
        "client",
        "loop",
        "logger",
        "server_state",
        "timeout_keep_alive",
        "timeout_keep_alive_task",
    ),
    "RequestResponseCycle": (
        "keep_alive",
        "more_body",
        "response_started",
        "response_complete",
        "disconnected",
        "message_event",
        "flow",
        "transport",
        "scope",
        "chunked_encoding",
    ),
    "FlowControl": ("read_paused", "write_paused", "resume_reading"),
}
