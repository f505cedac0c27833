"""Command line: ``phasewatch serve | simulate | demo | bench | report | advise``.

Parses flags and hands over: the proxy (proxy.app under proxy.runtime), the simulator
(proxy.sim), the demo, the benchmark and the report (this package).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import typing
from typing import Any, NoReturn

from pydantic import ValidationError

from .. import __version__
from ..settings import ENV_ALIASES, Settings

_PROG = "phasewatch"


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or "list[" in str(annotation)


#: A second spelling per setting that has one: its variable's flag (``--upstream-ca-file``).
_ALIASES = {
    field: "--" + var.removeprefix("PHASEWATCH_").lower().replace("_", "-")
    for var, field in ENV_ALIASES.items()
}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field, documented from the field's description."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        flags = [flag, _ALIASES[name]] if name in _ALIASES else [flag]
        env = "PHASEWATCH_" + name.upper()
        annotation = field.annotation
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env {env}; default {default!r}]"
        if _is_list(annotation):
            parser.add_argument(
                *flags, dest=name, action="append", default=None, help=help_text, metavar="VALUE"
            )
        elif annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            choices = (
                typing.get_args(annotation)
                if typing.get_origin(annotation) is typing.Literal
                else None
            )
            parser.add_argument(
                *flags,
                dest=name,
                default=None,
                help=help_text,
                choices=choices,
                metavar=None if choices else name.upper(),
            )


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (the environment fills the rest)."""
    return {
        k: getattr(args, k) for k in Settings.model_fields if getattr(args, k, None) is not None
    }


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 2: how every bad setting is reported."""
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def validation_line(exc: ValidationError, given: set[str] | None = None) -> str:
    """One line for a refused setting, naming the flag, or the variable for a setting
    not given as a flag (`given`: the settings given as flags)."""
    parts = []
    for err in exc.errors():
        names = [str(p) for p in err["loc"] if isinstance(p, str)]
        msg = err["msg"].removeprefix("Value error, ")
        if not names:  # a check across settings names its flag itself
            parts.append(msg)
            continue
        where = "--" + "-".join(names).replace("_", "-")
        if given is not None and names[0] not in given:  # from the environment
            where = "PHASEWATCH_" + "_".join(names).upper() + f" ({where})"
        value = err.get("input")
        shown = (
            f" (got {value!r})" if value is not None and not isinstance(value, (list, dict)) else ""
        )
        parts.append(f"{where}: {msg}{shown}")
    return "; ".join(parts)


# --- serve ----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    given = given_settings(args)
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        fail(validation_line(exc, set(given)))
    except ValueError as exc:
        fail(str(exc))
    import logging

    from ..app import ProxyApp
    from ..runtime.logs import configure_logging
    from ..runtime.server import ListenError, bind_all

    configure_logging(settings.log_level, settings.log_format)
    for notice in settings.notices:  # said before any error: a misspelt variable explains it
        logging.getLogger("proxy.settings").warning(notice)
    if not settings.upstream:
        fail(
            "no upstream: give --upstream URL (or PHASEWATCH_UPSTREAM), e.g. "
            "--upstream http://127.0.0.1:8000"
        )
    try:
        app = ProxyApp(settings)
    except ValueError as exc:
        fail(str(exc))
    try:  # before anything else starts: a port in use is one line, not a server error
        sock, msock = bind_all(settings)
    except ListenError as exc:
        fail(str(exc))
    if settings.workers > 1:  # N processes, metrics summed, one power sampler
        from ..runtime.workers import run as run_workers

        if app.tracing is not None:  # each worker exports its own; not this process
            app.tracing.shutdown()
        del app  # built above only to check the configuration
        return run_workers(given_settings(args), settings, sock, msock)
    from ..runtime.server import run

    run(app, [sock], [msock] if msock is not None else None)
    return 0


# --- simulate ---------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    import uvicorn

    from ..runtime.logs import configure_logging
    from ..runtime.server import uvicorn_config
    from ..sim.command import from_args

    configure_logging("info")
    try:
        app = from_args(args)
    except ValueError as exc:
        fail(str(exc))
    config = uvicorn_config(app, args.host, args.port, "info")
    config.server_header, config.date_header = True, True  # like the engines it imitates
    uvicorn.Server(config).run()
    return 0


# --- demo, bench, report -------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from ..runtime.logs import configure_logging
    from .demo import run_demo

    configure_logging("info")
    try:
        asyncio.run(run_demo(args))
    except ValueError as exc:
        fail(str(exc))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run

    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from .report import run

    return run(args)


def cmd_advise(args: argparse.Namespace) -> int:
    from .advise import run

    return run(args)


# --- entry --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from ..sim import command as sim_command
    from . import advise, bench, demo, report

    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Instrumenting reverse proxy for "
        "self-hosted LLM engines: per-request queue, TTFT, prefill and "
        "decode rates, precision and GPU power, as Prometheus metrics.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        # short: a mistake prints it, and --help lists the flags below it
        usage="%(prog)s --upstream [NAME=]URL [--flag VALUE ...] (--help lists every flag)",
        help="run the proxy in front of one or more engines",
        description="Run the proxy. Every flag can also be set as a "
        "PHASEWATCH_* environment variable; flags win.",
    )
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    sim = sub.add_parser(
        "simulate",
        help="run the built-in engine simulator",
        description="A simulated engine (vLLM, Ollama or llama-server, "
        "--engine) with faithful wire format and physics-based timing: one 8B "
        "model at bf16, fp8 and int4 (Ollama: F16, Q8_0, Q4_K_M; llama-server: "
        "one Q4_K_M model), the engines' own timing fields filled from it. Chat "
        "requests get n choices (vLLM, llama-server; Ollama has no n) and, with "
        "tools, a tool call the way each engine sends one (streamed tool_calls "
        "deltas on vLLM and llama-server, the whole call in one chunk on Ollama); "
        "vLLM and llama-server answer /tokenize, llama-server also /detokenize and "
        "/apply-template, with the context --ctx-size gives its slots.",
    )
    sim.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    sim.add_argument("--port", type=int, default=8000, help="Port to listen on [default 8000].")
    sim_command.add_arguments(sim)
    sim.set_defaults(func=cmd_simulate)

    d = sub.add_parser(
        "demo",
        help="simulator + proxy + gentle traffic: metrics with no GPU",
        description="Runs the simulator, the proxy (on --port) in front of it, "
        "and a gentle traffic generator, so /metrics fills with no GPU.",
    )
    demo.add_arguments(d)
    sim_command.add_arguments(d, realistic=True)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser(
        "bench",
        help="benchmark an endpoint: decode, prefill, TTFT, concurrency",
        description="Warm-up, then decode tok/s, prefill ms/token and TTFT at ~4K, "
        "~8K and ~16K-token prompts, and a concurrency sweep, each repeated "
        "(median reported).",
    )
    bench.add_arguments(b)
    b.set_defaults(func=cmd_bench)
    r = sub.add_parser(
        "report",
        help="the benchmark table from phasewatch's own metrics",
        description="Per model x precision: decode tok/s, prefill ms/token and "
        "TTFT by prompt band, power, J/token, phase shares and speed-ups, from a "
        "phasewatch /metrics URL or a Prometheus server.",
    )
    report.add_arguments(r)
    r.set_defaults(func=cmd_report)
    a = sub.add_parser(
        "advise",
        help="which phase to tune: workload, time and energy shares, levers",
        description="Per upstream x model x precision: the workload's shape, where "
        "wall time and energy go (queue, prefill, decode), the formula total = "
        "prompt / prefill tok/s + output / decode tok/s checked, and the levers "
        "ordered by what they would save, each with its evidence; from a phasewatch "
        "/metrics URL or a Prometheus server, like report.",
    )
    advise.add_arguments(a)
    a.set_defaults(func=cmd_advise)
    return parser


def unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for unknown arguments, with the nearest flag for a misspelt one."""
    flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.7)
            if near:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {near[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (
        f" ({'; '.join(hints)})" if hints else ""
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # told by the subcommand, with its usage (not the top-level one)
        sub = next(a for a in parser._actions if a.dest == "command")
        command = sub.choices[args.command]  # type: ignore[index]
        command.error(unrecognized(extra, command))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
