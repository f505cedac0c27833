"""The settings model: every option of ``phasewatch serve`` once (its flag, variable, default
and description), validated, then parsed once into the typed sections its consumers take
(:meth:`Settings.upstream_options`, :meth:`~Settings.relay_options`,
:meth:`~Settings.server_limits`, :meth:`~Settings.power_options`, ...)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..engines import engine_names
from ..fleet.upstream import UpstreamSpec
from . import views
from .checks import (
    ENV_ALIASES,
    ENV_PREFIX,
    access_near_misses,
    check_api_keys,
    check_client_names,
    check_header_name,
    check_http_url,
    check_kv_dtypes,
    check_pairs,
    check_power_gpu,
    check_precision,
    check_upstream_keys,
    check_upstreams,
    expand_key_files,
    named_keys,
    read_key_file,
    split_list,
    split_named_key,
    unknown_variables,
)
from .upstreams import upstream_specs

#: Settings accepted for one more release without effect, and the start-up notice each
#: gives when it is set.
DEPRECATED = {
    "handoff": "--handoff/--no-handoff (PHASEWATCH_HANDOFF) has no effect and will be "
    "removed in the next release",
    "upstream_client": "--upstream-client (PHASEWATCH_UPSTREAM_CLIENT) has no effect (lean "
    "is the only upstream client) and will be removed in the next release",
}


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
        description="Deprecated, has no effect: lean (asyncio + httptools) is the only "
        "upstream client; still accepted for one release, with a notice at start.",
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
    max_header_fields: int = Field(
        100,
        ge=8,
        description="Most header fields a request head may have (431 beyond), however "
        "small: a head of thousands of tiny fields costs a field's work in every layer.",
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
    max_decoded_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        description="Most bytes a compressed stream from an engine is decoded to for "
        "measurement (a decompression bomb stops there): measured no further, counted "
        'as errors_total{kind="decode_limit"}.',
    )

    # Access (never logged, never exported)
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Keys clients must present (Authorization: Bearer KEY or x-api-key) "
        "to use the proxy, bare or named, NAME=KEY: a named key's requests are labelled "
        "client=NAME (repeatable; default: no proxy keys, the client's own "
        "Authorization reaches the engine). @FILE reads the keys from FILE, one a line; "
        "a value that names a file is refused, never taken for a key.",
    )
    api_key_file: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Files of keys clients may present, one a line (NAME=KEY lines too; "
        "blank lines and # comments skipped), as secrets are mounted in containers and "
        "Kubernetes; read at start, added to --api-key's (repeatable).",
    )
    max_key_failures: int = Field(
        30,
        ge=0,
        description="Wrong proxy keys one client address may present a minute (Bearer, "
        "x-api-key, Basic, the login form, ?key=); beyond, its keys get 429 unchecked "
        "until it may try again (0: no limit).",
    )
    page_cookie_ttl: float = Field(
        12 * 3600,
        gt=0,
        description="Seconds the status pages' login cookie is valid; a restart or a "
        "changed key ends it sooner.",
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
    power_max_watts: float = Field(
        3000.0,
        gt=0,
        description="A GPU power reading above this (W), or above twice the GPU's power "
        "limit where the source reports it, is refused (counted in "
        "phasewatch_gpu_sensor_rejected_total), and so is an energy-counter step implying it.",
    )
    power_dcgm_max_bytes: int = Field(
        4 << 20,
        ge=4096,
        description="Longest DCGM-exporter page read (bytes); a longer one is refused "
        "(counted in phasewatch_gpu_sensor_rejected_total), not read on.",
    )
    power_gpu: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Which upstream or model a GPU serves: GPU=UPSTREAM or GPU=MODEL, GPU "
        "numbered as the power source numbers it (repeatable; default: every GPU serves "
        "every upstream; GPUs left out of a mapping are not sampled). A MODEL is one an "
        "upstream lists or --models names; any other is warned about once the lists are known.",
    )

    # Pipelining (proxy.runtime.http1)
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
    handoff: bool = Field(
        True,
        description="Deprecated, has no effect (the CPU hand-off it switched was removed); "
        "still accepted for one release, with a notice at start.",
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
    affinity_secret: SecretStr | None = Field(
        None,
        description="The key of --affinity prefix's prompt hash, so clients cannot aim "
        "prompts at one member; give every phasewatch in front of one pool the same one "
        "(default: a random one per start, which replicas do not share).",
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
    eject_backoff_max: float = Field(
        30.0,
        gt=0,
        description="Longest an upstream is held out after its trial request failed "
        "again (its probe answers, its real requests fail): each such ejection doubles "
        "the hold, from 0.25 s, up to this.",
    )
    health_timeout: float = Field(
        2.0, gt=0, description="Seconds one health probe may take before it counts as failed."
    )
    eject_after_5xx: int = Field(
        3,
        ge=0,
        description="Failed requests in a row (5xx answers, no answer within "
        "--read-timeout, answers that stopped) that mark an upstream down; once back it "
        "gets one request at a time until one succeeds (0: never on these alone; a "
        "refused connection always does).",
    )
    stall_floor: float = Field(
        60.0,
        ge=0,
        description="Seconds of silence below which a stream in flight is never called "
        "stalled (before its first token and after it); 0 turns stall detection off. A "
        "stalled stream is logged once, counted in phasewatch_stalls_total, shown on the "
        "status page and in /phasewatch/ready, and a pool sends new requests elsewhere.",
    )
    stall_prefill_factor: float = Field(
        4.0,
        gt=0,
        description="Before its first token a stream is stalled after this many times its "
        "prompt's expected prefill (at the upstream's measured prefill rate), and only while "
        "no other stream of the upstream advances.",
    )
    stall_gaps: float = Field(
        100.0,
        gt=0,
        description="After its first token a stream is stalled after this many inter-token "
        "gaps (at the upstream's measured decode rate) without output.",
    )
    admin_api: Literal["auto", "deny", "allow", "keyed"] = Field(
        "auto",
        description="The engines' model-management endpoints (Ollama /api/copy, "
        "/api/delete, /api/pull, /api/create, /api/push, /api/blobs; vLLM "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter; llama-server /lora-adapters, "
        "/slots; SGLang /flush_cache, /update_weights_from_disk ...; TensorRT-LLM "
        "/update_weights ...): allow, deny (403), keyed (only with a proxy key that names "
        "no client); "
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
        items = split_list(value)
        if info.field_name == "api_key" and isinstance(value, str) and not items:
            raise ValueError("an empty key would leave the proxy open: give a key")
        if info.field_name == "api_key" and isinstance(items, list):
            texts = [i for i in items if isinstance(i, str)]
            return expand_key_files(texts) + [i for i in items if not isinstance(i, str)]
        return items

    @field_validator("api_key_file", mode="before")
    @classmethod
    def _key_file_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("upstream_key")
    @classmethod
    def _check_upstream_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        return check_upstream_keys(value)

    @field_validator("api_key")
    @classmethod
    def _check_api_keys(cls, value: list[SecretStr]) -> list[SecretStr]:
        return check_api_keys(value)

    @field_validator("client_header")
    @classmethod
    def _check_client_header(cls, value: str | None) -> str | None:
        return check_header_name(value)

    @field_validator("clients", mode="before")
    @classmethod
    def _clients_list(cls, value: Any) -> Any:
        if isinstance(value, list):  # --clients a,b,c on the command line too
            return [name for item in value for name in split_list(str(item))]
        return split_list(value)

    @field_validator("clients")
    @classmethod
    def _check_clients(cls, value: list[str]) -> list[str]:
        return check_client_names(value)

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
        return split_list(value)

    @field_validator("upstream")
    @classmethod
    def _check_upstreams(cls, value: list[str]) -> list[str]:
        return check_upstreams(value)

    @field_validator("precision", "engine")
    @classmethod
    def _check_pairs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        # a bare engine is for the one upstream (checked in _parse)
        return check_pairs(value, bare=info.field_name == "engine")

    @field_validator("precision")
    @classmethod
    def _check_precisions(cls, value: list[str]) -> list[str]:
        for item in value:
            check_precision(item)
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_dtypes(cls, value: list[str]) -> list[str]:
        return check_kv_dtypes(value)

    @field_validator("power_gpu", mode="before")
    @classmethod
    def _power_gpu_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("power_gpu")
    @classmethod
    def _check_power_gpu(cls, value: list[str]) -> list[str]:
        return check_power_gpu(value)

    @field_validator("power_dcgm_url")
    @classmethod
    def _check_dcgm_url(cls, value: str | None) -> str | None:
        return check_http_url(value)

    # --- the typed views, parsed once -----------------------------------------------------

    @model_validator(mode="after")
    def _parse(self) -> Settings:
        if self.max_body_memory < self.max_body_bytes:
            raise ValueError(
                f"--max-body-memory ({self.max_body_memory}) is below --max-body-bytes "
                f"({self.max_body_bytes}): no body of the largest size could be accepted"
            )
        for var, text in os.environ.items():  # ignored when empty, yet meant as a key
            if var.upper() == "PHASEWATCH_API_KEY" and not split_list(text):
                raise ValueError(
                    "PHASEWATCH_API_KEY is set but holds no key: an empty key would leave "
                    "the proxy open (unset it, or give a key)"
                )
        known = frozenset(ENV_PREFIX + f.upper() for f in type(self).model_fields) | set(
            ENV_ALIASES
        )
        misses = access_near_misses(os.environ, known)
        if misses:
            raise ValueError("; ".join(misses))
        if self.api_key_file:  # the files' keys join --api-key's, checked alike
            read = [SecretStr(k) for path in self.api_key_file for k in read_key_file(path)]
            self.api_key = check_api_keys([*self.api_key, *read])
        specs, notes = upstream_specs(self)
        self._named_keys = named_keys(
            self.api_key, self.clients, self.client_header, self.admin_api
        )
        self._upstreams = tuple(specs)
        notes += [DEPRECATED[name] for name in DEPRECATED if name in self.model_fields_set]
        self._notices = notes + unknown_variables(os.environ, known)
        self._precision = dict(item.split("=", 1) for item in self.precision)
        self._power_gpu = {
            gpu.strip(): target.strip()
            for gpu, _, target in (item.partition("=") for item in self.power_gpu)
        }
        return self

    @property
    def admin_api_mode(self) -> str:
        """allow, deny or keyed: auto is deny when a proxy key names a client, else allow."""
        if self.admin_api != "auto":
            return self.admin_api
        return "deny" if self._named_keys else "allow"

    @property
    def notices(self) -> list[str]:
        """Warnings for the start-up log: a corrected upstream URL, unknown variables."""
        return list(self._notices)

    @property
    def upstreams(self) -> tuple[UpstreamSpec, ...]:
        """Every upstream, named (unnamed ones by host:port), with its engine and key."""
        return self._upstreams

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

    # --- the sections (proxy.settings.views), each one object for its consumer ------------

    def relay_options(self) -> views.RelayOptions:
        return views.relay_options(self)

    def server_limits(self) -> views.ServerLimits:
        return views.server_limits(self)

    def balance_options(self, start_secret: bytes = b"") -> views.BalanceOptions:
        return views.balance_options(self, start_secret)

    def upstream_options(self) -> views.UpstreamOptions:
        return views.upstream_options(self)

    def power_options(self) -> views.PowerOptions:
        return views.power_options(self)

    def stall_options(self) -> views.StallOptions:
        return views.stall_options(self)
