"""The data path: access check, routing, admission gate, relay, the exchange's record.

Imports only downward (engines, transport, measure); never tools, services or the
simulator.
"""

from __future__ import annotations

from .access import Access
from .exchange import Exchange
from .gate import AdmissionGate, QueueFull, QueueTimeout
from .relay import Relay
from .upstreams import OTHER, UNKNOWN, Upstream, UpstreamOptions, Upstreams, UpstreamSpec

__all__ = [
    "OTHER",
    "UNKNOWN",
    "Access",
    "AdmissionGate",
    "Exchange",
    "QueueFull",
    "QueueTimeout",
    "Relay",
    "Upstream",
    "UpstreamOptions",
    "UpstreamSpec",
    "Upstreams",
]
