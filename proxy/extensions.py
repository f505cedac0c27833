"""The names of the extensions the layers offer each other beside ASGI and httpx, in one
place: each layer that offers one or takes one imports its name from here, so the layer
test sees every such link (a name spelled as a literal would hide it).

- :data:`WRITE` (ASGI scope, offered by the server, ``proxy.runtime.cycle``; taken by the
  relay, ``proxy.core.push``): the server's synchronous writer, a ``Writer``.
- :data:`GONE` (ASGI scope, offered by the server; taken by ``proxy.core.answer.Reply``):
  the hang-up hook, ``watch(callback)``.
- :data:`PUSH` (httpx response, offered by the lean transport, ``proxy.transport.lean``;
  taken by ``proxy.core.push``): installs a sink that takes the body as it is parsed.
"""

from __future__ import annotations

#: ASGI scope, offered by the server, taken by the relay: the answer's
#: :class:`~proxy.core.client_out.ClientOut` (replaces WRITE and GONE).
CLIENT_OUT = "phasewatch.client_out"
WRITE = "phasewatch.write"
GONE = "phasewatch.gone"
PUSH = "phasewatch.push"
