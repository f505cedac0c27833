"""The bench's result as a table, and the warnings that make a figure doubtful."""

from __future__ import annotations

from .stats import cell, legacy_stats, num, size_label, spread


#: Figures whose spread is checked, with the label a warning uses.
def _figures(m: dict):
    yield "decode tok/s", m["decode"].get("tok_s_stats")
    for p in m["prefill"]:
        yield f"prefill ms/tok {size_label(p['target_tokens'])}", p.get("ms_per_token_stats")
        yield f"TTFT {size_label(p['target_tokens'])}", p.get("ttft_s_stats")
    for c in m["concurrency"]:
        yield f"{c['concurrency']} at once tok/s", c.get("aggregate_tok_s_stats")
    yield "decode W", m["power"].get("decode_watts_stats")


def warnings(result: dict, max_spread: float) -> list[str]:
    """What makes a figure doubtful: runs that disagree, other traffic on the engine."""
    out = []
    for m in result["models"]:
        wide = []
        for label, st in _figures(m):
            sp = spread(st)
            if sp is not None and sp > max_spread and not label.startswith("TTFT"):
                wide.append(f"{label} {sp * 100:.0f}% ({num(st['min'])}–{num(st['max'])})")
        if wide:
            out.append(
                f"{m['model']} ({m['precision']}): runs differ by more than --max-spread "
                f"{max_spread * 100:.0f}% of their median: {', '.join(wide)}"
                + (
                    " (the TTFTs of the same runs alike)"
                    if any("prefill" in w for w in wide)
                    else ""
                )
                + "; more --repeat, or a quieter engine and client machine"
            )
    rate = result.get("demo_traffic_rate") or 0.0
    if rate > 0:  # the demo's own traffic: one line, whatever it touched
        out.append(
            f"this is `phasewatch demo` with its traffic generator on ({rate:g} requests/s), "
            "which skews every figure: restart it with `phasewatch demo --rate 0` to bench it"
        )
        return out
    # other traffic: one warning for the whole bench, naming each scenario it touched
    busy = [
        f"the {scenario} runs of {m['model']} ({m['precision']}) ("
        + "; ".join(seen[:3])
        + (f"; {len(seen) - 3} more" if len(seen) > 3 else "")
        + ")"
        for m in result["models"]
        for scenario, seen in m.get("other_traffic", {}).items()
    ]
    if busy:
        out.append(
            "other traffic on the engine during "
            + ", ".join(busy)
            + ": those figures include that load (bench a quiet engine)"
        )
    return out


def runs_phrase(repetitions: int) -> str:
    """What each figure is: a median (min–max) of several runs, or a single run."""
    if repetitions == 1:
        return "one run per figure (no median, no spread: --repeat 3 for those)"
    return f"median (min–max) of {repetitions} runs"


def _f(v, fmt="{:.1f}", none="—"):
    return none if v is None else fmt.format(v)


def table(result: dict) -> str:
    models = result["models"]
    sizes = sorted({p["target_tokens"] for m in models for p in m["prefill"]})
    levels = sorted({c["concurrency"] for m in models for c in m["concurrency"]})
    power = any(m["power"] for m in models)
    na = "—" if power else "n/a"
    out = [
        f"phasewatch bench: {result['url']}, {runs_phrase(result['repetitions'])} "
        f"({result['seconds']:.0f} s)",
        "",
    ]
    head = ["model", "precision", "decode tok/s"]
    head += [f"prefill ms/tok {size_label(s)}" for s in sizes]
    head += [f"TTFT {size_label(s)}" for s in sizes]
    head += ["decode W", "idle W", "J/tok", "decode speed-up", "prefill speed-up", "power saving"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for m in models:
        pre = {p["target_tokens"]: p for p in m["prefill"]}
        prec = m["precision"] + (
            f" ({m['quant']})" if m["quant"] and m["quant"].lower() != m["precision"] else ""
        )
        d = m["decode"]
        cells = [m["model"], prec, cell(d.get("tok_s_stats") or legacy_stats(d.get("tok_s")))]
        cells += [
            cell(pre[s].get("ms_per_token_stats"), "{:.3f}") if s in pre else "—" for s in sizes
        ]
        cells += [
            cell(pre[s].get("ttft_s_stats"), "{:.2f}", " s") if s in pre else "—" for s in sizes
        ]
        pw = m["power"]
        cells += [
            cell(pw.get("decode_watts_stats"), "{:.0f}", none=na),
            _f(pw.get("idle_watts"), "{:.0f}", na),
            cell(pw.get("joules_per_token_stats"), "{:.2f}", none=na),
            _f(m["decode_speedup"], "{:.2f}×"),
            _f(m["prefill_speedup"], "{:.2f}×"),
            _f(None if m["power_saving"] is None else m["power_saving"] * 100, "{:.0f}%", na),
        ]
        out.append("| " + " | ".join(cells) + " |")
    if levels:
        out += [
            "",
            "Concurrency sweep (aggregate tok/s"
            + (", min–max of the runs" if result["repetitions"] > 1 else "")
            + "; per-stream decode tok/s in square brackets):",
            "",
        ]
        out.append("| model | precision | " + " | ".join(f"{c} at once" for c in levels) + " |")
        out.append("|" + "---|" * (2 + len(levels)))
        for m in models:
            by = {c["concurrency"]: c for c in m["concurrency"]}
            cells = [
                f"{cell(by[c].get('aggregate_tok_s_stats'))} [{_f(by[c]['per_stream_tok_s'])}]"
                if c in by
                else "—"
                for c in levels
            ]
            out.append(f"| {m['model']} | {m['precision']} | " + " | ".join(cells) + " |")
    if result.get("warnings"):
        out += ["", "Warnings:"]
        out += [f"- ⚠ {w}" for w in result["warnings"]]
    out.append("")
    for m in models:
        out.append(f"- {m['model']}: prompt lengths {m['token_counting']}.")
        for n in m["notes"]:
            out.append(f"- {m['model']}: {n}")
    out.append("- " + result["method"] + ".")
    sensor = result.get("power_sensor") or []
    if not power:
        if sensor:  # through phasewatch: it says why it is not sampling
            out += [f"- {ln}" for ln in sensor]
        else:
            out.append("- Power: n/a (not benched through phasewatch, which samples GPU power).")
    else:
        out.append(
            "- decode W: the GPU's energy over each decode run's decode window / its length, "
            "from the sensor below; idle W: over a pause with nothing sent (--idle-seconds); "
            "J/tok = decode W / decode tok/s."
        )
        out += [f"- {ln}" for ln in sensor]
    secs: dict[str, float] = {}
    for m in models:
        for k, v in (m.get("seconds") or {}).items():
            if k != "tokenizer_calls":
                secs[k] = secs.get(k, 0.0) + v
    if secs:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(secs.items(), key=lambda kv: -kv[1]))
        out.append(f"- Time: {result['seconds']:.0f} s in all: {parts}.")
    return "\n".join(out) + "\n"
