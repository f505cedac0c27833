"""``phasewatch bench --compare A.json B.json``: two bench results side by side.

Per model × precision × figure: A's and B's median with the min–max of their runs, the
change from A to B, and whether it is beyond the runs' spread (the two ranges do not
overlap), better or worse for that figure (more tok/s is better; fewer ms/token, seconds,
watts and joules are). Models in one result only are listed under the table.
"""

from __future__ import annotations

import json

from .stats import legacy_stats, num, size_label

HIGHER_IS_BETTER = ("decode tok/s", "at once")


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise ValueError(f"{path}: not a phasewatch bench result (no 'models' list)")
    return data


def figures(m: dict) -> dict[str, dict | None]:
    """Every figure of one model's result, with its runs' stats."""
    d = m.get("decode") or {}
    out = {
        "decode tok/s": d.get("tok_s_stats") or legacy_stats(d.get("tok_s"), d.get("runs_tok_s"))
    }
    for p in m.get("prefill") or []:
        size = size_label(p["target_tokens"])
        out[f"prefill ms/tok {size}"] = p.get("ms_per_token_stats") or legacy_stats(
            p.get("ms_per_token")
        )
        out[f"TTFT {size} s"] = p.get("ttft_s_stats") or legacy_stats(
            p.get("ttft_s"), p.get("runs_ttft_s")
        )
    for c in m.get("concurrency") or []:
        out[f"{c['concurrency']} at once tok/s"] = c.get("aggregate_tok_s_stats") or legacy_stats(
            c.get("aggregate_tok_s")
        )
    pw = m.get("power") or {}
    out["decode W"] = pw.get("decode_watts_stats") or legacy_stats(pw.get("decode_watts"))
    out["idle W"] = legacy_stats(pw.get("idle_watts"))
    out["J/tok"] = pw.get("joules_per_token_stats") or legacy_stats(pw.get("joules_per_token"))
    return out


def _value(st: dict | None) -> str:
    if not st:
        return "—"
    if st.get("n", 1) < 2:
        return num(st["median"])
    return f"{num(st['median'])} ({num(st['min'])}–{num(st['max'])})"


def diff(a: dict, b: dict) -> list[dict]:
    """One row per figure both results have."""
    rows = []
    index_b = {(m["model"], m.get("precision")): m for m in b["models"]}
    for ma in a["models"]:
        mb = index_b.get((ma["model"], ma.get("precision")))
        if mb is None:
            continue
        fb = figures(mb)
        for name, sa in figures(ma).items():
            sb = fb.get(name)
            if not sa or not sb:
                continue
            change = (sb["median"] - sa["median"]) / sa["median"] if sa["median"] else None
            known = sa.get("n", 1) >= 2 and sb.get("n", 1) >= 2
            beyond = known and (sb["min"] > sa["max"] or sb["max"] < sa["min"])
            higher = any(h in name for h in HIGHER_IS_BETTER)
            verdict = None
            if beyond and change:
                verdict = "better" if (change > 0) == higher else "worse"
            rows.append(
                {
                    "model": ma["model"],
                    "precision": ma.get("precision"),
                    "figure": name,
                    "a": sa,
                    "b": sb,
                    "change": change,
                    "beyond_spread": beyond if known else None,
                    "verdict": verdict,
                }
            )
    return rows


def render(a: dict, b: dict, a_name: str, b_name: str) -> str:
    rows = diff(a, b)
    out = [
        f"phasewatch bench --compare: A = {a_name} ({a.get('url', '?')}), "
        f"B = {b_name} ({b.get('url', '?')})",
        "",
        "| model | precision | figure | A | B | change | beyond the runs' spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ch = "—" if r["change"] is None else f"{r['change'] * 100:+.1f}%"
        if r["beyond_spread"] is None:
            beyond = "n/a (single run)"
        elif r["beyond_spread"]:
            beyond = f"yes, {r['verdict']}" if r["verdict"] else "yes"
        else:
            beyond = "no"
        out.append(
            f"| {r['model']} | {r['precision']} | {r['figure']} | {_value(r['a'])} | "
            f"{_value(r['b'])} | {ch} | {beyond} |"
        )
    ka = {(m["model"], m.get("precision")) for m in a["models"]}
    kb = {(m["model"], m.get("precision")) for m in b["models"]}
    out.append("")
    for label, only in (("A", ka - kb), ("B", kb - ka)):
        for model, prec in sorted(only, key=str):
            out.append(f"- only in {label}: {model} ({prec})")
    out.append(
        "- A and B: median (min–max of the runs). Beyond the spread: B's runs all lie outside "
        "A's range; within it, the change is noise at these repetitions."
    )
    return "\n".join(out) + "\n"
