"""The precision dashboard compares precisions within one model family: its medians and
speed-ups never sum two different models into one figure. promtool evaluates the
dashboard's own queries over two families whose speeds differ (a small model decoding
fast, a large one slow), each served at bf16 and int4."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import yaml

from .test_observability import all_panels, dashboards, tool

#: (model, precision, family, decode tok/s of every request)
SERVED = [
    ("org/Small-1B", "bf16", "small-1b", 300.0),
    ("org/Small-1B-AWQ-INT4", "int4", "small-1b", 900.0),
    ("org/Large-70B", "bf16", "large-70b", 10.0),
    ("org/Large-70B-AWQ-INT4", "int4", "large-70b", 30.0),
]
LES = ["5", "12.5", "40", "125", "400", "1250", "+Inf"]


def expr(title: str) -> str:
    panels = {p["title"]: p for p in all_panels(dashboards()["phasewatch-precision.json"])}
    e = panels[title]["targets"][0]["expr"]
    for key, value in {
        "__range": "10m",
        "upstream": ".*",
        "model": ".*",
        "precision": ".*",
        "source": "proxy",
        "baseline": "bf16",
    }.items():
        e = e.replace("$" + key, value)
    assert "$" not in e, e
    return e


def series() -> list[dict]:
    out = []
    for model, precision, family, rate in SERVED:
        base = f'upstream="u",model="{model}",precision="{precision}"'
        # the large model gets most of the traffic: a median over both families would be
        # the large model's
        per_min = 10 if family == "large-70b" else 2
        for le in LES:
            inside = le == "+Inf" or rate <= float(le)
            out.append(
                {
                    "series": "phasewatch_decode_tokens_per_second_bucket"
                    f'{{{base},source="proxy",prompt_band="0-2k",le="{le}"}}',
                    "values": f"0+{per_min if inside else 0}x30",
                }
            )
        out.append(
            {
                "series": f'phasewatch_model_info{{{base},quant="",precision_source="name",'
                f'family="{family}"}}',
                "values": "1x30",
            }
        )
    return out


def test_speed_up_and_medians_are_per_model_family():
    # a median inside the bucket holding every request's rate: (le_prev, le] interpolated
    median = {
        ("small-1b", "bf16"): 125 + (400 - 125) * 0.5,
        ("small-1b", "int4"): 400 + (1250 - 400) * 0.5,
        ("large-70b", "bf16"): 5 + (12.5 - 5) * 0.5,
        ("large-70b", "int4"): 12.5 + (40 - 12.5) * 0.5,
    }

    def samples(values: dict) -> list[dict]:
        return [
            {"labels": f'{{family="{f}",precision="{p}"}}', "value": v}
            for (f, p), v in sorted(values.items())
        ]

    speedup = {
        (f, p): median[(f, p)] / median[(f, "bf16")] for (f, p) in median
    }  # int4 about 3x over its own bf16 in both families
    doc = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series(),
                "promql_expr_test": [
                    {
                        "expr": expr("Decode tok/s (median)"),
                        "eval_time": "20m",
                        "exp_samples": samples(median),
                    },
                    {
                        "expr": expr("Decode speed-up vs baseline"),
                        "eval_time": "20m",
                        "exp_samples": samples(speedup),
                    },
                ],
            }
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "family_test.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
        res = subprocess.run(
            [tool("promtool"), "test", "rules", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
