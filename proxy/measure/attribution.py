"""Per-client attribution from phasewatch's own counters: requests, tokens and energy by
the `client` label (what people use for chargeback).

Pure: samples in (a ``/metrics`` page or a Prometheus server's answers, as
:class:`~proxy.measure.summary.Samples`), rows out. Energy is the per-request share of
the GPUs' energy (``phasewatch_request_energy_joules_total``): idle energy is nobody's,
so the rows add up to less than the GPUs drew.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .metrics import PREFIX
from .summary import Samples


@dataclass
class ClientRow:
    client: str
    requests: float = 0.0
    ok: float = 0.0
    errors: float = 0.0  # error + rejected
    aborted: float = 0.0
    prompt_tokens: float = 0.0  # processed + served from the prefix cache
    cached_tokens: float = 0.0
    completion_tokens: float = 0.0
    energy_joules: float | None = None  # None: no power was sampled for its requests
    energy_settled: float = 0.0  # requests the energy rests on
    energy_unresolved: float = 0.0  # requests whose energy could not be settled

    @property
    def joules_per_token(self) -> float | None:
        if self.energy_joules is None or not self.completion_tokens:
            return None
        return self.energy_joules / self.completion_tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "joules_per_token": self.joules_per_token}


def by_client(samples: Samples) -> list[ClientRow]:
    """One row per client seen on the request, token or energy counters, busiest first."""
    rows: dict[str, ClientRow] = {}

    def row(sample_labels: dict) -> ClientRow:
        name = sample_labels.get("client", "unknown")
        return rows.setdefault(name, ClientRow(name))

    for s in samples.get(PREFIX + "requests_total"):
        r = row(s.labels)
        r.requests += s.value
        outcome = s.labels.get("outcome")
        if outcome == "ok":
            r.ok += s.value
        elif outcome in ("error", "rejected"):
            r.errors += s.value
        elif outcome == "aborted":
            r.aborted += s.value
    for s in samples.get(PREFIX + "tokens_total"):
        r = row(s.labels)
        phase = s.labels.get("phase")
        if phase in ("prefill", "cached"):
            r.prompt_tokens += s.value
            if phase == "cached":
                r.cached_tokens += s.value
        elif phase == "decode":
            r.completion_tokens += s.value
    for s in samples.get(PREFIX + "request_energy_joules_total"):
        r = row(s.labels)
        r.energy_joules = (r.energy_joules or 0.0) + s.value
    for s in samples.get(PREFIX + "request_energy_requests_total"):
        r = row(s.labels)
        if s.labels.get("result") == "settled":
            r.energy_settled += s.value
        else:
            r.energy_unresolved += s.value
    return sorted(rows.values(), key=lambda r: (-r.completion_tokens, -r.requests, r.client))
