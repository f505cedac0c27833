"""GPU power from a phasewatch proxy's ``/metrics``: the decode and prefill watts of the
bench's own runs, and the idle watts over a pause with nothing sent."""

from __future__ import annotations

import asyncio
import time

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


#: How long the bench waits for phasewatch to settle a run's power (s): the sensor covers
#: a request's end one refresh period after it (a coarse sensor never: then unresolved).
SETTLE_WAIT = 3.0


async def settled_run(watch: Watch, model: str, phase: str) -> tuple[float, float, float]:
    """The run's `phase` once phasewatch has settled it: (mean watts, figures observed,
    joules attributed); watts and figures 0 when the phase was too short for the sensor
    (or did not settle in :data:`SETTLE_WAIT` s)."""
    before = samples_of(watch.before_text)
    n0, j0 = _settled(before, model, phase), _phase_joules(before, model, phase)
    deadline = time.monotonic() + SETTLE_WAIT
    while True:
        await watch.read()  # the next run's "before" is then this settled page
        now = samples_of(watch.text)
        # a phase too short is counted unresolved at once, its energy once covered
        done = _settled(now, model, phase) > n0 and _phase_joules(now, model, phase) > j0
        if done or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    b, a = decode_watts(before, model, phase), decode_watts(now, model, phase)
    n = a[1] - b[1]
    joules = _phase_joules(now, model, phase) - _phase_joules(before, model, phase)
    return ((a[0] - b[0]) / n if n > 0 else 0.0), n, joules


def _settled(samples: Samples | None, model: str, phase: str) -> float:
    if samples is None:
        return 0.0
    lab = {"model": model, "phase": phase}
    return samples.total("phasewatch_gpu_power_watts_count", **lab) + samples.total(
        "phasewatch_gpu_power_unresolved_total", **lab
    )


def _phase_joules(samples: Samples | None, model: str, phase: str) -> float:
    if samples is None:
        return 0.0
    return samples.total("phasewatch_request_phase_energy_joules_total", model=model, phase=phase)


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
