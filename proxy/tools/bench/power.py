"""GPU power from a phasewatch proxy's ``/metrics``: the decode and prefill watts of the
bench's own runs, and the idle watts over a pause with nothing sent."""

from __future__ import annotations

import httpx

from ...measure.summary import Samples
from .client import Client
from .traffic import NAMES, POWER, Watch

#: The series the bench reads from phasewatch's page (the rest, the histograms' buckets
#: above all, is skipped unparsed: a busy client takes far longer to parse a whole page).
_POWER_SERIES = ("phasewatch_model_info", *POWER)


def samples_of(text: str | None) -> Samples | None:
    """phasewatch's power series from a /metrics page; None for an engine's page (the
    simulator's has phasewatch_sim_* series of its own: only a proxy has model_info)."""
    if not text or "phasewatch_model_info" not in text:
        return None
    wanted = [ln for ln in text.splitlines() if ln.startswith(_POWER_SERIES)]
    try:
        return Samples.from_text("\n".join(wanted) + "\n")
    except ValueError:
        return None


async def phasewatch_samples(client: Client) -> Samples | None:
    try:
        resp = await client.http.get("/metrics", params={"name[]": NAMES})
    except httpx.HTTPError:
        return None
    return samples_of(resp.text) if resp.status_code == 200 else None


def run_watts(watch: Watch, model: str, phase: str) -> tuple[float, float]:
    """Mean `phase` power of the requests counted during the last measured run, and how
    many requests it covers (the bench sent one)."""
    before = decode_watts(samples_of(watch.before_text), model, phase)
    after = decode_watts(samples_of(watch.text), model, phase)
    n = after[1] - before[1]
    return ((after[0] - before[0]) / n if n > 0 else 0.0), n


def decode_watts(samples: Samples | None, model: str, phase: str = "decode") -> tuple[float, float]:
    """Sum and count of the per-request mean power of `phase` (decode or prefill)."""
    if samples is None:
        return 0.0, 0.0
    lab = {"model": model, "phase": phase}
    return (
        samples.total("phasewatch_gpu_power_watts_sum", **lab),
        samples.total("phasewatch_gpu_power_watts_count", **lab),
    )


def idle_watts(samples: Samples | None, model: str) -> tuple[float, float] | None:
    """Sum and count of the power samples taken while the model's GPUs were idle: the
    GPUs given to the model (``--power-gpu GPU=MODEL``), else those of its upstream."""
    if samples is None:
        return None
    upstreams = {
        s.labels.get("upstream") for s in samples.get("phasewatch_model_info", model=model)
    }
    own, shared = [], []
    for s in samples.get("phasewatch_gpu_power_sample_watts_count", state="idle"):
        if s.labels.get("model") == model:
            own.append(s.labels)
        elif s.labels.get("model") in (None, "all") and upstreams & set(
            s.labels.get("upstream", "").split("+")
        ):
            shared.append(s.labels)
    gpus = own or shared
    if not gpus:
        return None
    total = count = 0.0
    for labels in gpus:
        lab = {k: v for k, v in labels.items() if k != "le"}
        total += samples.total("phasewatch_gpu_power_sample_watts_sum", **lab)
        count += samples.total("phasewatch_gpu_power_sample_watts_count", **lab)
    return total, count
