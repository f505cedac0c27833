"""``phasewatch demo``: simulator + proxy + traffic in one process, no GPU needed."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from ..app import ProxyApp
from ..runtime.server import SignalFreeServer, guard, uvicorn_config
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
        help="Mean requests per second of the traffic generator [default 1].",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=0,
        help="Stop after this many seconds (default: run until interrupted).",
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def run_demo(args: argparse.Namespace) -> None:
    if args.rate <= 0:
        raise ValueError("--rate must be positive (requests per second)")
    if args.duration < 0:
        raise ValueError("--duration must not be negative")
    sim_port = args.sim_port or _free_port("127.0.0.1")
    sim_app = from_args(args)
    sim_config = uvicorn_config(sim_app, "127.0.0.1", sim_port, "warning")
    sim_config.server_header, sim_config.date_header = True, True
    sim_server = SignalFreeServer(sim_config)
    # power from the simulator's dcgm-exporter lines, each simulated GPU mapped to its model
    power_gpu = [f"{gpu}={model}" for gpu, model in gpu_models(sim_app.engine).items()]
    settings = Settings(
        upstream=[f"sim=http://127.0.0.1:{sim_port}"],
        host=args.host,
        port=args.port,
        power_source="dcgm",
        power_dcgm_url=f"http://127.0.0.1:{sim_port}/metrics",
        power_gpu=power_gpu,
    )
    proxy_app = ProxyApp(settings)
    proxy_server = SignalFreeServer(
        guard(uvicorn_config(proxy_app, args.host, args.port, "info"), proxy_app)
    )
    sim_task = asyncio.create_task(sim_server.serve())
    while not sim_server.started:
        await asyncio.sleep(0.05)
    proxy_task = asyncio.create_task(proxy_server.serve())
    while not proxy_server.started:
        if proxy_task.done():
            sim_server.should_exit = True
            await sim_task
            return
        await asyncio.sleep(0.05)
    url = f"http://{args.host}:{args.port}"
    log.info(
        "demo: proxy on %s (status page %s/phasewatch/, metrics %s/metrics), "
        "simulator on http://127.0.0.1:%d",
        url,
        url,
        url,
        sim_port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.duration:
        loop.call_later(args.duration, stop.set)
    traffic = asyncio.create_task(run_traffic(url, args.rate, stop))
    await stop.wait()
    await traffic
    proxy_server.should_exit = True
    await proxy_task
    sim_server.should_exit = True
    await sim_task
