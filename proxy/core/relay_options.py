"""What the relay is told at start-up, as one object (the settings' relay section): each
option reaches the step of a request's life that uses it without a chain of arguments."""

from __future__ import annotations

from dataclasses import dataclass

from ..engines.framing import MAX_EVENT_BYTES
from .coding import MAX_DECODED


@dataclass(frozen=True, slots=True)
class RelayOptions:
    #: Ask a streaming engine for usage the client did not ask for (and strip it again).
    inject_usage: bool = True
    #: Largest request body accepted (413 beyond).
    max_body_bytes: int = 64 * 1024 * 1024
    #: Request bodies held at once, over every request of this process (None: 4 bodies).
    max_body_memory: int | None = None
    #: Seconds a request body may stall (no byte arriving) before a 408.
    body_timeout: float = 30.0
    #: Largest stream event held for measurement; larger ones pass through unmeasured.
    max_event_bytes: int = MAX_EVENT_BYTES
    #: Most bytes a coded stream is decoded to (measured no further beyond).
    max_decoded_bytes: int = MAX_DECODED
    #: Return the request id in an x-request-id response header (measured requests).
    echo_request_id: bool = False
    #: The engines' model-management endpoints: allow, deny or keyed.
    admin_api: str = "allow"
