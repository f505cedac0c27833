"""``phasewatch bench``'s arguments, and the command: a bench, or ``--compare``."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx

from ..keys import add_arguments as add_key_arguments
from ..keys import key_of
from .client import BenchError
from .render import table
from .session import run_bench


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from exc
    if any(v < 1 for v in values):
        raise ValueError(f"values must be at least 1, got {text!r}")
    return values


def add_arguments(parser) -> None:
    import argparse

    def ints(text):
        try:
            return _ints(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8090",
        help="OpenAI-compatible base URL, usually phasewatch's [default http://127.0.0.1:8090].",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="Model to benchmark (repeatable; default: every model the endpoint lists).",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="Repetitions per scenario; the median is reported [default 3].",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="Warm-up requests per model [default 1]."
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=256,
        help="Output tokens of the decode scenario [default 256].",
    )
    parser.add_argument(
        "--decode-prompt",
        type=int,
        default=128,
        help="Prompt tokens of the decode scenario [default 128].",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=ints,
        default=[4096, 8192, 16384],
        help="Prompt sizes of the prefill/TTFT scenario [default 4096,8192,16384].",
    )
    parser.add_argument(
        "--concurrency",
        type=ints,
        default=[1, 2, 4, 8],
        help="Concurrency levels of the sweep [default 1,2,4,8]; '' skips it.",
    )
    parser.add_argument(
        "--sweep-tokens",
        type=int,
        default=128,
        help="Output tokens per request in the sweep [default 128].",
    )
    parser.add_argument(
        "--sweep-prompt",
        type=int,
        default=128,
        help="Prompt tokens per request in the sweep [default 128].",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="Do not send ignore_eos (for servers that reject unknown fields).",
    )
    add_key_arguments(parser, ("OPENAI_API_KEY",))
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Per-request timeout, seconds."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompt words.")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=1.0,
        help="Pause before each model's runs, sending nothing, to measure idle GPU power "
        "through phasewatch [default 1]; 0 skips it.",
    )
    parser.add_argument(
        "--max-spread",
        type=float,
        default=0.10,
        help="Warn when a figure's runs spread more than this share of their median "
        "((max - min) / median) [default 0.10].",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        default=None,
        help="Compare two results written by --output (nothing is benchmarked): per model, "
        "precision and figure both values, the change and whether it is beyond the runs' "
        "spread.",
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="Also draw the result as PNG and SVG charts in DIR (needs matplotlib: "
        "pip install 'phasewatch[plot]').",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of the table.")
    parser.add_argument("--output", default=None, help="Also write the JSON result to this file.")
    parser.add_argument("--quiet", action="store_true", help="No progress output.")


def run(args) -> int:
    if args.compare:
        from .compare import load, render

        try:
            a, b = load(args.compare[0]), load(args.compare[1])
        except (OSError, ValueError) as exc:
            print(f"phasewatch bench: --compare: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(render(a, b, args.compare[0], args.compare[1]))
        return 0
    if args.plot:
        from ..plots import PlotError, require

        try:
            require()
        except PlotError as exc:
            print(f"phasewatch bench: {exc}", file=sys.stderr)
            return 2
    if args.idle_seconds < 0 or args.max_spread < 0:
        print(
            "phasewatch bench: --idle-seconds and --max-spread must not be negative",
            file=sys.stderr,
        )
        return 2
    for name in ("repeat", "decode_tokens", "decode_prompt", "sweep_tokens", "sweep_prompt"):
        if getattr(args, name) < 1:
            print(
                f"phasewatch bench: --{name.replace('_', '-')} must be at least 1", file=sys.stderr
            )
            return 2
    try:
        args.api_key = key_of(args)
    except ValueError as exc:
        print(f"phasewatch bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_bench(args))
    except (BenchError, httpx.HTTPError) as exc:
        print(f"\nphasewatch bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else table(result))
    for w in result["warnings"] if args.json or args.quiet else ():
        print(f"phasewatch bench: warning: {w}", file=sys.stderr)
    if args.plot:
        from ..plots import bench_charts

        for path in bench_charts(result, args.plot):
            print(f"phasewatch bench: wrote {path}", file=sys.stderr)
    return 0
