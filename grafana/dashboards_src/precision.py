"""The Precision comparison dashboard: the benchmark table, one column per precision and
model family (the same figures as `phasewatch report`), and the same figures over time."""

from __future__ import annotations

from .common import (
    GREEN,
    RED,
    SEL,
    TOKS,
    YELLOW,
    Dash,
    base_vars,
    custom_var,
    fam,
    override,
    source_var,
    stat_panel,
    steps,
    table_panel,
    target,
    timeseries_panel,
)


def _sel(precision_matcher: str) -> str:
    return f'upstream=~"$upstream", model=~"$model", {precision_matcher}'


def figures(pm: str, rng: str = "$__range") -> dict[str, str]:
    """The benchmark table's figures, one series per model family and precision, for
    precision matcher pm (the same figures as `phasewatch report`)."""
    s = _sel(pm)
    per_gpu = "upstream, model, precision, gpu"
    by = "family, precision"
    idle_per_model = (
        f'sum by (upstream, model, precision) (sum by ({per_gpu}) (increase(phasewatch_gpu_power_sample_watts_sum{{{s}, state="idle"}}[{rng}]))'
        f' / sum by ({per_gpu}) (increase(phasewatch_gpu_power_sample_watts_count{{{s}, state="idle"}}[{rng}])))'
    )

    def median(metric: str, matchers: str) -> str:
        return (
            f"histogram_quantile(0.5, sum by ({by}, le) "
            f"({fam(f'increase({metric}_bucket{{{s}, {matchers}}}[{rng}])')}))"
        )

    def mean(metric: str, matchers: str) -> str:
        return (
            f"sum by ({by}) ({fam(f'increase({metric}_sum{{{s}, {matchers}}}[{rng}])')})"
            f" / sum by ({by}) ({fam(f'increase({metric}_count{{{s}, {matchers}}}[{rng}])')})"
        )

    out = {
        "decode": median("phasewatch_decode_tokens_per_second", 'source="$source"'),
        "prefill4k": "1000 / "
        + median("phasewatch_prefill_tokens_per_second", 'source="$source", prompt_band="2k-6k"'),
        "prefill16k": "1000 / "
        + median("phasewatch_prefill_tokens_per_second", 'source="$source", prompt_band="12k-24k"'),
        "ttft8k": median("phasewatch_ttft_seconds", 'prompt_band="6k-12k"'),
        "decode_watts": mean("phasewatch_gpu_power_watts", 'phase="decode"'),
        "idle_watts": f"avg by ({by}) ({fam(idle_per_model)})",
    }
    # joules_per_token_at_decode: decode W / decode tok/s of the same family and precision
    out["joules"] = f"({out['decode_watts']}) / ({out['decode']})"
    return out


def build() -> dict:
    d = Dash(
        "phasewatch-precision",
        "phasewatch / Precision comparison",
        "The benchmark table, one column per precision: decode tok/s, prefill "
        "ms/token at ~4K and ~16K prompts, TTFT at ~8K, power at decode load, idle power, "
        "J/token, and decode speed-up and power saving relative to a bf16/fp16 baseline.",
        ["precision"],
        base_vars()
        + [
            source_var(),
            custom_var(
                "baseline",
                "Baseline precision",
                ["bf16", "fp16", "fp32", "fp8"],
                "bf16",
                "The precision speed-up and power saving are relative to.",
            ),
        ],
    )
    f = figures('precision=~"$precision"')
    b = figures('precision="$baseline"')
    speedup = f"{f['decode']} / on (family) group_left () {b['decode']}"
    saving = f"1 - ({f['decode_watts']}) / on (family) group_left () ({b['decode_watts']})"

    rows = [
        (
            "decode",
            "Decode tok/s (median)",
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            1,
            "Median decode tokens/s over the time range. Memory-bandwidth-bound: ~ effective "
            "bandwidth / weight bytes, so int4 decodes ~2.5-3.5x faster than bf16.",
        ),
        (
            "prefill4k",
            "Prefill ms/token, ~4K prompts",
            "ms",
            steps(GREEN, (1, YELLOW), (5, RED)),
            3,
            "1000 / median prefill tokens/s for prompts of 2K-6K tokens (prompt_band 2k-6k). "
            "Compute-bound: precision changes it only ~1.2-1.5x.",
        ),
        (
            "prefill16k",
            "Prefill ms/token, ~16K prompts",
            "ms",
            steps(GREEN, (1, YELLOW), (5, RED)),
            3,
            "1000 / median prefill tokens/s for prompts of 12K-24K tokens (prompt_band 12k-24k). "
            "Higher than at ~4K: attention grows with the context.",
        ),
        (
            "ttft8k",
            "TTFT, ~8K prompts (median)",
            "s",
            steps(GREEN, (2, YELLOW), (5, RED)),
            2,
            "Median time to first token for prompts of 6K-12K tokens (prompt_band 6k-12k).",
        ),
        (
            "decode_watts",
            "Power at decode load",
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            0,
            "Mean GPU power over requests' decode windows (the upstream's GPUs summed). Lower "
            "precision reads fewer bytes per token and draws less.",
        ),
        (
            "idle_watts",
            "Idle power",
            "watt",
            steps(GREEN, (50, YELLOW), (100, RED)),
            0,
            "Mean power of a model's GPUs while phasewatch had nothing in flight on them "
            "(GPUs mapped to models with --power-gpu GPU=MODEL; 'all' GPUs show as their upstream's).",
        ),
        (
            "joules",
            "Energy per token at decode load",
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            3,
            "joules_per_token_at_decode: power at decode load / median decode tok/s, per model "
            "family and precision over the time range (the status page's and phasewatch "
            "report's J/tok at decode). Idle and prefill are not in it, so it compares "
            "precisions like with like; the all-in figure (idle included) is on the Power & "
            "energy dashboard.",
        ),
    ]
    d.row("What to report: one column per precision")
    for key, title, unit, th, dec, desc in rows:
        d.add(
            stat_panel(
                title,
                desc,
                [target(f[key], "{{family}} {{precision}}", instant=True)],
                unit,
                th,
                decimals=dec,
            ),
            w=8,
            h=5,
        )
    d.add(
        stat_panel(
            "Decode speed-up vs baseline",
            "Median decode tok/s of each precision over the "
            "baseline precision's of the same model family (variable 'Baseline precision', "
            "default bf16).",
            [target(speedup, "{{family}} {{precision}}", instant=True)],
            "suffix:x",
            steps(RED, (0.95, YELLOW), (1.2, GREEN)),
            decimals=2,
        ),
        w=8,
        h=5,
    )
    d.add(
        stat_panel(
            "Power saving at decode vs baseline",
            "1 - decode-load power of each precision / "
            "the baseline precision's of the same model family. Positive: draws less than "
            "the baseline.",
            [target(saving, "{{family}} {{precision}}", instant=True)],
            "percentunit",
            steps(RED, (0, YELLOW), (0.1, GREEN)),
            decimals=0,
        ),
        w=8,
        h=5,
    )

    d.row("As a table")
    names = {
        "decode": "decode tok/s",
        "prefill4k": "prefill ms/tok ~4K",
        "prefill16k": "prefill ms/tok ~16K",
        "ttft8k": "TTFT ~8K (s)",
        "decode_watts": "decode W",
        "idle_watts": "idle W",
        "joules": "J/token at decode",
        "speedup": "decode speed-up",
        "saving": "power saving",
    }
    exprs = {
        **{
            k: f[k]
            for k in (
                "decode",
                "prefill4k",
                "prefill16k",
                "ttft8k",
                "decode_watts",
                "idle_watts",
                "joules",
            )
        },
        "speedup": speedup,
        "saving": saving,
    }
    targets = [target(e, k, instant=True, fmt="table") for k, e in exprs.items()]
    rename = {f"Value #{chr(ord('A') + i)}": names[k] for i, k in enumerate(exprs)}
    units = {
        "decode": TOKS,
        "prefill4k": "ms",
        "prefill16k": "ms",
        "ttft8k": "s",
        "decode_watts": "watt",
        "idle_watts": "watt",
        "joules": "joule",
        "speedup": "suffix:x",
        "saving": "percentunit",
    }
    decimals = {
        "decode": 1,
        "prefill4k": 3,
        "prefill16k": 3,
        "ttft8k": 2,
        "decode_watts": 0,
        "idle_watts": 0,
        "joules": 3,
        "speedup": 2,
        "saving": 0,
    }
    overrides = [override(names[k], unit=units[k], decimals=decimals[k]) for k in exprs]
    d.add(
        table_panel(
            "What to report, per precision",
            "The same figures as above, a row per model family and precision (merge of instant "
            "queries over the "
            "dashboard's time range). Empty cells: no requests of that kind in the range (e.g. no "
            "~16K prompts) or no power source.",
            targets,
            overrides,
            steps(GREEN),
            organize={
                "excludeByName": {"Time": True},
                "indexByName": {"family": 0, "precision": 1},
                "renameByName": rename,
            },
        ),
        w=24,
        h=7,
    )

    d.row("Over time")
    d.add(
        timeseries_panel(
            "Median decode rate by precision",
            "5 min median decode tokens/s (recording rule), per model family and precision.",
            [
                target(
                    "histogram_quantile(0.5, sum by (family, precision, le) ("
                    + fam(
                        f'phasewatch:decode_tokens_per_second_bucket:rate5m{{{SEL}, source="$source"}}'
                    )
                    + "))",
                    "{{family}} {{precision}}",
                )
            ],
            TOKS,
            steps(RED, (10, YELLOW), (25, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Median prefill rate by precision",
            "5 min median prefill tokens/s (recording rule), per model family and precision, "
            "all prompt lengths.",
            [
                target(
                    "histogram_quantile(0.5, sum by (family, precision, le) ("
                    + fam(
                        f'phasewatch:prefill_tokens_per_second_bucket:rate5m{{{SEL}, source="$source"}}'
                    )
                    + "))",
                    "{{family}} {{precision}}",
                )
            ],
            TOKS,
            steps(RED, (100, YELLOW), (1000, GREEN)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "TTFT p95 by precision",
            "5 min p95 time to first token per model family and precision, all prompt lengths "
            "(recording rule; the slowest upstream of each).",
            [
                target(
                    f"max by (family, precision) ({fam(f'phasewatch:ttft_seconds:p95_5m{{{SEL}}}')})",
                    "{{family}} {{precision}}",
                )
            ],
            "s",
            steps(GREEN, (1, YELLOW), (2, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Energy per token at decode load by precision",
            "joules_per_token_at_decode over 5 min (recording rule "
            "phasewatch:joules_per_token_at_decode:rate5m: power at decode load / median decode "
            "tok/s), per model family and precision. Idle and prefill are not in it.",
            [
                target(
                    "avg by (family, precision) ("
                    + fam(f"phasewatch:joules_per_token_at_decode:rate5m{{{SEL}}}")
                    + ")",
                    "{{family}} {{precision}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )

    d.row("Memory: KV cache by precision")
    kv = _sel('precision=~"$precision", kv_dtype!="unknown"')
    precision_sel = _sel('precision=~"$precision"')
    d.add(
        stat_panel(
            "KV-cache bytes per token by precision",
            "Bytes one token adds to the KV cache (2 x layers x kv_heads x head_dim x bytes "
            "per cache element), per weight precision and cache element type. Weight "
            "quantisation leaves it unchanged; an fp8 (or q8_0) cache halves it: the memory "
            "side of the physics. Sliding-window models: the full-attention upper bound.",
            [
                target(
                    f"max by (precision, kv_dtype) (phasewatch_model_kv_bytes_per_token{{{kv}}})",
                    "{{precision}} (cache {{kv_dtype}})",
                    instant=True,
                )
            ],
            "bytes",
            steps(GREEN, (262144, YELLOW), (1048576, RED)),
            decimals=0,
        ),
        w=12,
        h=6,
    )
    d.add(
        stat_panel(
            "Median KV-cache bytes per request by precision",
            "Median bytes a request held in the KV cache at its end, per precision, over the "
            "time range.",
            [
                target(
                    "histogram_quantile(0.5, sum by (precision, le) (increase(phasewatch_kv_cache_bytes_bucket"
                    f"{{{precision_sel}}}[$__range])))",
                    "{{precision}}",
                    instant=True,
                )
            ],
            "bytes",
            steps(GREEN, (1e9, YELLOW), (8e9, RED)),
            decimals=0,
        ),
        w=12,
        h=6,
    )
    return d.json()


# --- Power & energy --------------------------------------------------------------------------
