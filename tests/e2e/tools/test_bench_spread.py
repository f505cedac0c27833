"""`phasewatch bench`: every figure with the spread of its runs, warnings when runs
disagree or other traffic shares the engine, idle power, `--compare` and `--plot`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from proxy.tools.bench import spread, stats, table, warnings
from proxy.tools.bench.compare import diff, render

from ...support.servers import ROOT


def _result(decode_runs=(150.0, 130.0, 101.8), traffic=None) -> dict:
    """A bench result as --output writes it, for one int4 model."""
    st = stats(decode_runs)
    return {
        "url": "http://engine",
        "repetitions": 3,
        "seconds": 12.0,
        "max_spread": 0.1,
        "method": "median of repetitions",
        "models": [
            {
                "model": "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
                "precision": "int4",
                "quant": "AWQ",
                "token_counting": "exact",
                "decode": {
                    "tok_s": st["median"],
                    "tok_s_stats": st,
                    "runs_tok_s": list(decode_runs),
                },
                "prefill": [
                    {
                        "target_tokens": 4096,
                        "prompt_tokens": 4096,
                        "ttft_s": 0.73,
                        "ttft_s_stats": stats([0.72, 0.73, 0.74]),
                        "ms_per_token": 0.178,
                        "ms_per_token_stats": stats([0.176, 0.178, 0.181]),
                        "runs_ttft_s": [0.72, 0.73, 0.74],
                    }
                ],
                "concurrency": [],
                "power": {
                    "decode_watts": 240.0,
                    "decode_watts_stats": stats([239.0, 240.0, 241.0]),
                    "idle_watts": 22.0,
                    "joules_per_token": 1.6,
                    "joules_per_token_stats": stats([1.59, 1.6, 1.62]),
                },
                "baseline": None,
                "decode_speedup": None,
                "prefill_speedup": None,
                "power_saving": None,
                "notes": [],
                "other_traffic": traffic or {},
                "seconds": {"decode": 3.0, "prefill": 2.2, "prompts": 0.4},
            }
        ],
    }


def test_every_figure_shows_min_median_max():
    r = _result()
    r["warnings"] = warnings(r, 0.1)
    out = table(r)
    row = next(line for line in out.splitlines() if line.startswith("| hugging-quants"))
    assert "| 130.0 (102–150) |" in row  # decode: median (min–max)
    assert "| 0.178 (0.176–0.181) |" in row and "| 0.73 s (0.720–0.740) |" in row
    assert "| 240 (239–241) | 22 | 1.60 (1.59–1.62) |" in row  # decode W, idle W, J/tok
    assert "idle W" in out.splitlines()[2]
    assert "Time: 12 s in all: decode 3 s, prefill 2 s, prompts 0 s." in out


def test_a_wide_spread_is_a_warning():
    assert spread(stats([150.0, 130.0, 101.8])) == pytest.approx((150 - 101.8) / 130)
    w = warnings(_result(), 0.1)
    assert len(w) == 1 and "decode tok/s 37% (102–150)" in w[0] and "int4" in w[0]
    assert warnings(_result(), 0.5) == []  # within a looser --max-spread
    assert warnings(_result((130.0, 131.0, 129.5)), 0.1) == []
    out = table({**_result(), "warnings": w})
    assert "Warnings:\n- ⚠ " in out


def test_other_traffic_is_a_warning():
    r = _result((130.0, 131.0, 129.5), {"decode": ["run 2: 3 requests not the bench's"]})
    w = warnings(r, 0.1)
    assert len(w) == 1
    assert "other traffic on the engine during the decode runs" in w[0]
    assert "3 requests not the bench's" in w[0]


def test_compare_two_runs():
    a = _result((130.0, 131.0, 129.5))
    b = copy.deepcopy(a)
    m = b["models"][0]
    m["decode"]["tok_s_stats"] = stats([150.0, 151.0, 149.0])  # faster, beyond the spread
    m["prefill"][0]["ms_per_token_stats"] = stats([0.177, 0.179, 0.18])  # within
    rows = {r["figure"]: r for r in diff(a, b)}
    d = rows["decode tok/s"]
    assert d["change"] == pytest.approx(150 / 130 - 1) and d["beyond_spread"] is True
    assert d["verdict"] == "better"
    p = rows["prefill ms/tok ~4K"]
    assert p["beyond_spread"] is False and p["verdict"] is None
    assert rows["idle W"]["beyond_spread"] is None  # one value each: no spread to compare
    text = render(a, b, "a.json", "b.json")
    assert "| decode tok/s | 130 (130–131) | 150 (149–151) | +15.4% | yes, better |" in text
    assert "| prefill ms/tok ~4K |" in text and "| no |" in text


def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_compare_from_the_command_line(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result((130.0, 131.0, 129.5))))
    other = _result((100.0, 101.0, 99.0))
    other["models"].append(
        {**copy.deepcopy(other["models"][0]), "model": "x/other", "precision": "bf16"}
    )
    b.write_text(json.dumps(other))
    res = _cli("bench", "--compare", str(a), str(b))
    assert res.returncode == 0, res.stderr
    assert "| decode tok/s | 130 (130–131) | 100 (99.0–101) | -23.1% | yes, worse |" in res.stdout
    assert "- only in B: x/other (bf16)" in res.stdout
    (tmp_path / "bad.json").write_text("[]")
    bad = _cli("bench", "--compare", str(a), str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "not a phasewatch bench result" in bad.stderr


def test_plot_writes_png_and_svg(tmp_path):
    from proxy.tools.plots import bench_charts

    r = _result()
    written = bench_charts(r, str(tmp_path / "a"))
    names = sorted(p.rsplit("/", 1)[-1] for p in written)
    assert names == sorted(
        f"{c}.{e}"
        for c in ("decode", "prefill", "ttft", "power", "overview")
        for e in ("png", "svg")
    )
    for p in written:
        data = open(p, "rb").read()
        assert len(data) > 5000
        assert data.startswith(b"\x89PNG") if p.endswith(".png") else b"<svg" in data[:400]
    again = bench_charts(r, str(tmp_path / "b"))  # the same result draws the same SVG
    for p, q in zip(written, again):
        if p.endswith(".svg"):
            assert open(p, "rb").read() == open(q, "rb").read()


def test_plot_without_matplotlib_is_one_clear_line(tmp_path):
    """Run the command line with matplotlib made unimportable."""
    src = tmp_path / "r.json"
    src.write_text(json.dumps(_result()))
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from proxy.tools.cli import main\n"
        f"sys.exit(main(['bench', '--url', 'http://127.0.0.1:9', '--plot', {str(tmp_path / 'p')!r}]))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr == (
        "phasewatch bench: --plot needs matplotlib, which is not installed: "
        "pip install 'phasewatch[plot]'\n"
    )
    code = code.replace(
        "'bench', '--url', 'http://127.0.0.1:9'", "'report', '--from', 'http://127.0.0.1:9'"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith(
        "phasewatch report: --plot needs matplotlib"
    )
