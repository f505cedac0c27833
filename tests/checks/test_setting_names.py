"""One name per setting, from its flag to its consumer: ``--max-pipelined-bytes`` is
``max_pipelined_bytes`` in the settings model, in the section its consumer takes
(:mod:`proxy.settings.views`) and in the keyword it is passed by.

Derived from the settings model: each setting is changed on its own, every section is built
again, and whatever field of a section changed must bear that setting's name; and every
section field that bears a setting's name must follow that setting. A section field fed by
no setting (a constant, a test hook) must not change with any."""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import SecretStr, ValidationError

from proxy.settings import Settings

from ..support.servers import ROOT

#: The sections, as their consumers take them.
SECTIONS = {
    "relay_options": lambda s: s.relay_options(),
    "server_limits": lambda s: s.server_limits(),
    "balance_options": lambda s: s.balance_options(b"start"),
    "upstream_options": lambda s: s.upstream_options(),
    "power_options": lambda s: s.power_options(),
    "stall_options": lambda s: s.stall_options(),
}
#: Section fields no setting feeds: the prompt bytes hashed (a constant), the shared TLS
#: options (per upstream instead) and the tests' transport hook.
UNFED = {"prefix_bytes", "tls", "transport"}
#: A valid value other than the default, for settings whose type says too little.
EXAMPLES: dict[str, object] = {
    "models": ["extra-model"],
    "precision": ["m=fp8"],
    "kv_cache_dtype": ["m=q8_0"],
    "power_gpu": ["0=a"],
    "power_dcgm_url": "http://127.0.0.1:9400/metrics",
    "model_dir": "/tmp",
    "affinity_secret": SecretStr("replica-key"),
    "admin_api": "deny",
}


def leaves(obj: object, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted path, value) of every field of a section, nested sections opened."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and f.name not in UNFED:
            yield from leaves(value, f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}", value


def sections(settings: Settings) -> dict[str, object]:
    return {
        f"{name}.{path}": value
        for name, build in SECTIONS.items()
        for path, value in leaves(build(settings))
    }


def candidates(name: str) -> list[object]:
    """Values to try for `name`, the first valid one is taken."""
    field = Settings.model_fields[name]
    if name in EXAMPLES:
        return [EXAMPLES[name]]
    kind, default = field.annotation, field.default
    if kind is bool:
        return [not default]
    if typing.get_origin(kind) is typing.Literal:
        return [c for c in typing.get_args(kind) if c != default]
    if kind in (int, float):
        return [default + 1, default * 2 + 1, default - 1, 1, 0]
    if kind == int | None:
        return [1, 8123]
    return []


def changed_by(name: str, base: dict[str, object]) -> set[str] | None:
    """The section fields that change when setting `name` alone changes; None when no
    valid other value was found."""
    for value in candidates(name):
        try:
            settings = Settings(**{name: value})
        except ValidationError:
            continue
        now = sections(settings)
        return {path for path, v in now.items() if v != base[path]}
    return None


def leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def test_each_setting_has_one_name_into_its_section():
    base = sections(Settings())
    fed: set[str] = set()
    for name in Settings.model_fields:
        changed = changed_by(name, base)
        if changed is None:
            continue
        wrong = {p for p in changed if leaf(p) != name}
        assert not wrong, f"--{name.replace('_', '-')} reaches {sorted(wrong)} under another name"
        fed |= changed
    unnamed = {p for p in base if leaf(p) not in Settings.model_fields and leaf(p) not in UNFED}
    assert not unnamed, f"section fields named after no setting: {sorted(unnamed)}"
    # every section field named after a setting follows it (no setting left untried)
    assert {p for p in base if leaf(p) in Settings.model_fields} == fed


def test_the_examples_are_settings():
    assert set(EXAMPLES) <= set(Settings.model_fields)


def _keyword_renames(path: Path) -> list[str]:
    """`consumer(other=settings.name)`: a setting passed on under another name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.keyword) or node.arg is None:
            continue
        value = node.value
        if (
            isinstance(value, ast.Attribute)
            and isinstance(value.value, ast.Name)
            and value.value.id in ("s", "settings")
            and value.attr in Settings.model_fields
            and node.arg != value.attr
        ):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.arg}={value.attr}")
    return out


def test_no_setting_is_passed_on_under_another_name():
    found = [r for p in sorted((ROOT / "proxy").rglob("*.py")) for r in _keyword_renames(p)]
    assert not found, found
