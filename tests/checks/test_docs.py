"""The documentation keeps up with the code: every setting has a row in the README's
configuration table, every exported metric family a row in its metric table, every
command a row in its command table; user-facing texts use no words a user cannot look
up; and GPU power is read through NVIDIA's own package, not the deprecated shim."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib

import pytest

from proxy.measure.metrics import PREFIX, Metrics
from proxy.settings import Settings
from proxy.tools.cli import build_parser

from ..support.servers import ROOT

README = (ROOT / "README.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """The rows of the first table under a README heading, as lists of cells."""
    section = README.split(heading + "\n", 1)[1]
    rows, started = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


def code_names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_every_setting_has_a_row_in_the_configuration_table():
    rows = table_rows("## Configuration")
    flags = set().union(*(code_names(r[0]) for r in rows))
    envs = set().union(*(code_names(r[1]) for r in rows))
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert flag in flags or f"{flag} / --no-{flag[2:]}" in flags, flag
        assert "PHASEWATCH_" + name.upper() in envs, name
    for flag in flags:  # and no row for a setting that is gone
        base = flag.split(" / ")[0].removeprefix("--").replace("-", "_")
        assert base in Settings.model_fields, flag


def exported_families() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        if family.name.startswith(PREFIX):
            short = family.name.removeprefix(PREFIX)
            names.add(short + "_total" if family.type == "counter" else short)
    return names


def test_every_metric_family_has_a_row_in_the_metric_table():
    rows = table_rows("## Metric reference")
    documented = set().union(*(code_names(r[0]) for r in rows))
    exported = exported_families()
    assert "gpu_power_current_watts" in exported
    assert exported - documented == set(), "metrics without a README row"
    assert documented - exported == set(), "README rows for metrics that do not exist"


def test_every_command_and_the_status_page_are_in_the_command_table():
    rows = table_rows("## Using it")
    first = " ".join(r[0] for r in rows)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in sub.choices:
        assert f"`phasewatch {command}" in first, command
    assert "/phasewatch/" in first  # the status page
    text = " ".join(" ".join(r) for r in rows)
    assert "/metrics" in text and "/phasewatch/docs" in text


# --- words a user cannot look up ------------------------------------------------------------

#: Words that point at documents a user does not have.
JARGON = re.compile(r"\bseeds?'|\bSPEC\b|(?<!RFC \d{4} )§|methodology's", re.IGNORECASE)


def user_facing_texts() -> dict[str, str]:
    texts = {"README.md": README}
    for path in sorted((ROOT / "docs").glob("*.md")):
        texts[f"docs/{path.name}"] = path.read_text()
    texts["status.html"] = (ROOT / "proxy/services/static/status.html").read_text()
    for path in sorted((ROOT / "grafana/dashboards").glob("*.json")):
        texts[path.name] = path.read_text()
    parser = build_parser()
    texts["phasewatch --help"] = parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        texts[f"phasewatch {name} --help"] = command.format_help()
    return texts


@pytest.mark.parametrize("name", sorted(user_facing_texts()))
def test_no_words_a_user_cannot_look_up(name):
    text = user_facing_texts()[name]
    found = [m.group(0) for m in JARGON.finditer(text)]
    assert not found, f"{name}: {found}"


def test_the_benchmark_table_is_said_in_full_where_it_is_introduced():
    reports = (ROOT / "docs/reports.md").read_text().split("\n\n", 2)[1]
    for part in ("decode", "prefill ms/token", "~4K", "~16K", "TTFT at ~8K", "idle"):
        assert part in reports, part


# --- NVIDIA's own NVML bindings, not the deprecated shim --------------------------------------


def test_nvml_comes_from_nvidia_ml_py_and_nothing_hides_warnings():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    assert "nvidia-ml-py" in names and "pynvml" not in names
    # the `pynvml` module is NVIDIA's package's, and importing it warns about nothing
    assert importlib.metadata.packages_distributions()["pynvml"] == ["nvidia-ml-py"]
    res = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import pynvml"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    for path in (ROOT / "proxy").rglob("*.py"):
        text = path.read_text()
        assert "filterwarnings" not in text and "simplefilter" not in text, path
    for name, text in user_facing_texts().items():  # no docs telling to install the shim
        assert not re.search(r"(pip install|package)\W+pynvml\b", text), name
