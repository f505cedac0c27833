"""The simulated GPUs' power, as dcgm-exporter serves it, so the proxy's whole power path
(a DCGM source, energy counters, per-phase power) runs end to end with no GPU.

Every simulated engine (vLLM, Ollama, llama.cpp) can append :func:`dcgm_metrics` to a
``/metrics`` page. The lines follow dcgm-exporter's default counters exactly: its HELP
texts, ``gpu``/``UUID``/``pci_bus_id``/``device``/``modelName``/``Hostname``/
``DCGM_FI_DRIVER_VERSION`` labels, power in W printed with six decimals, energy since
"boot" (here: since the simulator started) as an integer in mJ.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from .engine import ModelEngine, SimEngine

HOSTNAME = "phasewatch-sim"
DRIVER_VERSION = "570.133.20"


def gpu_uuid(index: int) -> str:
    """A stable NVIDIA-style UUID for simulated GPU `index`."""
    return "GPU-" + str(
        uuid.UUID(bytes=hashlib.sha256(f"phasewatch-sim-gpu-{index}".encode()).digest()[:16])
    )


def _labels(me: ModelEngine) -> str:
    i = me.gpu_index
    return (
        f'gpu="{i}",UUID="{gpu_uuid(i)}",pci_bus_id="00000000:{i + 1:02X}:00.0",'
        f'device="nvidia{i}",modelName="{me.gpu.name}",Hostname="{HOSTNAME}",'
        f'DCGM_FI_DRIVER_VERSION="{DRIVER_VERSION}"'
    )


def dcgm_metrics(engine: SimEngine) -> str:
    """DCGM_FI_DEV_POWER_USAGE and DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION for every GPU (and
    DCGM_FI_DEV_POWER_USAGE_INSTANT and _POWER_MGMT_LIMIT when the exporter's counters
    file is phasewatch's), as the
    exporter last collected them from each GPU's sensor; then the simulator's truth, the
    true energy of each GPU now (``phasewatch_sim_gpu_true_energy_joules_total``)."""
    gpus = sorted(engine.models.values(), key=lambda me: me.gpu_index)
    seen = {me.gpu_index: engine.exporter.fields(me.gpu_index, me.sensor) for me in gpus}
    lines = [
        "# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).",
        "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
    ]
    lines += [
        f"DCGM_FI_DEV_POWER_USAGE{{{_labels(me)}}} {seen[me.gpu_index].usage:f}" for me in gpus
    ]
    lines += [
        "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).",
        "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter",
    ]
    lines += [
        f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{_labels(me)}}} {seen[me.gpu_index].energy_mj}"
        for me in gpus
    ]
    if engine.exporter.instant_field:
        lines += [
            "# HELP DCGM_FI_DEV_POWER_USAGE_INSTANT Current instantaneous power usage (in W).",
            "# TYPE DCGM_FI_DEV_POWER_USAGE_INSTANT gauge",
        ]
        lines += [
            f"DCGM_FI_DEV_POWER_USAGE_INSTANT{{{_labels(me)}}} {seen[me.gpu_index].instant:f}"
            for me in gpus
        ]
        lines += [
            "# HELP DCGM_FI_DEV_POWER_MGMT_LIMIT Power management limit (in W).",
            "# TYPE DCGM_FI_DEV_POWER_MGMT_LIMIT gauge",
        ]
        lines += [
            f"DCGM_FI_DEV_POWER_MGMT_LIMIT{{{_labels(me)}}} {me.gpu.tdp_watts:f}" for me in gpus
        ]
    lines += [
        "# HELP phasewatch_sim_gpu_true_energy_joules_total The simulated GPU's true energy.",
        "# TYPE phasewatch_sim_gpu_true_energy_joules_total counter",
    ]
    lines += [
        f'phasewatch_sim_gpu_true_energy_joules_total{{gpu="{me.gpu_index}"}} '
        f"{me.read_energy():.6f}"
        for me in gpus
    ]
    return "\n".join(lines) + "\n"


def nvml_view(engine: SimEngine) -> bytes:
    """What NVML would answer now about each simulated GPU (no exporter between): the
    stand-in ``pynvml`` of the tests reads this from ``/sim/nvml``."""
    out = []
    for me in sorted(engine.models.values(), key=lambda me: me.gpu_index):
        f = me.sensor.read()
        out.append(
            {
                "index": me.gpu_index,
                "name": me.gpu.name,
                "uuid": gpu_uuid(me.gpu_index),
                "power_usage_mw": int(f.usage * 1000),
                "power_instant_mw": int(f.instant * 1000),
                "power_average_mw": None if f.mean is None else int(f.mean * 1000),
                "energy_mj": f.energy_mj,
                "power_limit_mw": int(me.gpu.tdp_watts * 1000),
            }
        )
    return json.dumps({"profile": sensor_name(engine), "gpus": out}).encode()


def sensor_name(engine: SimEngine) -> str:
    return next(iter(engine.models.values())).sensor.profile.name if engine.models else ""


def gpu_models(engine: SimEngine) -> dict[str, str]:
    """GPU index -> the model on it (what ``--power-gpu`` needs in front of the simulator)."""
    return {str(me.gpu_index): mid for mid, me in engine.models.items()}
