"""Charts of a benchmark or a report, as PNG and SVG: ``phasewatch bench --plot DIR``
and ``phasewatch report --plot DIR``.

Four charts and an overview of all four (``overview.png``):

- ``decode`` — decode tok/s per model and precision; with bench runs, the bar is the
  median, the whisker the runs' min–max and the dots the runs themselves;
- ``prefill`` — prefill ms/token per precision at each prompt size (or prompt band);
- ``ttft`` — time to first token against prompt length, one line per precision;
- ``power`` — GPU watts per precision in each phase: idle, prefill, decode.

matplotlib is an optional extra (``pip install 'phasewatch[plot]'``); without it the
commands stop with one line saying so. The SVGs carry no date and a fixed id salt, so the
same result draws the same file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..measure.summary import model_family

#: Colours per precision, the baseline first (colour-blind-safe, matplotlib's tab10 order).
COLOURS = {
    "bf16": "#1f77b4",
    "fp16": "#1f77b4",
    "fp32": "#17becf",
    "fp8": "#ff7f0e",
    "int8": "#ff7f0e",
    "fp4": "#9467bd",
    "int4": "#2ca02c",
}
PHASES = (("idle", "#9e9e9e"), ("prefill", "#d62728"), ("decode", "#1f77b4"))


class PlotError(RuntimeError):
    pass


def require() -> None:
    """Fail with one clear line when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotError(
            "--plot needs matplotlib, which is not installed: pip install 'phasewatch[plot]'"
        ) from exc


@dataclass
class Series:
    """One model at one precision, as the charts need it."""

    label: str
    precision: str
    decode: dict | None = None  # stats: median, min, max, runs
    prefill: dict = field(default_factory=dict)  # prompt tokens -> stats of ms/token
    ttft: dict = field(default_factory=dict)  # prompt tokens -> stats of seconds
    power: dict = field(default_factory=dict)  # phase -> watts
    family: str = ""
    legend: str = ""  # set when every series is one model family: its precision alone


def _short(model: str, width: int = 24) -> str:
    """The model's name without its publisher, wrapped at hyphens to fit under a bar."""
    lines: list[str] = []
    for part in model.rsplit("/", 1)[-1].split("-"):
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += "-" + part
        else:
            lines.append(part)
    return "-\n".join(lines)


def _st(median, lo=None, hi=None, runs=None) -> dict | None:
    if median is None:
        return None
    return {
        "median": median,
        "min": median if lo is None else lo,
        "max": median if hi is None else hi,
        "runs": [r for r in (runs or []) if r is not None],
    }


def from_bench(result: dict) -> list[Series]:
    out = []
    for m in result["models"]:
        s = Series(f"{_short(m['model'])}\n{m['precision']}", m["precision"])
        s.family = model_family(m["model"])
        d = m["decode"].get("tok_s_stats")
        if d:
            s.decode = _st(d["median"], d["min"], d["max"], m["decode"].get("runs_tok_s"))
        for p in m["prefill"]:
            size = p.get("prompt_tokens") or p["target_tokens"]
            ms, tt = p.get("ms_per_token_stats"), p.get("ttft_s_stats")
            if ms:
                s.prefill[size] = _st(ms["median"], ms["min"], ms["max"])
            if tt:
                s.ttft[size] = _st(tt["median"], tt["min"], tt["max"], p.get("runs_ttft_s"))
        pw = m["power"]
        for phase in ("idle", "prefill", "decode"):
            if pw.get(f"{phase}_watts") is not None:
                s.power[phase] = pw[f"{phase}_watts"]
        out.append(s)
    return out


#: Representative prompt length of each band, for the report's TTFT line.
_BAND_TOKENS = {"0-2k": 1024, "2k-6k": 4096, "6k-12k": 8192, "12k-24k": 16384, "24k-64k": 40960}


def from_report(report) -> list[Series]:
    out = []
    for r in report.rows:
        s = Series(f"{_short(r.model)}\n{r.precision}", r.precision)
        s.family = r.family or model_family(r.model)
        s.decode = _st(r.decode_tok_s)
        for band, tokens in _BAND_TOKENS.items():
            if band in r.prefill_ms_per_token:
                s.prefill[tokens] = _st(r.prefill_ms_per_token[band])
            if band in r.ttft_s:
                s.ttft[tokens] = _st(r.ttft_s[band])
        for phase, value in (
            ("idle", r.idle_watts),
            ("prefill", r.prefill_watts),
            ("decode", r.decode_watts),
        ):
            if value is not None:
                s.power[phase] = value
        out.append(s)
    return out


def _size(tokens: int) -> str:
    return f"~{round(tokens / 1024)}K" if tokens >= 1024 else str(tokens)


def _legend(s: Series) -> str:
    return s.legend or s.label.replace("-\n", "-").replace("\n", " ")


def _baseline(series: list[Series]) -> Series | None:
    """The unquantised series the others are compared with (bf16, else fp16, fp32)."""
    for p in ("bf16", "fp16", "fp32"):
        for s in series:
            if s.precision == p and s.decode:
                return s
    return None


def _colour(s: Series) -> str:
    return COLOURS.get(s.precision, "#7f7f7f")


def _whiskers(ax, xs, stats, colour="#333333") -> None:
    lo = [st["median"] - st["min"] for st in stats]
    hi = [st["max"] - st["median"] for st in stats]
    if any(lo) or any(hi):
        ax.errorbar(
            xs,
            [st["median"] for st in stats],
            yerr=[lo, hi],
            fmt="none",
            ecolor=colour,
            elinewidth=1.2,
            capsize=4,
            zorder=3,
        )


def _decode(ax, series: list[Series], spread: bool) -> None:
    rows = [(s, s.decode) for s in series if s.decode is not None]
    xs = list(range(len(rows)))
    bars = ax.bar(
        xs, [d["median"] for _, d in rows], color=[_colour(s) for s, _ in rows], width=0.6, zorder=2
    )
    if spread:
        _whiskers(ax, xs, [d for _, d in rows])
        for x, (_, d) in zip(xs, rows):
            ax.scatter(
                [x] * len(d["runs"]),
                d["runs"],
                s=14,
                color="white",
                edgecolors="#333333",
                linewidths=0.8,
                zorder=4,
            )
    base = _baseline(series)
    for b, (s, d) in zip(bars, rows):
        text = f"{d['median']:.0f}"
        if base is not None and base.decode and s is not base:
            text += f"\n{d['median'] / base.decode['median']:.2f}× {base.precision}"
        ax.annotate(
            text,
            (b.get_x() + b.get_width() / 2, d["max"]),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xticks(xs, [s.label for s, _ in rows], fontsize=8)
    ax.set_ylabel("tokens / s (one stream)")
    ax.set_title("Decode speed" + (" — median, min–max of the runs" if spread else ""))
    ax.set_ylim(0, max(max((d["max"] for _, d in rows), default=1) * 1.25, 1))


def _prefill(ax, series: list[Series], spread: bool) -> None:
    sizes = sorted({k for s in series for k in s.prefill})
    rows = [s for s in series if s.prefill]
    width = 0.8 / max(1, len(rows))
    for j, s in enumerate(rows):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i, k in enumerate(sizes) if k in s.prefill]
        sts = [s.prefill[k] for k in sizes if k in s.prefill]
        ax.bar(
            xs,
            [st["median"] for st in sts],
            width=width * 0.92,
            color=_colour(s),
            label=_legend(s),
            zorder=2,
        )
        if spread:
            _whiskers(ax, xs, sts)
    ax.set_xticks(range(len(sizes)), [f"{_size(k)} tokens" for k in sizes])
    ax.set_ylabel("ms per prompt token (lower is faster)")
    ax.set_title("Prefill cost by prompt length")
    top = max((st["max"] for s in rows for st in s.prefill.values()), default=1)
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=7, loc="upper center", ncols=min(3, max(1, len(rows))), frameon=False)


def _ttft(ax, series: list[Series], spread: bool) -> None:
    for s in series:
        ks = sorted(s.ttft)
        if not ks:
            continue
        meds = [s.ttft[k]["median"] for k in ks]
        ax.plot(ks, meds, marker="o", color=_colour(s), label=_legend(s), zorder=3)
        if spread:
            _whiskers(ax, ks, [s.ttft[k] for k in ks], _colour(s))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds to the first token")
    ax.set_title("Time to first token against prompt length")
    ks = sorted({k for s in series for k in s.ttft})
    if ks:
        ax.set_xticks(ks, [_size(k) for k in ks])
    ax.set_xlim(0, (max(ks) if ks else 1) * 1.08)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", frameon=False)


def _power(ax, series: list[Series]) -> bool:
    rows = [s for s in series if s.power]
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no GPU power sampled\n(bench through phasewatch with a power source)",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="#666666",
        )
        ax.set_axis_off()
        ax.set_title("GPU power by phase")
        return False
    width = 0.8 / len(PHASES)
    for j, (phase, colour) in enumerate(PHASES):
        xs = [i + (j - 1) * width for i, s in enumerate(rows) if phase in s.power]
        vals = [s.power[phase] for s in rows if phase in s.power]
        bars = ax.bar(xs, vals, width=width * 0.92, color=colour, label=phase, zorder=2)
        for b, v in zip(bars, vals):
            ax.annotate(
                f"{v:.0f}",
                (b.get_x() + b.get_width() / 2, v),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(rows)), [s.label for s in rows], fontsize=8)
    ax.set_ylabel("watts")
    ax.set_title("GPU power by phase")
    ax.legend(fontsize=8, frameon=False, ncols=3, loc="upper right")
    ax.set_ylim(0, max(v for s in rows for v in s.power.values()) * 1.2)
    return True


def draw(series: list[Series], out_dir: str, title: str, spread: bool) -> list[str]:
    """Write the charts of `series` into `out_dir`; returns the paths written."""
    require()
    if len({s.family for s in series}) == 1 and len({s.precision for s in series}) == len(series):
        for s in series:  # one model at several precisions: the legends name precisions
            s.legend = s.precision
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    style: dict = {
        "svg.hashsalt": "phasewatch",
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "axes.grid.axis": "y",
        "grid.alpha": 0.3,
        "font.size": 9,
    }

    def save(fig, name: str) -> None:
        for ext in ("png", "svg"):
            path = os.path.join(out_dir, f"{name}.{ext}")
            # the title (and its caveats: one run, other traffic) in the file's metadata too
            meta = (
                {"Date": None, "Title": title}
                if ext == "svg"
                else {"Software": None, "Title": title}
            )
            fig.savefig(path, dpi=110, bbox_inches="tight", metadata=meta)
            written.append(path)
        plt.close(fig)

    with plt.rc_context(style):
        for name, fn in (("decode", _decode), ("prefill", _prefill), ("ttft", _ttft)):
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            fn(ax, series, spread)
            fig.suptitle(title, fontsize=8, color="#555555", y=0.995)
            save(fig, name)
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        _power(ax, series)
        fig.suptitle(title, fontsize=8, color="#555555", y=0.995)
        save(fig, "power")
        fig, axes = plt.subplots(2, 2, figsize=(12.5, 8.2))
        _decode(axes[0][0], series, spread)
        _prefill(axes[0][1], series, spread)
        _ttft(axes[1][0], series, spread)
        _power(axes[1][1], series)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        save(fig, "overview")
    return written


def bench_charts(result: dict, out_dir: str) -> list[str]:
    if result["repetitions"] > 1:
        runs = f"median of {result['repetitions']} runs (min–max whiskers)"
    else:
        runs = "one run per figure (no median, no spread)"
    title = f"phasewatch bench — {result['url']} — {runs}"
    if any(m.get("other_traffic") for m in result["models"]):
        title += " — ⚠ other traffic on the engine during some runs"
    return draw(from_bench(result), out_dir, title, spread=result["repetitions"] > 1)


def report_charts(report, out_dir: str) -> list[str]:
    title = f"phasewatch report — {report.source or 'metrics'} — medians of live traffic"
    return draw(from_report(report), out_dir, title, spread=False)
