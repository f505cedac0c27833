"""Which replica of a pool takes a request: the balancing policy, on its own.

A pool is the upstreams that list one model. The policy sees each member as a
:class:`Load` (what phasewatch and the engine say about it right now) and orders the
members that are up: the first takes the request, the others are where a request that
could not be sent is tried next.

- ``least-loaded``: the least expected wait, ``(outstanding + 1 + waiting) x service /
  weight``, where *outstanding* is the larger of phasewatch's own in-flight and queued
  count and the engine's running and waiting gauges (other clients' traffic counts too),
  *waiting* the engine's own queue, and *service* the replica's measured seconds per
  request (an average that forgets; unmeasured replicas are taken as fast as the fastest
  measured one, so each is tried). A KV cache over 90 % full raises the figure (the engine
  is about to preempt).
- ``round-robin``: smooth weighted round robin (each member in proportion to its weight,
  interleaved).
- ``random``: weighted random.

``--affinity prefix`` puts requests whose prompts start alike on one replica (its prefix
cache keeps the shared part): a hash of the prompt's leading bytes, keyed with the
deployment's secret (``--affinity-secret``; a client that cannot compute the hash cannot
aim its prompts at one member), ranks the members by weighted rendezvous hashing (members
coming and going move only their own share). The request goes to the first in that
ranking that is under its bound: consistent hashing with bounded loads, the bound being
``BOUND_C`` x its weight's share of the pool's outstanding requests counting this one, so
one hot prefix fills its home to the bound and spills over to the next member, and no
member takes more than its bounded share from affinity.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["least-loaded", "round-robin", "random"]
Affinity = Literal["none", "prefix"]
POLICIES: tuple[str, ...] = ("least-loaded", "round-robin", "random")

#: Bounded loads: a member takes an affine request while its outstanding requests are
#: under BOUND_C x its weighted share of the pool's (this request counted), rounded up.
BOUND_C = 1.25
#: KV-cache use from which a member's expected wait grows (preemption is near).
KV_PRESSURE = 0.9


@dataclass(slots=True)
class Load:
    """One member as the policy sees it."""

    name: str
    weight: float = 1.0
    in_flight: int = 0  # phasewatch's own admitted requests, not finished
    queued: int = 0  # waiting at phasewatch's gate
    engine_running: float | None = None  # the engine's gauges, where it has them
    engine_waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    service_s: float | None = None  # measured seconds per request (None: not yet)


@dataclass(frozen=True, slots=True)
class BalanceOptions:
    balance: Policy = "least-loaded"
    affinity: Affinity = "none"
    #: Leading bytes of the prompt hashed for --affinity prefix.
    prefix_bytes: int = 512
    #: The prefix hash's key (--affinity-secret, else one made at start): replicas of
    #: phasewatch in front of one pool share it to send a prefix to the same member.
    affinity_secret: bytes = field(default=b"", repr=False)


def outstanding(m: Load) -> float:
    own = float(m.in_flight + m.queued)
    engine = (m.engine_running or 0.0) + (m.engine_waiting or 0.0)
    if m.engine_running is None and m.engine_waiting is None:
        return own
    return max(own, engine)


def expected_wait(m: Load, default_service: float) -> float:
    """The least-loaded figure: lower is better."""
    service = m.service_s if m.service_s is not None else default_service
    cost = (outstanding(m) + 1.0 + (m.engine_waiting or 0.0)) * service / max(m.weight, 1e-9)
    if m.kv_usage is not None and m.kv_usage > KV_PRESSURE:
        cost *= 1.0 + 10.0 * (m.kv_usage - KV_PRESSURE)
    return cost


@dataclass
class Balancer:
    """The policy with its little state (round-robin credits per pool)."""

    options: BalanceOptions = field(default_factory=BalanceOptions)
    rng: random.Random = field(default_factory=random.Random)
    _credit: dict[str, dict[str, float]] = field(default_factory=dict)

    def order(self, pool: str, members: list[Load], key: int | None = None) -> list[Load]:
        """`members` (those up) in the order to try them; `key` is the prompt's prefix
        hash with --affinity prefix (None: no affinity)."""
        if len(members) <= 1:
            return list(members)
        first = None
        if key is not None and self.options.affinity == "prefix":
            first = self._affine(members, key)
        if first is None:
            first = self._pick(pool, members)
        rest = sorted((m for m in members if m is not first), key=self._fallback_key(members))
        return [first, *rest]

    def _fallback_key(self, members: list[Load]):
        default = _default_service(members)
        return lambda m: expected_wait(m, default)

    def _pick(self, pool: str, members: list[Load]) -> Load:
        policy = self.options.balance
        if policy == "round-robin":
            return self._round_robin(pool, members)
        if policy == "random":
            return self.rng.choices(members, weights=[max(m.weight, 1e-9) for m in members])[0]
        default = _default_service(members)
        # ties (an idle pool) go round-robin, so an idle pool is not all on one member
        best = min(expected_wait(m, default) for m in members)
        tied = [m for m in members if expected_wait(m, default) <= best * (1 + 1e-9)]
        return tied[0] if len(tied) == 1 else self._round_robin(pool, tied)

    def _round_robin(self, pool: str, members: list[Load]) -> Load:
        """Smooth weighted round robin: every member earns its weight each turn, the
        richest is picked and pays the total."""
        credit = self._credit.setdefault(pool, {})
        if len(credit) > 4 * len(members) + 16:  # members that left: forget them
            names = {m.name for m in members}
            for name in [n for n in credit if n not in names]:
                del credit[name]
        total = 0.0
        for m in members:
            credit[m.name] = credit.get(m.name, 0.0) + m.weight
            total += m.weight
        best = max(members, key=lambda m: credit[m.name])
        credit[best.name] -= total
        return best

    def _affine(self, members: list[Load], key: int) -> Load | None:
        """The first member in the key's rendezvous ranking that is under its bound
        (consistent hashing with bounded loads); None when none is (not with BOUND_C >= 1:
        the bounds add up to more than the pool's load)."""
        total = sum(outstanding(m) for m in members) + 1.0  # this request counted
        weights = sum(max(m.weight, 1e-9) for m in members)
        ranked = sorted(members, key=lambda m: rendezvous(key, m.name, m.weight), reverse=True)
        for m in ranked:
            bound = math.ceil(BOUND_C * total * max(m.weight, 1e-9) / weights)
            if outstanding(m) < bound:
                return m
        return None


def _default_service(members: list[Load]) -> float:
    known = [m.service_s for m in members if m.service_s is not None]
    return min(known) if known else 1.0


def rendezvous(key: int, name: str, weight: float) -> float:
    """Weighted rendezvous score of `name` for `key` (highest wins)."""
    h = hashlib.blake2b(f"{key}:{name}".encode(), digest_size=8).digest()
    unit = (int.from_bytes(h, "big") + 0.5) / 2.0**64  # in (0, 1)
    return -max(weight, 1e-9) / math.log(unit)


def prefix_key(body: bytes, limit: int = 512, secret: bytes = b"") -> int | None:
    """A hash keyed with `secret` of the prompt's first `limit` bytes (chat messages in
    order, or a completion prompt), or None when the body has no prompt phasewatch can
    read."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    text: str | None = None
    messages = obj.get("messages")
    if isinstance(messages, list):
        parts = []
        size = 0
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            piece = f"{msg.get('role')}:" + (
                content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            )
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        text = "\n".join(parts)
    elif isinstance(obj.get("prompt"), str):
        text = obj["prompt"]
    if not text:
        return None
    lead = text.encode("utf-8", "surrogatepass")[:limit]
    return keyed_hash(lead, secret)


def keyed_hash(lead: bytes, secret: bytes) -> int:
    """The prefix hash: BLAKE2b keyed with the deployment's secret (a key of at most 64
    bytes: a longer one is hashed down to 32)."""
    key = secret if len(secret) <= 64 else hashlib.sha256(secret).digest()
    return int.from_bytes(hashlib.blake2b(lead, digest_size=8, key=key).digest(), "big")
