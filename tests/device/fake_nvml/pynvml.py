"""A stand-in ``pynvml`` for the dry run of tests/device/gpu_power_check.py (no GPU here).

It answers the NVML calls phasewatch and the check make with a sensor that behaves like a
recent one (Hopper-like, the issue's figures): true power is idle power plus the load the
check's load generator announces in an activity file (``FAKE_NVML_ACTIVITY``:
lines ``S <monotonic> <kind>`` and ``E <monotonic>``), so every process on this host sees
the same power (CLOCK_MONOTONIC is system-wide). Each field is refreshed every
``REFRESH`` seconds: the energy counter exactly, the instant field as the mean over a
``WINDOW`` before the refresh, ``nvmlDeviceGetPowerUsage`` and the average field as the
1 s mean. Unknown ``nvml*`` calls raise Not Supported, as a driver without them does, and so do the
reads named in ``FAKE_NVML_UNSUPPORTED`` (field ids, ``usage``, ``counter``; comma-separated).
Module constants are the real library's values.

It is independent of the simulator's sensor profiles (proxy.sim) on purpose: the check
measures phasewatch against a sensor model phasewatch's own tests did not write.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

IDLE_W = 70.0
LOAD_W = {"compute": 580.0, "memory": 380.0}
REFRESH = 0.1
WINDOW = 0.025

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186
NVML_FI_DEV_ENERGY = 191
NVML_POWER_SCOPE_GPU = 0
NVML_POWER_SCOPE_MODULE = 1
NVML_POWER_SCOPE_MEMORY = 2
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            NVML_ERROR_UNINITIALIZED: "Uninitialized",
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        }.get(self.value, f"Unknown Error {self.value}")


class NVMLError_NotSupported(NVMLError):
    def __init__(self, value: int = NVML_ERROR_NOT_SUPPORTED) -> None:
        super().__init__(value)


class _Activity:
    """The announced load, read incrementally from the activity file."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.offset = 0
        self.spans: list[tuple[float, float, float]] = []  # start, end (inf: open), watts
        self.lock = threading.Lock()

    def refresh(self) -> None:
        if not self.path:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        cut = data.rfind("\n") + 1
        self.offset += len(data[:cut].encode())
        for line in data[:cut].splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "S":
                self.spans.append((float(parts[1]), math.inf, LOAD_W.get(parts[2], 300.0)))
            elif len(parts) >= 2 and parts[0] == "E" and self.spans:
                s, _, w = self.spans[-1]
                self.spans[-1] = (s, float(parts[1]), w)

    def energy_j(self, t: float) -> float:
        """True energy from monotonic 0 to t."""
        e = IDLE_W * t
        for s, end, w in self.spans:
            if s < t:
                e += w * (min(t, end) - s)
        return e


_state: dict[str, Any] = {"init": 0}
_UNSUPPORTED = {x.strip() for x in os.environ.get("FAKE_NVML_UNSUPPORTED", "").split(",") if x}
_WALL_OFFSET = time.time() - time.monotonic()
_activity = _Activity(os.environ.get("FAKE_NVML_ACTIVITY"))


def _check() -> None:
    if not _state["init"]:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _refreshed(t: float) -> float:
    return math.floor(t / REFRESH) * REFRESH


def _energy(t: float) -> float:
    with _activity.lock:
        _activity.refresh()
        return _activity.energy_j(t)


def _noise(tick: float) -> float:
    return 3.0 * math.sin(tick * 7919.0)


def _instant_w() -> float:
    tq = _refreshed(time.monotonic())
    return (_energy(tq) - _energy(tq - WINDOW)) / WINDOW + _noise(tq)


def _mean_w() -> float:
    tq = _refreshed(time.monotonic())
    return _energy(tq) - _energy(tq - 1.0)


def nvmlInit() -> None:
    _state["init"] += 1


def nvmlShutdown() -> None:
    _check()
    _state["init"] -= 1


def nvmlDeviceGetCount() -> int:
    _check()
    return 1


def nvmlDeviceGetHandleByIndex(index: int) -> object:
    _check()
    if index != 0:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return SimpleNamespace(index=0)


def nvmlDeviceGetName(handle: object) -> str:
    _check()
    return "Fake NVML GPU (dry run)"


def nvmlSystemGetDriverVersion() -> str:
    _check()
    return "0.0-fake"


def nvmlDeviceGetPowerUsage(handle: object) -> int:
    _check()
    if "usage" in _UNSUPPORTED:
        raise NVMLError_NotSupported()
    return int(_mean_w() * 1000)


def nvmlDeviceGetTotalEnergyConsumption(handle: object) -> int:
    _check()
    if "counter" in _UNSUPPORTED:
        raise NVMLError_NotSupported()
    return int(_energy(_refreshed(time.monotonic())) * 1000)


def nvmlDeviceGetFieldValues(handle: object, field_ids: list) -> list:
    _check()
    out = []
    for fid in field_ids:
        field, scope = fid if isinstance(fid, tuple) else (fid, 0)
        # stamped with the refresh the value comes from, as a driver's sample would be
        now = _refreshed(time.monotonic()) + _WALL_OFFSET
        value = SimpleNamespace(dVal=0.0, uiVal=0, ulVal=0, ullVal=0, sllVal=0, siVal=0)
        ret, vtype = NVML_SUCCESS, NVML_VALUE_TYPE_UNSIGNED_INT
        if str(field) in _UNSUPPORTED:
            ret = NVML_ERROR_NOT_SUPPORTED
        elif field == NVML_FI_DEV_POWER_INSTANT and scope == 0:
            value.uiVal = int(_instant_w() * 1000)
        elif field == NVML_FI_DEV_POWER_AVERAGE and scope == 0:
            value.uiVal = int(_mean_w() * 1000)
        elif field == NVML_FI_DEV_ENERGY and scope == 0:
            vtype = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.ullVal = int(_energy(_refreshed(time.monotonic())) * 1000)
        else:
            ret = NVML_ERROR_NOT_SUPPORTED
        out.append(
            SimpleNamespace(
                fieldId=field,
                scopeId=scope,
                timestamp=int(now * 1e6),
                latencyUsec=0,
                valueType=vtype,
                nvmlReturn=ret,
                value=value,
            )
        )
    return out


def nvmlErrorString(value: int) -> str:
    return str(NVMLError(value))


def _borrow_constants() -> None:
    """The real library's other constants and structures (read from its file, which is
    safe: it loads NVML only in nvmlInit), so code that names one still imports."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "pynvml.py")
        if os.path.abspath(entry or ".") == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_real_pynvml", path)
        if spec is None or spec.loader is None:
            return
        real = importlib.util.module_from_spec(spec)
        sys.modules["_real_pynvml"] = real  # it looks itself up there
        try:
            spec.loader.exec_module(real)
        except Exception:
            return
        finally:
            sys.modules.pop("_real_pynvml", None)
        mine = globals()
        for name, value in vars(real).items():
            if name.startswith(("NVML_", "c_nvml")) and name not in mine:
                mine[name] = value
        return


_borrow_constants()


def __getattr__(name: str) -> Any:
    if name.startswith("NVMLError_"):  # the real library's per-error subclasses
        cls = type(name, (NVMLError,), {})
        globals()[name] = cls
        return cls
    if name.startswith("nvml"):

        def unsupported(*args: object, **kwargs: object) -> Any:
            raise NVMLError_NotSupported()

        return unsupported
    raise AttributeError(name)
