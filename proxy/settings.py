"""Proxy settings: one model, filled from flags and ``PHASEWATCH_*`` variables, parsed once
into the typed objects the rest of the proxy takes.

The command line (proxy.tools.cli) builds its flags from these fields, so a setting exists
once, with one description, used for both ``--help`` and the README's table. Lists arrive
as strings (``name=value`` pairs, URLs); they are checked and split here, once, into
:class:`~proxy.core.upstreams.UpstreamSpec`, :class:`~proxy.core.upstreams.UpstreamOptions`
and :class:`~proxy.services.power.PowerOptions`; nothing downstream splits a string again.
An empty variable (``PHASEWATCH_POWER_DCGM_URL=``) counts as unset.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .core.upstreams import UpstreamOptions, UpstreamSpec
from .engines import ENGINES
from .services.power import PowerOptions
from .transport import ClientOptions


def _split_list(value: Any) -> Any:
    """Accept a JSON list, or a comma/space separated string (friendlier in env files)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part for part in text.replace(",", " ").split() if part]
    return value


def parse_upstream(spec: str) -> tuple[str | None, str]:
    """``[name=]URL`` -> (name or None, normalised base URL). Raises ValueError."""
    name = None
    url = spec.strip()
    if "=" in url and not url.split("=", 1)[0].startswith(("http:", "https:")):
        name, url = url.split("=", 1)
        name = name.strip()
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"upstream name {name!r} must be letters, digits, '-', '_' or '.'")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream {spec!r} is not an http(s)://host[:port] URL")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"upstream {spec!r} has a bad port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"upstream {spec!r} must not carry a query or fragment")
    return name, url.rstrip("/")


class Settings(BaseSettings):
    """Every setting of ``phasewatch serve``."""

    model_config = SettingsConfigDict(
        env_prefix="PHASEWATCH_", extra="ignore", env_ignore_empty=True
    )

    _upstreams: tuple[UpstreamSpec, ...] = PrivateAttr(default=())
    _precision: dict[str, str] = PrivateAttr(default_factory=dict)
    _power_gpu: dict[str, str] = PrivateAttr(default_factory=dict)

    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Engine base URL, optionally named: [name=]http://host:port "
        "(repeatable; requests are routed by model).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8090, ge=0, le=65535, description="Port to listen on.")
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Worker processes sharing the port (one per core to "
        "scale); /metrics sums them, and GPU power is sampled by one of them only.",
    )
    engine: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Engine dialect override per upstream: name=vllm|openai|ollama|llamacpp "
        "(default: detected).",
    )
    max_concurrency: int = Field(
        0,
        ge=0,
        description="Most generation requests in flight per upstream; more wait "
        "in the proxy's queue (0: no limit).",
    )
    max_queue: int = Field(
        256,
        ge=0,
        description="Most requests waiting per upstream when max-concurrency is "
        "reached; beyond it requests get 429.",
    )
    queue_timeout: float = Field(
        0.0, ge=0, description="Seconds a request may wait in the queue before a 503 (0: no limit)."
    )
    precision: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Precision override per model: model=precision (bf16, fp8, int4, "
        "Q4_K_M, AWQ ...).",
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Extra model names to label as themselves (beyond the upstreams' "
        "model lists); any other name is labelled 'other'.",
    )
    max_models: int = Field(64, ge=1, description="Most distinct model label values per upstream.")
    model_refresh: float = Field(
        30.0, gt=0, description="Seconds between refreshes of each upstream's model list."
    )
    model_dir: str | None = Field(
        None,
        description="Folder where the upstreams' checkpoints are readable (vLLM): "
        "each model's config.json there tells its precision (quantization_config, "
        "torch_dtype).",
    )
    engine_scrape: float = Field(
        5.0,
        ge=0,
        description="Seconds between scrapes of the engines' own state (running "
        "and waiting requests, KV-cache use, Ollama's loaded models); 0: off.",
    )
    inject_usage: bool = Field(
        True,
        description="Ask the engine for usage on streams whose client did not, and "
        "strip it again byte for byte.",
    )
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to connect to an upstream.")
    read_timeout: float = Field(
        600.0,
        gt=0,
        description="Seconds an upstream may stay silent (long prefills "
        "and cold loads need minutes).",
    )
    upstream_client: Literal["lean", "httpx"] = Field(
        "lean",
        description="HTTP client for the upstream connections: lean (an asyncio + "
        "httptools HTTP/1.1 transport under httpx's API, several times cheaper per "
        "streamed event) or httpx (httpx's own transport).",
    )
    max_body_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="Largest request body accepted (413 beyond)."
    )
    max_body_memory: int = Field(
        256 * 1024 * 1024,
        gt=0,
        description="Most bytes of request bodies held in memory at once, per worker, "
        "counted as they arrive (503 with Retry-After beyond; at least --max-body-bytes).",
    )
    max_head_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest request head (request line and headers) accepted (431 "
        "beyond), checked before any other work.",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a client may take to send a request head (408 and the "
        "connection closed beyond); also how long an unwanted request body is read "
        "and dropped before a connection the proxy answered early is closed.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a request body may stall (no byte arriving) before a 408: a "
        "stalled upload cannot hold its share of --max-body-memory.",
    )
    max_event_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Largest stream event held for measurement; a larger one passes "
        'through unmeasured (counted as errors_total{kind="oversized"}).',
    )

    # Access (never logged, never exported)
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Keys clients must present (Authorization: Bearer KEY or x-api-key) "
        "to use the proxy (repeatable; default: no proxy keys, the client's own "
        "Authorization reaches the engine).",
    )
    upstream_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Engine API key per upstream, name=KEY, sent as Authorization: Bearer "
        "KEY in place of the client's (repeatable).",
    )
    metrics_host: str | None = Field(
        None,
        description="Serve /metrics on its own address instead of the proxy port "
        "(the proxy port then relays /metrics to the engine).",
    )
    metrics_public: bool = Field(
        False,
        description="Serve /metrics on the proxy port without a key even when "
        "--api-key is set (by default it then needs one, like every own route but the "
        "health and readiness probes).",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port for --metrics-host (default: the proxy's "
        "host when only the port is given).",
    )
    shutdown_grace: float = Field(
        30.0,
        ge=0,
        description="Seconds SIGTERM waits for in-flight requests to finish "
        "(new ones get 503 meanwhile) before exiting.",
    )
    log_format: Literal["logfmt", "json", "none"] = Field(
        "logfmt", description="Per-request log line format."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    # GPU power (proxy.services.power)
    power_source: Literal["auto", "nvml", "dcgm", "none"] = Field(
        "auto",
        description="Where GPU power is read: nvml (this host's GPUs), dcgm (a "
        "DCGM-exporter /metrics URL, for GPUs on another host), none, or auto (dcgm when "
        "--power-dcgm-url is given, else nvml, which says once when there is no GPU).",
    )
    power_dcgm_url: str | None = Field(
        None,
        description="DCGM-exporter metrics URL, e.g. http://gpu-host:9400/metrics "
        "(DCGM_FI_DEV_POWER_USAGE, DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION).",
    )
    power_interval: float = Field(
        0.2, ge=0.02, le=10.0, description="Seconds between GPU power samples."
    )
    power_gpu: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Which upstream or model a GPU serves: GPU=UPSTREAM or GPU=MODEL, GPU "
        "numbered as the power source numbers it (repeatable; default: every GPU serves "
        "every upstream; GPUs left out of a mapping are not sampled).",
    )

    @field_validator("api_key", "upstream_key", mode="before")
    @classmethod
    def _secret_lists(cls, value: Any, info: ValidationInfo) -> Any:
        items = _split_list(value)
        if info.field_name == "api_key" and isinstance(value, str) and not items:
            raise ValueError("an empty key would leave the proxy open: give a key")
        return items

    @field_validator("api_key")
    @classmethod
    def _check_api_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for item in value:
            if not item.get_secret_value().strip(" ,\t\r\n"):
                raise ValueError(
                    "an empty key would leave the proxy open: give a key, or leave the setting out"
                )
        return value

    @field_validator("upstream_key")
    @classmethod
    def _check_upstream_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for item in value:
            name, _, key = item.get_secret_value().partition("=")
            if not name or not key:
                raise ValueError("each upstream key must be name=KEY (value not shown)")
        return value

    @field_validator("upstream", "engine", "precision", "models", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("upstream")
    @classmethod
    def _check_upstreams(cls, value: list[str]) -> list[str]:
        names = set()
        for spec in value:
            name, url = parse_upstream(spec)
            key = name or url
            if key in names:
                raise ValueError(f"upstream {key!r} given twice")
            names.add(key)
        return value

    @field_validator("precision", "engine")
    @classmethod
    def _check_pairs(cls, value: list[str]) -> list[str]:
        for item in value:
            if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1]:
                raise ValueError(f"{item!r} is not a name=value pair")
        return value

    @field_validator("power_gpu", mode="before")
    @classmethod
    def _power_gpu_list(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("power_gpu")
    @classmethod
    def _check_power_gpu(cls, value: list[str]) -> list[str]:
        seen = set()
        for item in value:
            gpu, _, target = item.partition("=")
            if not gpu.strip() or not target.strip():
                raise ValueError(f"{item!r} is not a GPU=UPSTREAM or GPU=MODEL pair")
            if gpu.strip() in seen:
                raise ValueError(f"GPU {gpu.strip()!r} mapped twice")
            seen.add(gpu.strip())
        return value

    @field_validator("power_dcgm_url")
    @classmethod
    def _check_dcgm_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    # --- the typed views, parsed once -----------------------------------------------------

    @model_validator(mode="after")
    def _parse(self) -> Settings:
        if self.max_body_memory < self.max_body_bytes:
            raise ValueError(
                f"--max-body-memory ({self.max_body_memory}) is below --max-body-bytes "
                f"({self.max_body_bytes}): no body of the largest size could be accepted"
            )
        for var, text in os.environ.items():  # ignored when empty, yet meant as a key
            if var.upper() == "PHASEWATCH_API_KEY" and not _split_list(text):
                raise ValueError(
                    "PHASEWATCH_API_KEY is set but holds no key: an empty key would leave "
                    "the proxy open (unset it, or give a key)"
                )
        keys = dict(k.get_secret_value().split("=", 1) for k in self.upstream_key)
        engines = dict(item.split("=", 1) for item in self.engine)
        specs = []
        for spec in self.upstream:
            name, url = parse_upstream(spec)
            if name is None:
                parts = urlsplit(url)
                name = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
            specs.append(UpstreamSpec(name, url, engine=engines.get(name), api_key=keys.get(name)))
        names = {s.name for s in specs}
        for name, engine in engines.items():
            if engine not in ENGINES:
                raise ValueError(
                    f"--engine: {engine!r} is not an engine phasewatch knows "
                    f"({', '.join(sorted(ENGINES))})"
                )
            if specs and name not in names:
                raise ValueError(
                    f"--engine: no upstream is named {name!r} (upstreams: "
                    f"{', '.join(sorted(names))})"
                )
        for name in keys:
            if specs and name not in names:
                raise ValueError(
                    f"--upstream-key: no upstream is named {name!r} (upstreams: "
                    f"{', '.join(sorted(names))})"
                )
        self._upstreams = tuple(specs)
        self._precision = dict(item.split("=", 1) for item in self.precision)
        self._power_gpu = {
            gpu.strip(): target.strip()
            for gpu, _, target in (item.partition("=") for item in self.power_gpu)
        }
        return self

    @property
    def upstreams(self) -> tuple[UpstreamSpec, ...]:
        """Every upstream, named (unnamed ones by host:port), with its engine and key."""
        return self._upstreams

    def upstream_options(self) -> UpstreamOptions:
        """What every upstream shares."""
        return UpstreamOptions(
            client=ClientOptions(self.upstream_client, self.connect_timeout, self.read_timeout),
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            queue_timeout=self.queue_timeout,
            max_models=self.max_models,
            extra_models=frozenset(self.models),
            precision_overrides=tuple(self._precision.items()),
            model_dir=self.model_dir,
        )

    def power_options(self) -> PowerOptions:
        return PowerOptions(
            self.power_source, self.power_dcgm_url, self.power_interval, dict(self._power_gpu)
        )

    @property
    def api_keys(self) -> list[str]:
        return [k.get_secret_value() for k in self.api_key]

    @property
    def upstream_keys(self) -> dict[str, str]:
        return {s.name: s.api_key for s in self._upstreams if s.api_key}
