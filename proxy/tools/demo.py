"""``phasewatch demo``: simulator + proxy + traffic in one process, no GPU needed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import tempfile

from ..app import ProxyApp
from ..runtime.server import (
    SecondaryServer,
    SignalFreeServer,
    announce,
    base_url,
    bind,
    guard,
    uvicorn_config,
)
from ..settings import Settings
from ..sim.command import from_args
from ..sim.power import gpu_models
from ..sim.traffic import run_traffic

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Address the proxy listens on.")
    parser.add_argument(
        "--port", type=int, default=8090, help="Port the proxy listens on [default 8090]."
    )
    parser.add_argument(
        "--sim-port", type=int, default=0, help="Port of the simulator (default: any free port)."
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="Mean requests per second of the traffic generator [default 1]; 0 sends none "
        "(a quiet engine to benchmark).",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=0,
        help="Stop after this many seconds (default: run until interrupted).",
    )


async def run_demo(args: argparse.Namespace) -> None:
    if not args.rate >= 0:  # also refuses NaN
        raise ValueError("--rate must not be negative (requests per second; 0: no traffic)")
    if args.duration < 0:
        raise ValueError("--duration must not be negative")
    sock = bind(args.host, args.port)  # a port in use is one line, before anything starts
    sim_sock = bind("127.0.0.1", args.sim_port, "--sim-port")
    # the simulated checkpoints' config.json files: the proxy reads their KV-cache shapes
    own_dir = None if getattr(args, "model_dir", None) else tempfile.TemporaryDirectory()
    model_dir = own_dir.name if own_dir is not None else args.model_dir
    args.model_dir = model_dir
    try:
        await _run(args, sock, sim_sock, model_dir)
    finally:
        if own_dir is not None:
            own_dir.cleanup()


async def _run(
    args: argparse.Namespace, sock: socket.socket, sim_sock: socket.socket, model_dir: str
) -> None:
    sim_port = int(sim_sock.getsockname()[1])
    sim_app = from_args(args)
    sim_config = uvicorn_config(sim_app, "127.0.0.1", sim_port, "warning")
    sim_config.server_header, sim_config.date_header = True, True
    sim_server = SecondaryServer(sim_config)
    # power from the simulator's dcgm-exporter lines, each simulated GPU mapped to its model
    power_gpu = [f"{gpu}={model}" for gpu, model in gpu_models(sim_app.engine).items()]
    settings = Settings(
        upstream=[f"sim=http://127.0.0.1:{sim_port}"],
        host=args.host,
        port=args.port,
        power_source="dcgm",
        power_dcgm_url=f"http://127.0.0.1:{sim_port}/metrics",
        power_gpu=power_gpu,
        model_dir=model_dir,
    )
    proxy_app = ProxyApp(settings)
    proxy_app.status.simulated = True  # the page says the figures are the simulator's
    proxy_server = SignalFreeServer(
        guard(uvicorn_config(proxy_app, args.host, args.port, "info"), proxy_app)
    )
    sim_task = asyncio.create_task(sim_server.serve(sockets=[sim_sock]))
    while not sim_server.started:
        if sim_task.done():
            return
        await asyncio.sleep(0.05)
    proxy_task = asyncio.create_task(proxy_server.serve(sockets=[sock]))
    while not proxy_server.started:
        if proxy_task.done():
            sim_server.should_exit = True
            await sim_task
            return
        await asyncio.sleep(0.05)
    url = base_url(sock)
    announce(sock)
    gpus = sorted({me.gpu.name for me in sim_app.engine.models.values()})
    log.info(
        "demo: simulated %s engine on http://127.0.0.1:%d; %d simulated GPUs (%s, physics "
        "model, no real GPU) whose watts come from the simulator's fake dcgm-exporter at "
        "%s (sensors as --gpu-sensor %s GPUs report them, collected every %gs): the power "
        "figures are simulated, not measured; traffic to %s",
        getattr(args, "engine", None) or "vllm",
        sim_port,
        len(power_gpu),
        ", ".join(gpus),
        settings.power_dcgm_url,
        getattr(args, "gpu_sensor", "ideal"),
        getattr(args, "dcgm_interval", 0.0),
        url,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.duration:
        loop.call_later(args.duration, stop.set)
    # a benchmark of the demo sees its traffic generator (and says to turn it off)
    proxy_app.metrics.demo_traffic_requests_per_second.set(args.rate)
    traffic = asyncio.create_task(run_traffic(url, args.rate, stop)) if args.rate > 0 else None
    await stop.wait()
    if traffic is not None:
        await traffic
    proxy_server.should_exit = True
    await proxy_task
    sim_server.should_exit = True
    await sim_task
