"""The Power & energy dashboard: GPU power by what phasewatch had in flight (idle,
prefill, decode), energy per GPU, and each energy-per-token figure under its own name."""

from __future__ import annotations

from .common import (
    BLUE,
    GREEN,
    RED,
    SEL,
    YELLOW,
    Dash,
    bargauge_panel,
    base_vars,
    fam,
    heatmap_panel,
    override,
    query_var,
    stat_panel,
    steps,
    table_panel,
    target,
    timeseries_panel,
    value_map,
)


def build() -> dict:
    gpu_var = query_var(
        "gpu",
        "GPU",
        "label_values(phasewatch_gpu_energy_joules_total, gpu)",
        "GPU index (as the power source numbers them).",
    )
    d = Dash(
        "phasewatch-power",
        "phasewatch / Power & energy",
        "GPU power by what phasewatch had in flight (idle, prefill, decode), energy per GPU, "
        "and joules per token by precision. Empty when no power source is configured.",
        ["power"],
        base_vars() + [gpu_var],
    )
    PG = SEL + ', gpu=~"$gpu"'

    d.row("Power")
    d.add(
        stat_panel(
            "Power sampling",
            "Whether each phasewatch replica is sampling GPU power (NVML, DCGM endpoint or the "
            "simulator). PowerSamplingDown fires after 5 min down.",
            [target("min by (source) (phasewatch_power_sampling_up)", "{{source}}", instant=True)],
            "none",
            steps(RED, (1, GREEN)),
            color_mode="background",
            mappings=value_map({"0": ("down", RED), "1": ("sampling", GREEN)}),
        ),
        w=6,
        h=6,
    )
    d.add(
        bargauge_panel(
            "Mean power by state",
            "Mean of the power samples per state over the time range: idle (nothing in flight on "
            "the GPU's upstream), prefill (a request before its first token), decode.",
            [
                target(
                    f"sum by (state) (increase(phasewatch_gpu_power_sample_watts_sum{{{PG}}}[$__range]))"
                    f" / sum by (state) (increase(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range]))",
                    "{{state}}",
                    instant=True,
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            decimals=0,
        ),
        w=9,
        h=6,
    )
    d.add(
        bargauge_panel(
            "Share of time by state",
            "Share of power samples in each state: how busy the GPUs were.",
            [
                target(
                    f"sum by (state) (increase(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range]))"
                    f" / scalar(sum(increase(phasewatch_gpu_power_sample_watts_count{{{PG}}}[$__range])))",
                    "{{state}}",
                    instant=True,
                )
            ],
            "percentunit",
            steps(BLUE),
            max_=1,
            decimals=0,
        ),
        w=9,
        h=6,
    )
    d.add(
        timeseries_panel(
            "GPU power",
            "Latest power sample per GPU (max over replicas, which sample the same GPUs).",
            [
                target(
                    f"max by (upstream, model, gpu) (phasewatch_gpu_power_current_watts{{{PG}}})",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=10,
        )
    )
    d.add(
        timeseries_panel(
            "Power by state",
            "5 min mean of the power samples per GPU and state (recording rule): idle power and "
            "decode-load power side by side.",
            [
                target(
                    f"phasewatch:gpu_power_sample_watts:mean5m{{{PG}}}",
                    "gpu {{gpu}} ({{model}}) {{state}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=0,
        )
    )
    d.add(
        timeseries_panel(
            "Per-request power by phase and precision",
            "Mean GPU power over requests' prefill and decode windows (recording rule), by precision: "
            "prefill draws more than decode; lower precision draws less at decode.",
            [
                target(
                    f"avg by (precision, phase) (phasewatch:gpu_power_watts:mean5m{{{SEL}}})",
                    "{{precision}} {{phase}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=0,
        )
    )
    d.add(
        heatmap_panel(
            "Power sample distribution",
            "All power samples as a heatmap of histogram buckets (W).",
            [
                target(
                    f"sum by (le) (increase(phasewatch_gpu_power_sample_watts_bucket{{{PG}}}[$__rate_interval]))",
                    "{{le}}",
                    fmt="heatmap",
                )
            ],
            "watt",
        )
    )
    # why the per-request power panel may be empty: phases the sensor cannot resolve
    by = "precision, phase"
    unresolved = (
        f"sum by ({by}) (increase(phasewatch_gpu_power_unresolved_total{{{SEL}}}[$__range]))"
    )
    measured = f"sum by ({by}) (increase(phasewatch_gpu_power_watts_count{{{SEL}}}[$__range]))"
    u0 = f"({unresolved} or 0 * {measured})"
    m0 = f"({measured} or 0 * {unresolved})"
    d.add(
        table_panel(
            "Request phases the power sensor cannot resolve",
            "Per precision and phase over the time range: request phases shorter than the "
            "power sensor's resolution (the panel beside), or sampled too coarsely, which get "
            "no per-request power (phasewatch_gpu_power_unresolved_total), beside those "
            "measured (phasewatch_gpu_power_watts_count) and the unresolved share. 100 % "
            "explains an empty per-request power panel: a default dcgm-exporter refreshes its "
            "fields every second or slower, longer than most prefills; run it with -c 100 and "
            "deploy/dcgm/phasewatch-counters.csv, or read NVML on the GPU's host.",
            [
                target(f"{u0} / ({u0} + {m0})", "unresolved share", instant=True, fmt="table"),
                target(u0, "unresolved", instant=True, fmt="table"),
                target(m0, "measured", instant=True, fmt="table"),
            ],
            [
                override("unresolved share", unit="percentunit", decimals=0),
                override("unresolved phases", unit="none", decimals=0),
                override("measured phases", unit="none", decimals=0),
            ],
            steps(GREEN),
            organize={
                "excludeByName": {"Time": True},
                "indexByName": {"precision": 0, "phase": 1},
                "renameByName": {
                    "Value #A": "unresolved share",
                    "Value #B": "unresolved phases",
                    "Value #C": "measured phases",
                },
            },
        ),
        w=14,
        h=7,
    )
    d.add(
        stat_panel(
            "Power sensor resolution",
            "Per GPU, the shortest request phase whose power is measured "
            "(phasewatch_gpu_power_resolution_seconds, from the sensor's measured refresh "
            "period) and the field phase energy is taken from (phasewatch_gpu_power_sensor_info: "
            "energy_counter, power_instant, power_usage or power_average). Shorter phases are "
            "counted unresolved (the table beside); above 2 s no per-request figure is "
            "possible. Empty until the sampler has learnt the sensor (a few seconds).",
            [
                target(
                    "max by (gpu, source, field) (phasewatch_gpu_power_resolution_seconds"
                    '{gpu=~"$gpu"} * on (gpu) group_left (source, field) '
                    "(phasewatch_gpu_power_sensor_info == 1)) and on (gpu) "
                    f"phasewatch_gpu_power_current_watts{{{PG}}}",
                    "gpu {{gpu}}: {{field}} ({{source}})",
                    instant=True,
                )
            ],
            "s",
            steps(GREEN, (0.5, YELLOW), (2, RED)),
            decimals=2,
        ),
        w=10,
        h=7,
    )

    d.row("Energy")
    d.add(
        timeseries_panel(
            "Energy per token at decode load by precision",
            "joules_per_token_at_decode over 5 min (recording rule): mean GPU power over "
            "requests' decode windows / median decode tok/s, per model family and precision. "
            "Idle and prefill are not in it: the figure that compares precisions (int4 below "
            "fp8 below bf16).",
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
    d.add(
        timeseries_panel(
            "All-in energy per generated token (idle and prefill included)",
            "joules_per_token_all_in over 5 min (recording rule): the GPU's whole energy counter, "
            "idle and prefill included, / generated tokens: the cost of owning the GPU at this "
            "utilisation. Not a precision comparison: on the same traffic a faster precision "
            "idles more and can read higher here. Exact per model when GPUs are mapped to "
            "models (--power-gpu GPU=MODEL); a blend where a GPU serves several.",
            [
                target(
                    f"phasewatch:joules_per_token_all_in:rate5m{{{SEL}}}",
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries_panel(
            "Energy attributed to requests per generated token",
            "joules_per_token_attributed over 5 min (recording rule): each request's share of its "
            "GPUs' energy while it ran (phasewatch_request_energy_joules_total, split evenly "
            "among the requests in flight; idle energy is nobody's) / generated tokens. Between "
            "the at-decode and the all-in figures.",
            [
                target(
                    f"phasewatch:joules_per_token_attributed:rate5m{{{SEL}}}",
                    "{{model}} ({{precision}}) on {{upstream}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries_panel(
            "Energy per token by phase, fitted from many requests",
            "GPU energy per prompt token (prefill) and per output token (decode), fitted over "
            "the energy counter's steps from the last 10 minutes' requests (short prefills "
            "too); the board's whole draw in the phase. Shown once its 95 % interval is within "
            "±10 % (GET /phasewatch/api/energy says why not); watts: "
            "phasewatch_gpu_power_fitted_watts.",
            [
                target(
                    "max by (upstream, model, precision, phase) "
                    f'(phasewatch_gpu_energy_per_token_joules{{{SEL}, bound="estimate"}})',
                    "{{model}} ({{precision}}) {{phase}}",
                )
            ],
            "joule",
            steps(GREEN, (1, YELLOW), (3, RED)),
            fill=0,
            decimals=3,
        )
    )
    d.add(
        timeseries_panel(
            "Average power per GPU (from energy)",
            "rate of the energy counter per GPU (recording rule, deduplicated over replicas): the "
            "GPU's average draw.",
            [
                target(
                    f"phasewatch:gpu_energy_joules:rate5m{{{PG}}}",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                )
            ],
            "watt",
            steps(GREEN, (300, YELLOW), (400, RED)),
            fill=10,
        )
    )
    d.add(
        bargauge_panel(
            "Energy per GPU over the time range",
            "Energy each GPU used over the dashboard's time range (max over replicas, which read "
            "the same counter), in watt-hours.",
            [
                target(
                    f"max by (upstream, model, gpu) (increase(phasewatch_gpu_energy_joules_total{{{PG}}}[$__range])) / 3600",
                    "gpu {{gpu}}: {{model}} on {{upstream}}",
                    instant=True,
                )
            ],
            "watth",
            steps(GREEN, (100, YELLOW), (1000, RED)),
            decimals=2,
        )
    )
    return d.json()
