"""Command line: ``phasewatch serve | simulate | demo`` (SPEC §5). Wiring only."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import typing

from pydantic import ValidationError

from . import __version__
from .settings import Settings

_PROG = "phasewatch"


def _is_list(annotation) -> bool:
    return typing.get_origin(annotation) is list or "list[" in str(annotation)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field, documented from the field's description."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = "PHASEWATCH_" + name.upper()
        annotation = field.annotation
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env {env}; default {default!r}]"
        if _is_list(annotation):
            parser.add_argument(flag, dest=name, action="append", default=None, help=help_text,
                                metavar="VALUE")
        elif annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
            parser.add_argument(flag, dest=name, default=None, help=help_text, choices=choices,
                                metavar=None if choices else name.upper())


def settings_from_args(args: argparse.Namespace, **overrides) -> Settings:
    given = {k: getattr(args, k) for k in Settings.model_fields if getattr(args, k, None) is not None}
    given.update(overrides)
    return Settings(**given)


def _fail(message: str) -> typing.NoReturn:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _validation_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = "--" + "-".join(str(p) for p in err["loc"] if isinstance(p, str)).replace("_", "-")
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = f" (got {value!r})" if value is not None and not isinstance(value, (list, dict)) else ""
        parts.append(f"{where}: {msg}{shown}")
    return "; ".join(parts)


def configure_logging(level: str, worker: int | None = None) -> None:
    tag = "" if worker is None else f"[worker {worker} pid %(process)d] "
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s {tag}%(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call is noise


def uvicorn_config(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          server_header=False, date_header=False, lifespan="on",
                          timeout_graceful_shutdown=30, log_config=None, interface="asgi3")


# --- serve ----------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        _fail(_validation_line(exc))
    except ValueError as exc:
        _fail(str(exc))
    if not settings.upstream:
        _fail("no upstream: give --upstream URL (or PHASEWATCH_UPSTREAM), e.g. "
              "--upstream http://127.0.0.1:8000")
    configure_logging(settings.log_level)
    from .app import ProxyApp

    try:
        app = ProxyApp(settings)
    except ValueError as exc:
        _fail(str(exc))
    if settings.workers > 1:  # proxy.workers: N processes, metrics summed, one power sampler
        from .workers import run as run_workers

        del app  # built above only to check the configuration
        given = {k: getattr(args, k) for k in Settings.model_fields
                 if getattr(args, k, None) is not None}
        return run_workers(given, settings, settings.log_level)
    from .server import serve

    config = uvicorn_config(app, settings.host, settings.port, settings.log_level)
    metrics_config = None
    if settings.metrics_port is not None or settings.metrics_host is not None:
        metrics_config = uvicorn_config(app.metrics_app, settings.metrics_host or settings.host,
                                        settings.metrics_port or 0, settings.log_level)
        metrics_config.lifespan = "off"
    config.load()  # picks uvloop when installed
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve(app, config, metrics_config))
    return 0


# --- simulate ---------------------------------------------------------------------------


def add_sim_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("vllm", "ollama", "llamacpp"),
                        default=os.environ.get("PHASEWATCH_SIM_ENGINE", "vllm"),
                        help="Engine wire format to speak [env PHASEWATCH_SIM_ENGINE; default vllm].")
    parser.add_argument("--speed", type=float, default=float(os.environ.get("PHASEWATCH_SIM_SPEED", "1")),
                        help="Time scale: 2 runs the simulated GPU twice as fast [default 1].")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="Concurrent sequences per model; more wait in the engine's queue.")
    parser.add_argument("--jitter", type=float, default=0.02,
                        help="Relative standard deviation of step times [default 0.02].")
    parser.add_argument("--truth-log", default=os.environ.get("PHASEWATCH_SIM_TRUTH_LOG"),
                        help="Append the ground truth of every request (JSON lines) to this file.")
    parser.add_argument("--deterministic", action="store_true",
                        help="Ids and created times derived from the request, so equal requests "
                             "give equal bytes (for byte-equality tests).")
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")


def build_sim(args: argparse.Namespace):
    if args.speed <= 0:
        _fail("--speed must be positive")
    if args.max_num_seqs < 1:
        _fail("--max-num-seqs must be at least 1")
    from .sim import build_app

    try:
        return build_app(args.engine, speed=args.speed, max_num_seqs=args.max_num_seqs,
                         jitter=args.jitter, truth_path=args.truth_log, seed=args.seed,
                         deterministic=args.deterministic)
    except ValueError as exc:
        _fail(str(exc))


def cmd_simulate(args: argparse.Namespace) -> int:
    configure_logging("info")
    import uvicorn

    app = build_sim(args)
    config = uvicorn_config(app, args.host, args.port, "info")
    config.server_header, config.date_header = True, True  # like the engines it imitates
    uvicorn.Server(config).run()
    return 0


# --- demo -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    configure_logging("info")
    from .demo import run_demo

    asyncio.run(run_demo(args))
    return 0


# --- bench / report (logic in proxy.bench and proxy.report) ------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run

    return run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from .report import run

    return run(args)


# --- entry --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="Instrumenting reverse proxy for "
                                     "self-hosted LLM engines: per-request queue, TTFT, prefill and "
                                     "decode rates, precision and GPU power, as Prometheus metrics.")
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy in front of one or more engines",
                           description="Run the proxy. Every flag can also be set as a "
                           "PHASEWATCH_* environment variable; flags win.")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    sim = sub.add_parser("simulate", help="run the built-in engine simulator",
                         description="A simulated engine (vLLM, Ollama or llama-server, "
                         "--engine) with faithful wire format and physics-based timing: one 8B "
                         "model at bf16, fp8 and int4 (Ollama: F16, Q8_0, Q4_K_M; llama-server: "
                         "one Q4_K_M model), the engines' own timing fields filled from it.")
    sim.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    sim.add_argument("--port", type=int, default=8000, help="Port to listen on [default 8000].")
    add_sim_flags(sim)
    sim.set_defaults(func=cmd_simulate)

    demo = sub.add_parser("demo", help="simulator + proxy + gentle traffic: metrics with no GPU",
                          description="Runs the simulator, the proxy (on --port) in front of it, "
                          "and a gentle traffic generator, so /metrics fills with no GPU.")
    demo.add_argument("--host", default="127.0.0.1", help="Address the proxy listens on.")
    demo.add_argument("--port", type=int, default=8090, help="Port the proxy listens on [default 8090].")
    demo.add_argument("--sim-port", type=int, default=0,
                      help="Port of the simulator (default: any free port).")
    demo.add_argument("--rate", type=float, default=1.0,
                      help="Mean requests per second of the traffic generator [default 1].")
    demo.add_argument("--duration", type=float, default=0,
                      help="Stop after this many seconds (default: run until interrupted).")
    add_sim_flags(demo)
    demo.set_defaults(func=cmd_demo)

    from . import bench as _bench, report as _report

    bench = sub.add_parser("bench", help="benchmark an endpoint with the seeds' method",
                           description="Warm-up, then decode, prefill/TTFT (~4K, ~8K, ~16K-token "
                           "prompts) and a concurrency sweep, each repeated (median reported).")
    _bench.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    report = sub.add_parser("report", help="the seeds' table from phasewatch's metrics",
                            description="Per model x precision: decode tok/s, prefill ms/token and "
                            "TTFT by prompt band, power, J/token, phase shares and speed-ups, from a "
                            "phasewatch /metrics URL or a Prometheus server.")
    _report.add_arguments(report)
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
