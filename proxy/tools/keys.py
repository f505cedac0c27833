"""The key a command (``bench``, ``report``, ``advise``) presents to a keyed phasewatch:
one option, read one way.

``--api-key KEY``, ``--api-key @FILE`` or ``--api-key-file FILE``, else the variables
``PHASEWATCH_API_KEY`` and ``PHASEWATCH_API_KEY_FILE`` (the ones ``serve`` reads: the
first key they hold, a named ``NAME=KEY`` as its KEY), else the command's own fallbacks
(``bench``: ``OPENAI_API_KEY``). A key file holds one key a line, as secrets are
mounted in containers and Kubernetes (:func:`proxy.settings.checks.read_key_file`). A
``--api-key`` value that names a file is refused, never sent as the key. The key is
sent as ``Authorization: Bearer KEY`` and never printed.
"""

from __future__ import annotations

import argparse
import os
from urllib.parse import unquote, urlsplit, urlunsplit

from ..settings.checks import names_a_file, read_key_file, split_list, split_named_key

ENV = "PHASEWATCH_API_KEY"
ENV_FILE = "PHASEWATCH_API_KEY_FILE"
#: What a 401 tells the user.
NEEDS_KEY = f"this phasewatch needs a key: --api-key or {ENV}"


def add_arguments(parser: argparse.ArgumentParser, fallbacks: tuple[str, ...] = ()) -> None:
    """``--api-key`` and ``--api-key-file``; `fallbacks`: the command's own variables,
    read after phasewatch's."""
    envs = ", ".join((ENV, ENV_FILE, *fallbacks))
    parser.add_argument(
        "--api-key",
        default=None,
        help="Key to present to a keyed phasewatch (sent as Authorization: Bearer KEY); "
        f"@FILE reads it from FILE [env {envs}].",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="Read the key from FILE (its first key; one a line, as a mounted secret) "
        f"[env {ENV_FILE}].",
    )
    parser.set_defaults(key_fallbacks=fallbacks)


def _first(path: str, flag: str) -> str:
    return split_named_key(read_key_file(path, flag)[0])[1]


def key_of(args: argparse.Namespace) -> str | None:
    """The key the command presents, or None. Raises ValueError with what to fix (never
    the key)."""
    given = getattr(args, "api_key", None)
    if given:
        if given.startswith("@") and len(given) > 1:
            return _first(given[1:], "--api-key @FILE")
        if names_a_file(given):
            raise ValueError(
                "--api-key: the value names a file (not shown): give --api-key-file FILE "
                "or --api-key @FILE to read the key from it"
            )
        return given
    if getattr(args, "api_key_file", None):
        return _first(args.api_key_file, "--api-key-file")
    text = os.environ.get(ENV, "").strip()
    if text:
        items = split_list(text)
        first = split_named_key(str(items[0]))[1] if items else ""
        if first.startswith("@") and len(first) > 1:
            return _first(first[1:], f"{ENV} @FILE")
        if names_a_file(first):
            raise ValueError(
                f"{ENV}: the value names a file (not shown): set {ENV_FILE} to read the key from it"
            )
        return first or None
    path = os.environ.get(ENV_FILE, "").strip()
    if path:
        return _first(path, ENV_FILE)
    for var in getattr(args, "key_fallbacks", ()):
        if os.environ.get(var):
            return os.environ[var]
    return None


def without_credentials(url: str) -> tuple[str, str | None]:
    """A URL without its user and password (``http://any:KEY@host``), and the password:
    the key it carries, which is then never printed with the URL."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return clean, unquote(parts.password) if parts.password else None
