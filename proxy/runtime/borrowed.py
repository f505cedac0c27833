"""What phasewatch borrows from uvicorn, and why, in one place.

uvicorn runs the server (sockets, signals, lifespan, graceful shutdown); each connection
is phasewatch's own protocol (:mod:`proxy.runtime.http1`), which uvicorn makes from
``Config.http`` and which parses with httptools' public API. What passes between them is
what :data:`BORROWED` lists, each with why; nothing of uvicorn's own protocols is used.
The server's graceful drain (:mod:`proxy.runtime.server`) hooks a few of ``Server``'s
methods, listed too. ``tests/e2e/wire/test_protocol_borrowed.py`` checks every name on the
installed uvicorn, on a real server, so that a release renaming one fails there, by name,
rather than unguarding the wire. ``pyproject.toml`` bounds uvicorn from the first release
that has them all (``Config.get_loop_factory``: 0.36).
"""

from __future__ import annotations

#: uvicorn's names the protocol uses, by the object that holds them, each with why.
BORROWED: dict[str, dict[str, str]] = {
    "Config": {
        "http": "a protocol class, made once per connection as cls(config=, server_state=, "
        "app_state=, _loop=)",
        "loaded": "whether load() ran (a protocol made outside uvicorn's server loads it)",
        "load": "wraps the application as configured (the ASGI interface, middleware)",
        "loaded_app": "the application each request's ASGI task calls",
        "root_path": "--root-path: prefixed to each request's path and raw_path",
        "timeout_keep_alive": "--timeout-keep-alive: how long an idle connection stays",
    },
    "ServerState": {
        "connections": "the open connections: the protocol adds itself, and on shutdown "
        "uvicorn waits for the set to empty",
        "tasks": "the requests' ASGI tasks: on shutdown uvicorn waits for (then cancels) them",
        "total_requests": "answers served, for --limit-max-requests",
        "default_headers": "the headers every answer starts with (server, date, --header)",
    },
    "protocol": {
        "shutdown": "called by uvicorn on each connection at shutdown: close when idle, "
        "else after the answer under way",
    },
    "Server": {
        "serve": "runs the server on sockets bound before it starts (sockets=)",
        "startup": "extended: the heap settles and the start-up line goes out once it listens",
        "handle_exit": "extended: the first signal starts the drain, the second exits",
        "on_tick": "extended: the drain ends once nothing is in flight, or at the grace",
        "capture_signals": "replaced for a server beside the main one (the metrics address)",
        "should_exit": "set to stop the server",
        "started": "whether it listens (tests, the demo)",
        "get_loop_factory": "on Config: the loop uvicorn would pick (uvloop when installed)",
    },
    "logging": {
        "uvicorn.error": "the logger an application's failure and a parser's 400 are told "
        "on, as under uvicorn's own protocols",
    },
}
