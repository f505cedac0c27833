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

import difflib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
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

from .core.balance import BalanceOptions
from .core.upstreams import UpstreamOptions, UpstreamSpec
from .engines import ENGINES, engine_names
from .measure.kvcache import KV_DTYPE_BYTES, kv_dtype
from .measure.precision import PRECISIONS, normalise
from .services.power import PowerOptions
from .transport import ClientOptions, TLSOptions


def _split_list(value: Any) -> Any:
    """Accept a JSON list, or a comma/space separated string (friendlier in env files)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part for part in text.replace(",", " ").split() if part]
    return value


#: The trailing path segment of an OpenAI base URL (``http://host:8000/v1``): phasewatch
#: forwards the client's whole path, ``/v1`` included, so an upstream is the engine's base.
_OPENAI_SUFFIX = "/v1"


def parse_upstream(spec: str) -> tuple[str | None, str, str | None]:
    """``[name=]URL`` -> (name or None, normalised base URL, a note for the log or None).

    A base path is kept (``http://gateway/tenant-a``: requests go to
    ``/tenant-a/v1/chat/completions``); a trailing ``/v1``, the habit from OpenAI base
    URLs, is dropped with a note, since clients send ``/v1/…`` themselves. Raises
    ValueError."""
    name = None
    url = spec.strip()
    if "=" in url and not url.split("=", 1)[0].startswith(("http:", "https:")):
        name, url = url.split("=", 1)
        name = name.strip()
        if not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"upstream name {name!r} must be letters, digits, '-', '_' or '.'")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"upstream {spec!r} is not an http(s)://host[:port][/base-path] URL "
            "(e.g. http://127.0.0.1:8000)"
        )
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"upstream {spec!r} has a bad port") from exc
    if parts.query or parts.fragment:
        raise ValueError(f"upstream {spec!r} must not carry a query or fragment")
    url = url.rstrip("/")
    endpoint = _endpoint_part(parts.path)
    if endpoint:
        base = url[: len(url) - len(parts.path.rstrip("/"))] + parts.path.rstrip("/").removesuffix(
            endpoint
        )
        raise ValueError(
            f"upstream {url} is an endpoint URL (it ends in {endpoint}): give the engine's "
            f"base URL, {base} (phasewatch appends each client's whole path to it: every "
            "request would get the engine's 404)"
        )
    note = None
    if parts.path.rstrip("/").endswith(_OPENAI_SUFFIX):
        base = url.removesuffix(_OPENAI_SUFFIX)
        note = (
            f"upstream {url} ends in {_OPENAI_SUFFIX}: relaying to {base} instead "
            f"(phasewatch forwards the client's whole path, {_OPENAI_SUFFIX} included: "
            f"give the engine's base URL, and clients keep {_OPENAI_SUFFIX} in theirs)"
        )
        url = base
    return name, url, note


#: Paths of the engines' endpoints: an upstream URL ending in one is an endpoint, not a base.
_ENDPOINTS = (
    "/chat/completions",
    "/completions",
    "/embeddings",
    "/responses",
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/completion",
)


def _endpoint_part(path: str) -> str:
    """The endpoint part of an upstream URL's path (``/v1/chat/completions``, any ``/v1/…``,
    Ollama's ``/api/chat``), or "" for a base path."""
    path = path.rstrip("/")
    segments = path.split("/")
    if "v1" in segments[:-1]:
        return "/" + "/".join(segments[segments.index("v1") :])
    for end in _ENDPOINTS:
        if path.endswith(end):
            return end
    return ""


ENV_PREFIX = "PHASEWATCH_"
#: Variables of phasewatch's other commands (the simulator's ``PHASEWATCH_SIM_*``), of its
#: compose file and of its test tier: not settings of ``serve``, yet no misspelling either.
OTHER_VARIABLES = frozenset(
    {
        "PHASEWATCH_REAL_ENGINES",
        "PHASEWATCH_ENGINES_DIR",
        "PHASEWATCH_ENGINES_MANIFEST",
        "PHASEWATCH_ENGINES_PYTHON",
        "PHASEWATCH_ARTIFACTS",
        "PHASEWATCH_CONTAINERS",
        "PHASEWATCH_CONTAINERS_CACHE",
        "PHASEWATCH_DEBIAN_MIRROR",
        "PHASEWATCH_IMAGE",
    }
)
OTHER_PREFIXES = ("PHASEWATCH_SIM_",)


def unknown_variables(environ: Mapping[str, str], known: frozenset[str]) -> list[str]:
    """One note per ``PHASEWATCH_*`` variable that names no setting (a misspelling such
    as ``PHASEWATCH_UPSTREM`` would otherwise be ignored in silence), naming the nearest
    known one. Only names are quoted, never values."""
    notes = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in OTHER_VARIABLES:
            continue
        if name.startswith(OTHER_PREFIXES):
            continue
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}?" if near else "phasewatch serve --help lists the settings"
        notes.append(
            f"environment variable {name} is not a phasewatch setting and is ignored ({hint})"
        )
    return notes


#: Settings whose absence opens the proxy (or hands the client's credentials to the
#: engine): a near-miss of one refuses to start instead of being ignored with a warning.
ACCESS_SETTINGS = ("PHASEWATCH_API_KEY", "PHASEWATCH_UPSTREAM_KEY")

#: Second spellings of settings (``--upstream-ca-file`` beside ``--upstream-key-file``):
#: variable -> field; the flags are added by the command line.
ENV_ALIASES = {
    "PHASEWATCH_UPSTREAM_CA_FILE": "upstream_ca",
    "PHASEWATCH_UPSTREAM_CERT_FILE": "upstream_cert",
}


def access_near_misses(environ: Mapping[str, str], known: frozenset[str]) -> list[str]:
    """``PHASEWATCH_*`` variables that name no setting yet look like an access-control
    one (``PHASEWATCH_APIKEY``, ``PHASEWATCH_API_KEYS``): one message each (names only)."""
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in OTHER_VARIABLES:
            continue
        if name.startswith(OTHER_PREFIXES):
            continue
        # the nearest setting is one of them, or the name speaks of a key and is close
        near = [
            n
            for n in difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            if n in ACCESS_SETTINGS
        ]
        if not near and ("KEY" in name or "TOKEN" in name):
            near = difflib.get_close_matches(name, ACCESS_SETTINGS, n=1, cutoff=0.8)
        if near:
            out.append(
                f"environment variable {name} is not a phasewatch setting, and looks like "
                f"{near[0]}: refusing to start rather than run without access control "
                f"(rename it to {near[0]}, or unset it)"
            )
    return out


def check_precision(item: str) -> None:
    """``model=precision`` must name a precision or scheme the vocabulary knows: an
    unknown word would label every request of that model ``unknown`` in silence."""
    model, _, value = item.partition("=")
    if value.strip().lower() == "unknown" or normalise(value).precision != "unknown":
        return
    raise ValueError(
        f"{value!r} (for model {model!r}) is not a precision phasewatch knows: give one of "
        f"{', '.join(p for p in PRECISIONS if p != 'unknown')}, or a scheme such as Q4_K_M, "
        "Q8_0, F16, AWQ, GPTQ, FP8, W8A8, W4A16, NVFP4, MXFP4"
    )


#: A client name: what a named key or --clients may give as the `client` label.
CLIENT_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def split_named_key(text: str) -> tuple[str | None, str]:
    """``NAME=KEY`` -> (NAME, KEY); a bare key -> (None, KEY). A key is read as named only
    when what comes before its first ``=`` is a client name and something follows it, so
    base64 keys ending in ``=`` stay bare."""
    name, sep, key = text.partition("=")
    if sep and key and not key.startswith("=") and CLIENT_NAME_RE.fullmatch(name):
        return name, key
    return None, text


class Settings(BaseSettings):
    """Every setting of ``phasewatch serve``."""

    model_config = SettingsConfigDict(
        env_prefix="PHASEWATCH_", extra="ignore", env_ignore_empty=True
    )

    _upstreams: tuple[UpstreamSpec, ...] = PrivateAttr(default=())
    _precision: dict[str, str] = PrivateAttr(default_factory=dict)
    _power_gpu: dict[str, str] = PrivateAttr(default_factory=dict)
    _notices: list[str] = PrivateAttr(default_factory=list)
    _named_keys: dict[str, str] = PrivateAttr(default_factory=dict)  # key -> client name

    upstream: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Engine base URL, optionally named: [name=]http://host:port[/base-path] "
        "(repeatable; requests are routed by model). The client's whole path is appended: "
        "a trailing /v1 is dropped with a warning.",
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
        description=f"Engine dialect override per upstream: name={engine_names()} "
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
    max_label_length: int = Field(
        128,
        ge=16,
        le=4096,
        description="Longest label value taken from the wire (a listed model id); longer "
        "or unprintable names are not listed and their requests are labelled other "
        "(counted in label_values_folded_total).",
    )
    model_refresh: float = Field(
        30.0, gt=0, description="Seconds between refreshes of each upstream's model list."
    )
    model_dir: str | None = Field(
        None,
        description="Folder where the upstreams' checkpoints are readable (vLLM): "
        "each model's config.json there tells its precision (quantization_config, "
        "torch_dtype).",
    )
    kv_cache_dtype: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="KV-cache element type per model or upstream, name=dtype (fp16, bf16, "
        "fp8, q8_0, q4_0 ...), where the engine does not say: llama-server's "
        "--cache-type-k, Ollama's OLLAMA_KV_CACHE_TYPE (default for both: f16). vLLM's "
        "is read from the engine.",
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
    write_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one write of a request to an upstream may block (an engine "
        "that stopped reading).",
    )
    upstream_client: Literal["lean"] = Field(
        "lean",
        description="HTTP client for the upstream connections: lean (an asyncio + "
        "httptools HTTP/1.1 transport; library clients were measured against it, see the "
        "README's benchmarks).",
    )
    upstream_max_connections: int = Field(
        1024,
        ge=0,
        description="Most connections open to one upstream; more requests wait for one "
        "(0: no limit).",
    )
    upstream_pool_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a request may wait for a free upstream connection before a 503.",
    )
    upstream_keepalive: float = Field(
        4.0,
        gt=0,
        description="Seconds an idle upstream connection is kept for reuse: keep it below "
        "the engine's own idle timeout (5 s for uvicorn-based engines such as vLLM).",
    )
    upstream_max_head_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest upstream response head (status line and headers) taken; a "
        "larger one is a 502.",
    )
    upstream_ca: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="PEM file of the CA(s) an https upstream's certificate must chain to, "
        "instead of the system's: [name=]FILE (without a name: every upstream; repeatable).",
    )
    upstream_cert: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="PEM client certificate for upstreams that require one (mTLS): "
        "[name=]FILE (repeatable).",
    )
    upstream_key_file: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Private key of --upstream-cert, when not in the same file: "
        "[name=]FILE (repeatable).",
    )
    upstream_insecure: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Upstream names whose TLS certificate is not verified, or '*' for all "
        "(warned at start; for tests and trusted networks only).",
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
        "to use the proxy, bare or named, NAME=KEY: a named key's requests are labelled "
        "client=NAME (repeatable; default: no proxy keys, the client's own "
        "Authorization reaches the engine).",
    )
    client_header: str | None = Field(
        None,
        description="Request header naming the client (e.g. x-team) for the client label "
        "of requests, tokens and energy, for requests a named key does not name; "
        "needs --clients.",
    )
    clients: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="The client names --client-header may give (repeatable or "
        "comma-separated); any other value is labelled 'other', none at all 'unknown'.",
    )
    echo_request_id: bool = Field(
        False,
        description="Return the request id (the client's x-request-id, else the one "
        "phasewatch made) in an x-request-id response header on measured requests.",
    )
    otel: bool = Field(
        False,
        description="Export OpenTelemetry traces (one span per measured request, phases "
        "as span events, traceparent passed to the engine) and GenAI metrics over "
        "OTLP/HTTP, configured by the standard OTEL_* variables; needs "
        "pip install 'phasewatch[otel]'.",
    )
    otel_shutdown_timeout: float = Field(
        5.0,
        ge=0,
        le=600,
        description="Seconds at most that exporting the queued OpenTelemetry spans and "
        "metrics may take at shutdown (a collector that is down would hold it 40 s); "
        "never more than --shutdown-grace. What is left is dropped, counted and said.",
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
        "every upstream; GPUs left out of a mapping are not sampled). A MODEL is one an "
        "upstream lists or --models names; any other is warned about once the lists are known.",
    )

    # Pipelining (proxy.runtime.protocol)
    max_pipelined_requests: int = Field(
        16,
        ge=1,
        description="Requests a connection may send ahead of the one being answered "
        "(pipelining); reading waits beyond them.",
    )
    max_pipelined_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Bytes a connection's full pipeline may hold unparsed; a connection "
        "sending more ahead gets a 429 after its earlier answers and is closed.",
    )
    max_stalled_streams: int = Field(
        64,
        ge=1,
        description="Answers, per worker, that may wait on clients that stopped reading "
        "(each holds about 2 MiB); beyond, the one waiting longest is closed.",
    )

    # Fleets: pools of upstreams serving one model, health, model management
    balance: Literal["least-loaded", "round-robin", "random"] = Field(
        "least-loaded",
        description="How a pool (upstreams listing one model) spreads its requests: "
        "least-loaded (the least expected wait from in-flight requests, the engine's "
        "queue and KV-cache use, and measured seconds per request), round-robin, random "
        "(both weighted by --upstream-weight).",
    )
    affinity: Literal["none", "prefix"] = Field(
        "none",
        description="prefix: requests whose prompts share their first 512 bytes go to one "
        "member of the pool (its prefix cache), unless it is overloaded.",
    )
    upstream_weight: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="An upstream's weight in its pool, name=W (W > 0, default 1; "
        "repeatable): its share under round-robin and random, a divisor of its expected "
        "wait under least-loaded.",
    )
    health_interval: float = Field(
        1.0,
        ge=0,
        description="Seconds between health probes (one cheap GET) of an upstream that "
        "is up and idle; none while real requests answer (0: no probes, only the "
        "model-list refresh).",
    )
    health_backoff_max: float = Field(
        2.0,
        gt=0,
        description="Longest wait between probes of a down (ejected) upstream; the wait "
        "starts at 0.25 s and doubles.",
    )
    health_timeout: float = Field(
        2.0, gt=0, description="Seconds one health probe may take before it counts as failed."
    )
    eject_after_5xx: int = Field(
        3,
        ge=0,
        description="5xx answers in a row that mark an upstream down (0: never on status "
        "alone; a refused connection always does).",
    )
    admin_api: Literal["auto", "deny", "allow", "keyed"] = Field(
        "auto",
        description="The engines' model-management endpoints (Ollama /api/copy, "
        "/api/delete, /api/pull, /api/create, /api/push, /api/blobs; vLLM "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter; llama-server /lora-adapters, "
        "/slots): allow, deny (403), keyed (only with a proxy key that names no client); "
        "auto: deny when --api-key names clients, else allow.",
    )

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        """The second spellings' variables (ENV_ALIASES), where the first is not given."""
        if not isinstance(data, dict):
            return data
        for var, field in ENV_ALIASES.items():
            value = os.environ.get(var)
            if not value:
                continue
            if data.get(field) not in (None, "", []):
                flag = "--" + field.replace("_", "-")
                raise ValueError(f"{var} and {flag} (or {ENV_PREFIX}{field.upper()}) both given")
            data = {**data, field: value}
        return data

    @field_validator("api_key", "upstream_key", mode="before")
    @classmethod
    def _secret_lists(cls, value: Any, info: ValidationInfo) -> Any:
        items = _split_list(value)
        if info.field_name == "api_key" and isinstance(value, str) and not items:
            raise ValueError("an empty key would leave the proxy open: give a key")
        return items

    @field_validator("upstream_key")
    @classmethod
    def _check_upstream_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        for item in value:
            name, _, key = item.get_secret_value().partition("=")
            if not name or not key:
                raise ValueError("each upstream key must be name=KEY (value not shown)")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        names: set[str] = set()
        for item in value:
            if not item.get_secret_value().strip(" ,\t\r\n"):
                raise ValueError(
                    "an empty key would leave the proxy open: give a key, or leave the setting out"
                )
            name, key = split_named_key(item.get_secret_value())
            if name is not None:
                if name in names:
                    raise ValueError(f"client name {name!r} given to two keys")
                names.add(name)
            if not key:
                raise ValueError("an API key must not be empty (value not shown)")
        return value

    @field_validator("client_header")
    @classmethod
    def _check_client_header(cls, value: str | None) -> str | None:
        if value is not None:
            value = value.strip().lower()
            if not value or not all(c.isalnum() or c in "-_" for c in value):
                raise ValueError("must be a header name (letters, digits, '-', '_')")
        return value

    @field_validator("clients", mode="before")
    @classmethod
    def _clients_list(cls, value: Any) -> Any:
        if isinstance(value, list):  # --clients a,b,c on the command line too
            return [name for item in value for name in _split_list(str(item))]
        return _split_list(value)

    @field_validator("clients")
    @classmethod
    def _check_clients(cls, value: list[str]) -> list[str]:
        for name in value:
            if not CLIENT_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"client name {name[:80]!r} must be 1-64 letters, digits, '-', '_' or '.'"
                )
        return value

    @field_validator(
        "upstream",
        "engine",
        "precision",
        "models",
        "kv_cache_dtype",
        "upstream_ca",
        "upstream_cert",
        "upstream_key_file",
        "upstream_insecure",
        "upstream_weight",
        mode="before",
    )
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("upstream")
    @classmethod
    def _check_upstreams(cls, value: list[str]) -> list[str]:
        names = set()
        for spec in value:
            name, url, _ = parse_upstream(spec)
            key = name or url
            if key in names:
                raise ValueError(f"upstream {key!r} given twice")
            names.add(key)
        return value

    @field_validator("precision", "engine")
    @classmethod
    def _check_pairs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for item in value:
            if info.field_name == "engine" and "=" not in item and item:
                continue  # a bare engine: for the one upstream (checked in _parse)
            if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1]:
                raise ValueError(f"{item!r} is not a name=value pair")
        return value

    @field_validator("precision")
    @classmethod
    def _check_precisions(cls, value: list[str]) -> list[str]:
        for item in value:
            check_precision(item)
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_dtypes(cls, value: list[str]) -> list[str]:
        for item in value:
            name, _, dtype = item.partition("=")
            if not name or kv_dtype(dtype) is None:
                raise ValueError(
                    f"{item!r} is not name=dtype with a KV-cache type phasewatch knows "
                    f"({', '.join(KV_DTYPE_BYTES)})"
                )
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
        known = frozenset(ENV_PREFIX + f.upper() for f in type(self).model_fields) | set(
            ENV_ALIASES
        )
        misses = access_near_misses(os.environ, known)
        if misses:
            raise ValueError("; ".join(misses))
        engines = dict(item.split("=", 1) for item in self.engine if "=" in item)
        bare = [item for item in self.engine if "=" not in item]
        specs = []
        notes = []
        for spec in self.upstream:
            name, url, note = parse_upstream(spec)
            if note:
                notes.append(note)
            if name is None:
                parts = urlsplit(url)
                name = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
            specs.append(UpstreamSpec(name, url, engine=engines.get(name), api_key=keys.get(name)))
        if bare:
            if len(bare) > 1 or len(specs) != 1:
                raise ValueError(
                    f"--engine {bare[0]} (without NAME=) is for a single upstream; with "
                    f"{len(specs)} upstreams, give NAME={bare[0]} for each"
                    + (f" (upstreams: {', '.join(s.name for s in specs)})" if specs else "")
                )
            engines[specs[0].name] = bare[0]
            specs[0] = replace(specs[0], engine=bare[0])
        names = {s.name for s in specs}
        specs = self._with_tls(specs, names)
        specs = self._with_weights(specs, names)
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
        if self.client_header and not self.clients:
            raise ValueError(
                "--client-header needs --clients a,b,c: the client label takes only those "
                "names (anything else is 'other'), so a client cannot grow the series"
            )
        self._named_keys = {}
        for item in self.api_key:
            name, key = split_named_key(item.get_secret_value())
            if name is not None:
                self._named_keys[key] = name
        clash = sorted(set(self.clients) & set(self._named_keys.values()))
        if clash:
            # a bare-key holder sending --client-header NAME would be counted as the holder
            # of the named key: a client name belongs to a key or to --clients, never both
            raise ValueError(
                f"--clients: {clash[0]!r} is also the name of a named --api-key "
                f"({clash[0]}=KEY): a request with a bare key could claim that client "
                "through --client-header; give the --clients entry another name"
            )
        self._upstreams = tuple(specs)
        if self.admin_api == "keyed" and not any(
            split_named_key(k.get_secret_value())[0] is None for k in self.api_key
        ):
            raise ValueError(
                "--admin-api keyed needs a proxy key that names no client (--api-key KEY): "
                "only such a key may call the engines' model-management endpoints"
            )
        self._notices = notes + unknown_variables(os.environ, known)
        self._precision = dict(item.split("=", 1) for item in self.precision)
        self._power_gpu = {
            gpu.strip(): target.strip()
            for gpu, _, target in (item.partition("=") for item in self.power_gpu)
        }
        return self

    def _files(self, flag: str, values: list[str], names: set[str]) -> dict[str | None, str]:
        """``[name=]FILE`` values by upstream name (None: every upstream)."""
        out: dict[str | None, str] = {}
        for item in values:
            name, sep, path = item.partition("=")
            key: str | None = name if sep and name in names else None
            path = path if key is not None else item
            if key in out:
                raise ValueError(f"{flag}: given twice for {key or 'every upstream'}")
            if not os.path.isfile(path):
                raise ValueError(f"{flag}: {path!r} is not a readable file")
            out[key] = path
        return out

    def _with_tls(self, specs: list[UpstreamSpec], names: set[str]) -> list[UpstreamSpec]:
        """Each upstream's TLS options (its own file, else the one for every upstream)."""
        ca = self._files("--upstream-ca", self.upstream_ca, names)
        cert = self._files("--upstream-cert", self.upstream_cert, names)
        key = self._files("--upstream-key-file", self.upstream_key_file, names)
        for name in self.upstream_insecure:
            if name != "*" and specs and name not in names:
                raise ValueError(
                    f"--upstream-insecure: no upstream is named {name!r} (upstreams: "
                    f"{', '.join(sorted(names))})"
                )
        out = []
        for spec in specs:
            tls = TLSOptions(
                ca=ca.get(spec.name, ca.get(None)),
                cert=cert.get(spec.name, cert.get(None)),
                key=key.get(spec.name, key.get(None)),
                insecure="*" in self.upstream_insecure or spec.name in self.upstream_insecure,
            )
            if tls.key and not tls.cert:
                raise ValueError(
                    f"--upstream-key-file: upstream {spec.name} has no --upstream-cert"
                )
            if tls != TLSOptions():
                tls.context()  # a bad file stops start-up here, with its reason
                spec = replace(spec, tls=tls)
            out.append(spec)
        return out

    def _with_weights(self, specs: list[UpstreamSpec], names: set[str]) -> list[UpstreamSpec]:
        weights: dict[str, float] = {}
        for item in self.upstream_weight:
            name, _, text = item.partition("=")
            try:
                weight = float(text)
            except ValueError:
                weight = math.nan
            if not name or not math.isfinite(weight) or weight <= 0:
                raise ValueError(f"--upstream-weight: {item[:80]!r} is not name=W with W > 0")
            if specs and name not in names:
                raise ValueError(
                    f"--upstream-weight: no upstream is named {name!r} (upstreams: "
                    f"{', '.join(sorted(names))})"
                )
            weights[name] = weight
        return [replace(s, weight=weights[s.name]) if s.name in weights else s for s in specs]

    @property
    def admin_api_mode(self) -> str:
        """allow, deny or keyed: auto is deny when a proxy key names a client, else allow."""
        if self.admin_api != "auto":
            return self.admin_api
        return "deny" if self._named_keys else "allow"

    def balance_options(self) -> BalanceOptions:
        return BalanceOptions(self.balance, self.affinity)

    @property
    def notices(self) -> list[str]:
        """Warnings for the start-up log: a corrected upstream URL, unknown variables."""
        return list(self._notices)

    @property
    def upstreams(self) -> tuple[UpstreamSpec, ...]:
        """Every upstream, named (unnamed ones by host:port), with its engine and key."""
        return self._upstreams

    def upstream_options(self) -> UpstreamOptions:
        """What every upstream shares."""
        return UpstreamOptions(
            client=ClientOptions(
                kind=self.upstream_client,
                connect_timeout=self.connect_timeout,
                read_timeout=self.read_timeout,
                write_timeout=self.write_timeout,
                max_connections=self.upstream_max_connections,
                pool_timeout=self.upstream_pool_timeout,
                keepalive_expiry=self.upstream_keepalive,
                max_head_bytes=self.upstream_max_head_bytes,
            ),
            max_concurrency=self.max_concurrency,
            max_queue=self.max_queue,
            queue_timeout=self.queue_timeout,
            max_models=self.max_models,
            extra_models=frozenset(self.models),
            precision_overrides=tuple(self._precision.items()),
            model_dir=self.model_dir,
            kv_dtype_overrides=tuple(
                (name, kv_dtype(dtype) or dtype)
                for name, _, dtype in (item.partition("=") for item in self.kv_cache_dtype)
            ),
            health_interval=self.health_interval,
            health_backoff_max=self.health_backoff_max,
            health_timeout=self.health_timeout,
            eject_after_5xx=self.eject_after_5xx,
        )

    def power_options(self) -> PowerOptions:
        return PowerOptions(
            self.power_source, self.power_dcgm_url, self.power_interval, dict(self._power_gpu)
        )

    @property
    def api_keys(self) -> list[str]:
        """Every proxy key, without its name."""
        return [split_named_key(k.get_secret_value())[1] for k in self.api_key]

    @property
    def key_clients(self) -> dict[str, str]:
        """Named proxy keys: key -> client name."""
        return dict(self._named_keys)

    @property
    def upstream_keys(self) -> dict[str, str]:
        return {s.name: s.api_key for s in self._upstreams if s.api_key}
