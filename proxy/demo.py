"""``phasewatch demo``: simulator + proxy + traffic in one process, no GPU needed."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from .app import ProxyApp
from .cli import build_sim, uvicorn_config
from .settings import Settings
from .sim.traffic import run_traffic

log = logging.getLogger("phasewatch")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def run_demo(args) -> None:
    sim_port = args.sim_port or _free_port("127.0.0.1")
    sim_app = build_sim(args)
    sim_config = uvicorn_config(sim_app, "127.0.0.1", sim_port, "warning")
    sim_config.server_header, sim_config.date_header = True, True
    sim_server = uvicorn.Server(sim_config)
    # power from the simulator's dcgm-exporter lines, each simulated GPU mapped to its model
    from .sim.power import gpu_models

    power_gpu = [f"{gpu}={model}" for gpu, model in gpu_models(sim_app.engine).items()]
    settings = Settings(upstream=[f"sim=http://127.0.0.1:{sim_port}"], host=args.host, port=args.port,
                        power_source="dcgm", power_dcgm_url=f"http://127.0.0.1:{sim_port}/metrics",
                        power_gpu=power_gpu)
    proxy_server = uvicorn.Server(uvicorn_config(ProxyApp(settings), args.host, args.port, "info"))
    for server in (sim_server, proxy_server):
        server.install_signal_handlers = lambda: None  # noqa: E731 - handled below
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
    log.info("demo: proxy on %s (metrics %s/metrics), simulator on http://127.0.0.1:%d",
             url, url, sim_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

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
