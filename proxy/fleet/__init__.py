"""The fleet: the upstream engines a request can go to, apart from the request path.

``upstream`` (one engine: its dialect, models, precision, KV shapes, health and
admission ``gate``), ``upstreams`` (all of them: routing by model, the background refresh,
health and follow loops), ``pool`` and ``balance`` (which member of a pool takes a
request), ``bridge`` (one upstream's load under the gauge names vLLM exports), ``host``
(what the worker processes of one host share) and ``supervisor`` (background loops that
outlive their bugs). Imports only downward (engines, transport, measure); the request
path (proxy.core) uses it, never the other way.
"""

from __future__ import annotations

from .gate import AdmissionGate, QueueFull, QueueTimeout
from .upstream import OTHER, UNKNOWN, Upstream, UpstreamOptions, UpstreamSpec
from .upstreams import Upstreams

__all__ = [
    "OTHER",
    "UNKNOWN",
    "AdmissionGate",
    "QueueFull",
    "QueueTimeout",
    "Upstream",
    "UpstreamOptions",
    "UpstreamSpec",
    "Upstreams",
]
