"""Where GPU power is read: NVML on this host, or a DCGM-exporter endpoint for GPUs on
another host, behind one small interface (:class:`Source`)."""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx


class PowerUnavailable(Exception):
    """Power cannot be read from this source at all (no library, no GPU)."""


class PageTooLarge(RuntimeError):
    """A DCGM page longer than ``--power-dcgm-max-bytes``: not read on (no exporter's page
    is that long; reading it whole every tick costs memory and the relay's CPU)."""


@dataclass(slots=True)
class Reading:
    """One GPU at one moment: its power usage field (W), and the other fields its source
    has (None where it has not). As read, unchecked: :mod:`.guard` refuses what no GPU
    can report before any figure uses it."""

    watts: float
    energy_mj: float | None = None  # the device's cumulative energy counter, if it has one
    instant: float | None = None  # the instant power field (W)
    average: float | None = None  # the 1 s mean power field (W), where separate
    limit: float | None = None  # the GPU's power limit (W), where the source reports it

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
        self.limits: dict[str, float] = {}  # gpu -> its enforced power limit (W)

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
            try:  # read once: a limit changed later (nvidia-smi -pl) moves the cap at restart
                self.limits[gpu] = nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            except (nvml.NVMLError, AttributeError):
                pass

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
                self.limits.get(gpu),
            )
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass


_DCGM_LINE = re.compile(
    r"^(DCGM_FI_DEV_POWER_USAGE_INSTANT|DCGM_FI_DEV_POWER_USAGE|DCGM_FI_DEV_POWER_MGMT_LIMIT|"
    r"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION)\{([^}\n]*)\}[ \t]+(\S+)",
    re.MULTILINE,
)
_GPU_LABEL = re.compile(r'(?:^|,)\s*gpu="([^"]*)"')


def parse_dcgm(text: str) -> dict[str, Reading]:
    """Power (W), energy (mJ) and power limit (W) per `gpu` label from a DCGM-exporter
    /metrics page, as the page says them (NaN, Inf and absurd values included: the
    sampler's guard refuses them, counted).

    Other families (vLLM's, the exporter's other fields) are skipped without parsing. MIG
    instances repeat a GPU's device-level values; the first line per GPU wins.
    """
    fields: dict[str, dict[str, float]] = {}
    for m in _DCGM_LINE.finditer(text):
        g = _GPU_LABEL.search(m.group(2))
        if g is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        fields.setdefault(m.group(1), {}).setdefault(g.group(1), value)
    energy = fields.get("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", {})
    instant = fields.get("DCGM_FI_DEV_POWER_USAGE_INSTANT", {})
    limit = fields.get("DCGM_FI_DEV_POWER_MGMT_LIMIT", {})
    return {
        gpu: Reading(w, energy.get(gpu), instant.get(gpu), None, limit.get(gpu))
        for gpu, w in fields.get("DCGM_FI_DEV_POWER_USAGE", {}).items()
    }


class DcgmSource:
    """A DCGM-exporter (or the simulator's) /metrics endpoint, for GPUs on another host.

    dcgm-exporter collects its fields every 30 s by default; for per-request power run it
    with ``-c 100`` and a counters file with DCGM_FI_DEV_POWER_USAGE_INSTANT.
    """

    name = "dcgm"

    def __init__(self, url: str, timeout: float, max_bytes: int = 4 << 20) -> None:
        self.url = url
        self.max_bytes = max_bytes
        self.timeout = timeout
        # the page as sent: a compressed one could expand past the bound in one chunk
        self.client = httpx.Client(
            timeout=timeout, trust_env=False, headers={"Accept-Encoding": "identity"}
        )

    def open(self) -> None:
        pass  # the endpoint may be down at start: each read tries again

    def read(self) -> dict[str, Reading]:
        """The page's readings, read on the sampler's caller thread (never the event
        loop's), uncompressed, at most `max_bytes` of it and within the timeout as a
        whole (a page dripped slowly is not waited for chunk after chunk): a longer page
        is not read on."""
        deadline = time.monotonic() + self.timeout
        with self.client.stream("GET", self.url) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{self.url} answered {resp.status_code}")
            coding = resp.headers.get("content-encoding", "identity").strip().lower()
            if coding != "identity":
                raise RuntimeError(f"{self.url} sent a {coding!r} page, not asked for")
            told = resp.headers.get("content-length", "")
            if told.isdigit() and int(told) > self.max_bytes:
                raise PageTooLarge(f"a page of {told} bytes")
            body = bytearray()
            for chunk in resp.iter_bytes():  # identity: as sent
                body += chunk
                if len(body) > self.max_bytes:
                    raise PageTooLarge(f"a page of more than {len(body)} bytes")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.url}: the page took over {self.timeout:g}s")
        readings = parse_dcgm(body.decode("utf-8", "replace"))
        if not readings:
            raise RuntimeError(f"no DCGM_FI_DEV_POWER_USAGE with a gpu label at {self.url}")
        return readings

    def close(self) -> None:
        self.client.close()


def choose_source(
    kind: str, dcgm_url: str | None, interval: float, max_bytes: int = 4 << 20
) -> Source | None:
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
        return DcgmSource(dcgm_url, timeout=max(1.0, 4 * interval), max_bytes=max_bytes)
    return NvmlSource()
