"""What a setting's value may be, checked once at start-up: upstream URLs (a base, not an
endpoint), ``PHASEWATCH_*`` names and their near-misses (a near-miss of an access-control
setting refuses to start), precision words, named keys, the files a setting names, and
each item of the list settings (keys, client names, upstreams, pairs)."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr

from ..measure.kvcache import KV_DTYPE_BYTES, kv_dtype
from ..measure.precision import PRECISIONS, normalise


def split_list(value: Any) -> Any:
    """Accept a JSON list, or a comma/space separated string (friendlier in env files)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part for part in text.replace(",", " ").split() if part]
    return value


#: The trailing path segments of a client's base URL (OpenAI's ``http://host:8000/v1``,
#: Ollama's ``http://host:11434/api``): phasewatch forwards the client's whole path,
#: ``/v1`` or ``/api`` included, so an upstream is the engine's base.
_CLIENT_SUFFIXES = ("/v1", "/api")


def parse_upstream(spec: str) -> tuple[str | None, str, str | None]:
    """``[name=]URL`` -> (name or None, normalised base URL, a note for the log or None).

    A base path is kept (``http://gateway/tenant-a``: requests go to
    ``/tenant-a/v1/chat/completions``); a trailing ``/v1`` or ``/api``, the habit from
    OpenAI's and Ollama's base URLs, is dropped with a note, since clients send
    ``/v1/…`` and ``/api/…`` themselves. Raises
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
    endpoint = endpoint_part(parts.path)
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
    for suffix in _CLIENT_SUFFIXES:
        if parts.path.rstrip("/").endswith(suffix):
            base = url.removesuffix(suffix)
            note = (
                f"upstream {url} ends in {suffix}: relaying to {base} instead "
                f"(phasewatch forwards the client's whole path, {suffix} included: "
                f"give the engine's base URL, and clients keep {suffix} in theirs)"
            )
            url = base
            break
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


#: Names and addresses of this host's loopback interface.
_LOOPBACK = ("localhost", "::1", "0.0.0.0", "::")


def _loopback(host: str) -> bool:
    return host in _LOOPBACK or host.startswith("127.") or host.endswith(".localhost")


def own_address(url: str, host: str, port: int) -> bool:
    """Whether the upstream `url` is the address a proxy listening on `host`:`port` serves:
    the same port at the same host, or at any loopback address where the proxy listens on
    loopback or on every address. A loop this cannot see (another name of this host, a
    proxy in between) is cut on arrival (the relay's ``Via`` check)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or port == 0:  # (the proxy serves plain HTTP)
        return False
    target = (parts.hostname or "").lower()
    if (parts.port or 80) != port:
        return False
    listening = host.strip("[]").lower()
    if target == listening:
        return True
    return _loopback(target) and (_loopback(listening) or listening in ("", "0.0.0.0", "::"))


def endpoint_part(path: str) -> str:
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


def readable_files(flag: str, values: list[str], names: set[str]) -> dict[str | None, str]:
    """``[name=]FILE`` values by upstream name (None: every upstream), each a readable file
    (checked at start-up, so a typo stops the proxy with its reason, not a request later)."""
    out: dict[str | None, str] = {}
    for item in values:
        name, sep, path = item.partition("=")
        key: str | None = name if sep and name in names else None
        path = path if key is not None else item
        if key in out:
            raise ValueError(f"{flag}: given twice for {key or 'every upstream'}")
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise ValueError(f"{flag}: {path!r} is not a readable file")
        out[key] = path
    return out


def named_keys(
    api_key: list[SecretStr], clients: list[str], client_header: str | None, admin_api: str
) -> dict[str, str]:
    """The named proxy keys (key -> client name), once the access settings are seen to hold
    together: a client name belongs to a named key or to --clients, never both."""
    if client_header and not clients:
        raise ValueError(
            "--client-header needs --clients a,b,c: the client label takes only those "
            "names (anything else is 'other'), so a client cannot grow the series"
        )
    named: dict[str, str] = {}
    for item in api_key:
        name, key = split_named_key(item.get_secret_value())
        if name is not None:
            named[key] = name
    clash = sorted(set(clients) & set(named.values()))
    if clash:
        # a bare-key holder sending --client-header NAME would be counted as the holder
        # of the named key: a client name belongs to a key or to --clients, never both
        raise ValueError(
            f"--clients: {clash[0]!r} is also the name of a named --api-key "
            f"({clash[0]}=KEY): a request with a bare key could claim that client "
            "through --client-header; give the --clients entry another name"
        )
    if admin_api == "keyed" and not any(
        split_named_key(k.get_secret_value())[0] is None for k in api_key
    ):
        raise ValueError(
            "--admin-api keyed needs a proxy key that names no client (--api-key KEY): "
            "only such a key may call the engines' model-management endpoints"
        )
    return named


# --- the list settings' items, each raising ValueError with what the operator reads -------


def check_upstream_keys(value: list[SecretStr]) -> list[SecretStr]:
    """``--upstream-key``: each ``name=KEY`` (never shown back)."""
    for item in value:
        name, _, key = item.get_secret_value().partition("=")
        if not name or not key:
            raise ValueError("each upstream key must be name=KEY (value not shown)")
    return value


#: What a key file may hold at most: a file of keys is small; a larger one is not one.
MAX_KEY_FILE_BYTES = 1024 * 1024


def read_key_file(path: str, flag: str = "--api-key-file") -> list[str]:
    """The keys in a key file, one a line, as secrets are mounted in containers and
    Kubernetes (``NAME=KEY`` lines too); blank lines and ``#`` comments are skipped and a
    trailing newline is no part of a key. Raises ValueError naming the file and why, never
    what it holds."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: {path!r} is not a file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r} ({exc.strerror or exc})") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{flag}: {path!r} is over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path!r} is not UTF-8 text: not a key file") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(
            f"{flag}: {path!r} holds no key (one a line): an empty key would leave the proxy open"
        )
    return keys


def expand_key_files(items: list[str], flag: str = "--api-key") -> list[str]:
    """``--api-key`` values with each ``@FILE`` replaced by the keys the file holds."""
    out: list[str] = []
    for item in items:
        if item.startswith("@") and len(item) > 1:
            out += read_key_file(item[1:], f"{flag} @FILE")
        else:
            out.append(item)
    return out


def names_a_file(value: str) -> bool:
    """Whether a key given as a value is a path instead (an existing file, or a value
    written as a relative or home path): such a value must never become the key."""
    text = value.strip()
    if text.startswith(("./", "../", "~/")):
        return True
    try:
        return os.path.isfile(os.path.expanduser(text))
    except (OSError, ValueError):
        return False


def check_api_keys(value: list[SecretStr]) -> list[SecretStr]:
    """``--api-key``: no empty key (it would leave the proxy open), no client name twice,
    no path taken for a key (a key file is read with ``--api-key-file FILE`` or
    ``--api-key @FILE``)."""
    names: set[str] = set()
    for item in value:
        if not item.get_secret_value().strip(" ,\t\r\n"):
            raise ValueError(
                "an empty key would leave the proxy open: give a key, or leave the setting out"
            )
        if names_a_file(item.get_secret_value()) or names_a_file(
            split_named_key(item.get_secret_value())[1]
        ):
            raise ValueError(
                "a key names a file (value not shown): to read keys from a file, one a "
                "line, give --api-key-file FILE (PHASEWATCH_API_KEY_FILE) or --api-key @FILE"
            )
        name, key = split_named_key(item.get_secret_value())
        if name is not None:
            if name in names:
                raise ValueError(f"client name {name!r} given to two keys")
            names.add(name)
        if not key:
            raise ValueError("an API key must not be empty (value not shown)")
    return value


def check_header_name(value: str | None) -> str | None:
    """``--client-header``: a header name, lower-cased."""
    if value is not None:
        value = value.strip().lower()
        if not value or not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError("must be a header name (letters, digits, '-', '_')")
    return value


def check_client_names(value: list[str]) -> list[str]:
    """``--clients``: names fit for a label value."""
    for name in value:
        if not CLIENT_NAME_RE.fullmatch(name):
            raise ValueError(
                f"client name {name[:80]!r} must be 1-64 letters, digits, '-', '_' or '.'"
            )
    return value


def check_upstreams(value: list[str]) -> list[str]:
    """``--upstream``: each a base URL (:func:`parse_upstream`), none named twice."""
    names = set()
    for spec in value:
        name, url, _ = parse_upstream(spec)
        key = name or url
        if key in names:
            raise ValueError(f"upstream {key!r} given twice")
        names.add(key)
    return value


def check_pairs(value: list[str], bare: bool = False) -> list[str]:
    """``name=value`` items (`bare`: a lone value is allowed too)."""
    for item in value:
        if bare and "=" not in item and item:
            continue
        if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1]:
            raise ValueError(f"{item!r} is not a name=value pair")
    return value


def check_kv_dtypes(value: list[str]) -> list[str]:
    """``--kv-cache-dtype``: ``name=dtype`` with a KV-cache type phasewatch knows."""
    for item in value:
        name, _, dtype = item.partition("=")
        if not name or kv_dtype(dtype) is None:
            raise ValueError(
                f"{item!r} is not name=dtype with a KV-cache type phasewatch knows "
                f"({', '.join(KV_DTYPE_BYTES)})"
            )
    return value


def check_power_gpu(value: list[str]) -> list[str]:
    """``--power-gpu``: ``GPU=UPSTREAM`` or ``GPU=MODEL``, each GPU once."""
    seen = set()
    for item in value:
        gpu, _, target = item.partition("=")
        if not gpu.strip() or not target.strip():
            raise ValueError(f"{item!r} is not a GPU=UPSTREAM or GPU=MODEL pair")
        if gpu.strip() in seen:
            raise ValueError(f"GPU {gpu.strip()!r} mapped twice")
        seen.add(gpu.strip())
    return value


def check_http_url(value: str | None) -> str | None:
    """An http(s) URL with a host (``--power-dcgm-url``)."""
    if value is not None:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
    return value
