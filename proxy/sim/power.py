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
    """DCGM_FI_DEV_POWER_USAGE and DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION for every GPU."""
    gpus = sorted(engine.models.values(), key=lambda me: me.gpu_index)
    lines = [
        "# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).",
        "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
    ]
    lines += [f"DCGM_FI_DEV_POWER_USAGE{{{_labels(me)}}} {me.power():f}" for me in gpus]
    lines += [
        "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).",
        "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter",
    ]
    lines += [
        f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{_labels(me)}}} {int(me.read_energy() * 1000)}"
        for me in gpus
    ]
    return "\n".join(lines) + "\n"


def gpu_models(engine: SimEngine) -> dict[str, str]:
    """GPU index -> the model on it (what ``--power-gpu`` needs in front of the simulator)."""
    return {str(me.gpu_index): mid for mid, me in engine.models.items()}
