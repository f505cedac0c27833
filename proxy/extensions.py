"""The names of the extensions the layers offer each other beside ASGI and httpx, in one
place: each layer that offers one or takes one imports its name from here, so the layer
test sees every such link (a name spelled as a literal would hide it).

- :data:`CLIENT_OUT` (ASGI scope, offered by the server, ``proxy.runtime.cycle``; taken by
  the relay, ``proxy.core.answer``): the answer's
  :class:`~proxy.core.client_out.ClientOut`.
- :data:`RELAY` (httpx response, offered by the lean transport, ``proxy.transport.lean``;
  taken by ``proxy.core.pipe``): ``relay(read, end)`` hands the body to callbacks as it
  is parsed and returns ``hold(paused)`` (:meth:`proxy.transport.connection.Connection.relay`).
"""

from __future__ import annotations

CLIENT_OUT = "phasewatch.client_out"
RELAY = "phasewatch.relay"
