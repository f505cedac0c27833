"""The request path: access check, routing, admission, relay, the exchange's record.

One step of a request's life per module, in the order it lives them: ``relay`` (the
ASGI app walking it through, told its options at start-up in ``relay_options``),
``budget`` (its body), ``routing`` (its upstream or pool), ``refusals`` (an answer of the
proxy's own instead), ``admission`` (its place at the gate), ``upstream_call`` (sent,
failures mapped, retried while unsent), ``answer`` (the relay loop, the final send, the
client watched); ``exchange`` is what the recorder reads of it. Engines
are reached only through their Dialect (no engine is named here). Imports only downward
(the fleet, engines, transport, measure); never tools, services or the simulator.
"""

from __future__ import annotations

from .access import Access
from .exchange import Exchange
from .relay import Relay
from .relay_options import RelayOptions

__all__ = ["Access", "Exchange", "Relay", "RelayOptions"]
