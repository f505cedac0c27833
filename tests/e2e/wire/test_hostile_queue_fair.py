"""The admission queue is fair between clients: one client filling an upstream's queue
(``--max-queue``) cannot get another client's request refused.

With the queue full of one client's requests, a request from a client with none waiting
takes the place of that client's newest waiter (which gets the 429) and is answered; the
client holding the most is the one refused. A client is its API key's name where the key
names one, else its address.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import httpx

from ...support.fake_engine import FakeEngine, completion, json_response
from ...support.servers import start_proxy, wait_for

MODEL = "m"


def test_a_full_queue_refuses_the_client_holding_the_most_not_a_newcomer():
    release = asyncio.Event()

    async def script(req, reader, writer):
        await release.wait()  # the engine holds every request until the test lets go
        writer.write(json_response(200, completion(MODEL)))
        await writer.drain()

    engine = FakeEngine(models=[MODEL], script=script).start()
    proxy = start_proxy(
        f"e={engine.url}",
        args=["--engine", "e=openai", "--max-concurrency", "1", "--max-queue", "4"],
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def post(address: str) -> int:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, timeout=60) as c:
            return c.post(proxy.url + "/v1/chat/completions", json=body).status_code

    try:
        with cf.ThreadPoolExecutor(8) as pool:
            # the attacker: one running, four waiting (the queue full)
            attacker = [pool.submit(post, "127.0.0.2") for _ in range(5)]
            wait_for(lambda: len(engine.posts()) == 1, what="the attacker's first request running")

            def queued() -> float:
                text = httpx.get(proxy.url + "/metrics").text
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("phasewatch_queued_requests{")
                )

            wait_for(lambda: queued() == 4, what="the queue full of the attacker's")
            more = pool.submit(post, "127.0.0.2")  # the attacker again: refused
            assert more.result() == 429
            victim = pool.submit(post, "127.0.0.3")  # a newcomer: takes a place
            refused = wait_for(
                lambda: [f for f in attacker if f.done()], what="the attacker's newest refused"
            )
            assert [f.result() for f in refused] == [429]
            engine._loop.call_soon_threadsafe(release.set)  # type: ignore[union-attr]
            assert victim.result() == 200
            codes = sorted(f.result() for f in attacker)
        print(f"attacker: {codes} and 429 once more; the newcomer: 200")
        assert codes == [200, 200, 200, 200, 429]
    finally:
        proxy.stop()
        engine.stop()
