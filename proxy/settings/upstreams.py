"""The upstreams a settings object names, parsed once into :class:`UpstreamSpec` objects:
their names, engines, keys, TLS files (checked readable here, at start-up) and weights."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ..engines import ENGINES
from ..fleet.upstream import UpstreamSpec
from ..transport import TLSOptions
from .checks import own_address, parse_upstream, readable_files

if TYPE_CHECKING:
    from .model import Settings


def upstream_specs(s: Settings) -> tuple[list[UpstreamSpec], list[str]]:
    """Every ``--upstream`` as a spec, with the notes for the start-up log (a corrected
    URL); raises ValueError naming the flag on anything that does not hold together."""
    keys = dict(k.get_secret_value().split("=", 1) for k in s.upstream_key)
    engines = dict(item.split("=", 1) for item in s.engine if "=" in item)
    bare = [item for item in s.engine if "=" not in item]
    specs = []
    notes = []
    for spec in s.upstream:
        name, url, note = parse_upstream(spec)
        if note:
            notes.append(note)
        if name is None:
            parts = urlsplit(url)
            name = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        specs.append(UpstreamSpec(name, url, engine=engines.get(name), api_key=keys.get(name)))
    if bare:
        if len(bare) > 1 or len(specs) != 1:
            raise ValueError(
                f"--engine {bare[0]} (without NAME=) is for a single upstream; with "
                f"{len(specs)} upstreams, give NAME={bare[0]} for each"
                + (f" (upstreams: {', '.join(s.name for s in specs)})" if specs else "")
            )
        engines[specs[0].name] = bare[0]
        specs[0] = replace(specs[0], engine=bare[0])
    names = {s.name for s in specs}
    specs = _with_tls(s, specs, names)
    specs = _with_weights(s, specs, names)
    for name, engine in engines.items():
        if engine not in ENGINES:
            raise ValueError(
                f"--engine: {engine!r} is not an engine phasewatch knows "
                f"({', '.join(sorted(ENGINES))})"
            )
        if specs and name not in names:
            raise ValueError(
                f"--engine: no upstream is named {name!r} (upstreams: {', '.join(sorted(names))})"
            )
    for name in keys:
        if specs and name not in names:
            raise ValueError(
                f"--upstream-key: no upstream is named {name!r} (upstreams: "
                f"{', '.join(sorted(names))})"
            )
    for each in specs:
        if own_address(each.url, s.host, s.port):
            raise ValueError(
                f"--upstream {each.url} is this proxy's own address (it listens on "
                f"{s.host} port {s.port}): every request would come back to it, a loop. "
                "Give the engine's address"
            )
    return specs, notes


def _with_tls(s: Settings, specs: list[UpstreamSpec], names: set[str]) -> list[UpstreamSpec]:
    """Each upstream's TLS options (its own file, else the one for every upstream)."""
    ca = readable_files("--upstream-ca", s.upstream_ca, names)
    cert = readable_files("--upstream-cert", s.upstream_cert, names)
    key = readable_files("--upstream-key-file", s.upstream_key_file, names)
    for name in s.upstream_insecure:
        if name != "*" and specs and name not in names:
            raise ValueError(
                f"--upstream-insecure: no upstream is named {name!r} (upstreams: "
                f"{', '.join(sorted(names))})"
            )
    out = []
    for spec in specs:
        tls = TLSOptions(
            ca=ca.get(spec.name, ca.get(None)),
            cert=cert.get(spec.name, cert.get(None)),
            key=key.get(spec.name, key.get(None)),
            insecure="*" in s.upstream_insecure or spec.name in s.upstream_insecure,
        )
        if tls.key and not tls.cert:
            raise ValueError(f"--upstream-key-file: upstream {spec.name} has no --upstream-cert")
        if tls != TLSOptions():
            tls.context()  # a bad file stops start-up here, with its reason
            spec = replace(spec, tls=tls)
        out.append(spec)
    return out


def _with_weights(s: Settings, specs: list[UpstreamSpec], names: set[str]) -> list[UpstreamSpec]:
    weights: dict[str, float] = {}
    for item in s.upstream_weight:
        name, _, text = item.partition("=")
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not name or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"--upstream-weight: {item[:80]!r} is not name=W with W > 0")
        if specs and name not in names:
            raise ValueError(
                f"--upstream-weight: no upstream is named {name!r} (upstreams: "
                f"{', '.join(sorted(names))})"
            )
        weights[name] = weight
    return [replace(s, weight=weights[s.name]) if s.name in weights else s for s in specs]
