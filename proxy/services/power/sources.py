"""Where GPU power is read: NVML on this host, or a DCGM-exporter endpoint for GPUs on
another host, behind one small interface (:class:`Source`)."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

import httpx


class PowerUnavailable(Exception):
    """Power cannot be read from this source at all (no library, no GPU)."""


@dataclass(slots=True)
class Reading:
    """One GPU at one moment: its power usage field (W), and the other fields its source
    has (None where it has not)."""

    watts: float
    energy_mj: int | None = None  # the device's cumulative energy counter, if it has one
    instant: float | None = None  # the instant power field (W)
    average: float | None = None  # the 1 s mean power field (W), where separate

    def fields(self) -> dict[str, float]:
        """Each field present by its name in phasewatch_gpu_power_*{field}."""
        out = {"power_usage": self.watts}
        if self.instant is not None:
            out["power_instant"] = self.instant
        if self.average is not None:
            out["power_average"] = self.average
        if self.energy_mj is not None:
            out["energy_counter"] = float(self.energy_mj)
        return out


class Source(Protocol):
    name: str

    def open(self) -> None: ...
    def read(self) -> dict[str, Reading]: ...
    def close(self) -> None: ...


def _import_pynvml() -> Any:
    """NVIDIA's NVML bindings (the ``nvidia-ml-py`` package provides ``pynvml``)."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise PowerUnavailable(f"NVIDIA's nvidia-ml-py is not installed ({exc})") from None


class NvmlSource:
    """This host's GPUs through NVML (pynvml): power in mW, energy counter in mJ (Volta+).

    GPUs are numbered as NVML numbers them (as nvidia-smi shows), which need not match
    CUDA_VISIBLE_DEVICES inside an engine's container.
    """

    name = "nvml"

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: dict[str, object] = {}
        self.has_counter: dict[str, bool] = {}
        self.field_ids: dict[str, list[int]] = {}  # gpu -> power fields it supports

    def open(self) -> None:
        nvml = _import_pynvml()
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            handles = {str(i): nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
        except nvml.NVMLError as exc:
            raise PowerUnavailable(f"NVML is not available ({exc})") from None
        if not handles:
            raise PowerUnavailable("NVML sees no GPU")
        self.nvml, self.handles = nvml, handles
        for gpu, h in handles.items():
            try:
                nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                self.has_counter[gpu] = True
            except nvml.NVMLError:  # pre-Volta or not exposed: integrate power instead
                self.has_counter[gpu] = False
            self.field_ids[gpu] = [f for f in self._fields() if self._field(h, f) is not None]

    def _fields(self) -> list[int]:
        """NVML_FI_DEV_POWER_INSTANT and _AVERAGE where these bindings know them."""
        return [
            getattr(self.nvml, n)
            for n in ("NVML_FI_DEV_POWER_INSTANT", "NVML_FI_DEV_POWER_AVERAGE")
            if hasattr(self.nvml, n)
        ]

    def _field(self, handle: object, fid: int) -> float | None:
        vals = self._field_values(handle, [fid])
        return vals.get(fid)

    def _field_values(self, handle: object, fids: list[int]) -> dict[int, float]:
        """Field id -> W for the fields NVML answered (an old driver answers none)."""
        nvml = self.nvml
        try:
            got = nvml.nvmlDeviceGetFieldValues(handle, fids)
        except (nvml.NVMLError, AttributeError):
            return {}
        return {
            v.fieldId: v.value.uiVal / 1000.0
            for v in got
            if getattr(v, "nvmlReturn", 1) == getattr(nvml, "NVML_SUCCESS", 0)
        }

    def read(self) -> dict[str, Reading]:
        nvml = self.nvml
        out = {}
        for gpu, h in self.handles.items():
            watts = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # an NVMLError fails the tick
            energy = None
            if self.has_counter[gpu]:
                try:
                    energy = int(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                except nvml.NVMLError:
                    energy = None  # this interval is integrated instead
            fids = self.field_ids.get(gpu) or []
            vals = self._field_values(h, fids) if fids else {}
            out[gpu] = Reading(
                watts,
                energy,
                vals.get(getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", -1)),
                vals.get(getattr(nvml, "NVML_FI_DEV_POWER_AVERAGE", -1)),
            )
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass


_DCGM_LINE = re.compile(
    r"^(DCGM_FI_DEV_POWER_USAGE_INSTANT|DCGM_FI_DEV_POWER_USAGE|"
    r"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION)\{([^}]*)\}\s+(\S+)",
    re.MULTILINE,
)
_GPU_LABEL = re.compile(r'(?:^|,)\s*gpu="([^"]*)"')


def parse_dcgm(text: str) -> dict[str, Reading]:
    """Power (W) and energy (mJ) per `gpu` label from a DCGM-exporter /metrics page.

    Other families (vLLM's, the exporter's other fields) are skipped without parsing. MIG
    instances repeat a GPU's device-level values; the first line per GPU wins.
    """
    power: dict[str, float] = {}
    energy: dict[str, int] = {}
    instant: dict[str, float] = {}
    for m in _DCGM_LINE.finditer(text):
        g = _GPU_LABEL.search(m.group(2))
        if g is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if value != value or value < 0:  # NaN or nonsense
            continue
        if m.group(1) == "DCGM_FI_DEV_POWER_USAGE":
            power.setdefault(g.group(1), value)
        elif m.group(1) == "DCGM_FI_DEV_POWER_USAGE_INSTANT":
            instant.setdefault(g.group(1), value)
        else:
            energy.setdefault(g.group(1), int(value))
    return {gpu: Reading(w, energy.get(gpu), instant.get(gpu)) for gpu, w in power.items()}


class DcgmSource:
    """A DCGM-exporter (or the simulator's) /metrics endpoint, for GPUs on another host.

    dcgm-exporter collects its fields every 30 s by default; for per-request power run it
    with ``-c 100`` and a counters file with DCGM_FI_DEV_POWER_USAGE_INSTANT.
    """

    name = "dcgm"

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.client = httpx.Client(timeout=timeout, trust_env=False)

    def open(self) -> None:
        pass  # the endpoint may be down at start: each read tries again

    def read(self) -> dict[str, Reading]:
        resp = self.client.get(self.url)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url} answered {resp.status_code}")
        readings = parse_dcgm(resp.text)
        if not readings:
            raise RuntimeError(f"no DCGM_FI_DEV_POWER_USAGE with a gpu label at {self.url}")
        return readings

    def close(self) -> None:
        self.client.close()


def choose_source(kind: str, dcgm_url: str | None, interval: float) -> Source | None:
    """auto: DCGM when a URL is given, else NVML (which says once if it is not there)."""
    if kind == "auto":
        kind = "dcgm" if dcgm_url else "nvml"
    if kind == "none":
        return None
    if kind == "dcgm":
        if not dcgm_url:
            raise ValueError(
                "--power-source dcgm needs --power-dcgm-url (e.g. http://gpu-host:9400/metrics)"
            )
        return DcgmSource(dcgm_url, timeout=max(1.0, 4 * interval))
    return NvmlSource()
