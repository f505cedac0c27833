"""Proxy settings: one model, filled from flags and ``PHASEWATCH_*`` variables, parsed once
into the typed sections the rest of the proxy takes.

The command line (proxy.tools.cli) builds its flags from the model's fields, so a setting
exists once, with one description, used for both ``--help`` and the README's table. Lists
arrive as strings (``name=value`` pairs, URLs); they are checked and split here, once, and
nothing downstream splits a string again. An empty variable counts as unset.

- ``model``: the fields and their validation (:class:`Settings`);
- ``checks``: what a value may be (upstream URLs, variable names and near-misses, named
  keys, readable files), checked at start-up;
- ``upstreams``: the ``--upstream`` flags as :class:`~proxy.fleet.upstream.UpstreamSpec`
  objects (names, engines, keys, TLS, weights);
- ``views``: the sections, one object per consumer (the relay's
  :class:`~proxy.core.relay_options.RelayOptions`, the server's :class:`ServerLimits`,
  :class:`~proxy.fleet.upstream.UpstreamOptions`, :class:`~proxy.services.power.PowerOptions`).
"""

from .checks import ENV_ALIASES, ENV_PREFIX, parse_upstream, split_named_key
from .model import Settings

__all__ = ["ENV_ALIASES", "ENV_PREFIX", "Settings", "parse_upstream", "split_named_key"]
