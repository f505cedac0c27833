"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py), driven by the simulator's power.

Put this folder first on a proxy's PYTHONPATH and set ``PHASEWATCH_TEST_NVML_URL`` to a
simulator's ``/sim/nvml``: every call then answers what NVML would answer about the
simulated GPUs under the simulator's sensor profile (``--gpu-sensor``). Only the calls
phasewatch makes exist; their names, units and errors are NVML's.
"""

from __future__ import annotations

import json
import os
import urllib.request
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNINITIALIZED = 1
NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 1: "Uninitialized"}.get(self.value, f"NVML error {self.value}")


_url: str | None = None


def _gpus() -> list[dict]:
    if _url is None:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    with urllib.request.urlopen(_url, timeout=5) as resp:
        return json.loads(resp.read())["gpus"]


def _gpu(handle: int) -> dict:
    return _gpus()[handle]


def nvmlInit() -> None:
    global _url
    _url = os.environ["PHASEWATCH_TEST_NVML_URL"]


def nvmlShutdown() -> None:
    global _url
    _url = None


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetPowerUsage(handle: int) -> int:
    return int(_gpu(handle)["power_usage_mw"])


def nvmlDeviceGetTotalEnergyConsumption(handle: int) -> int:
    return int(_gpu(handle)["energy_mj"])


def nvmlDeviceGetEnforcedPowerLimit(handle: int) -> int:
    mw = _gpu(handle).get("power_limit_mw")
    if mw is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(mw)


def nvmlDeviceGetFieldValues(handle: int, field_ids: list[int]) -> list:
    g = _gpu(handle)
    out = []
    for fid in field_ids:
        mw = {
            NVML_FI_DEV_POWER_INSTANT: g["power_instant_mw"],
            NVML_FI_DEV_POWER_AVERAGE: g["power_average_mw"],
        }.get(fid)
        ret = NVML_SUCCESS if mw is not None else NVML_ERROR_NOT_SUPPORTED
        value = SimpleNamespace(uiVal=int(mw or 0), siVal=int(mw or 0))
        out.append(SimpleNamespace(fieldId=fid, nvmlReturn=ret, value=value))
    return out
