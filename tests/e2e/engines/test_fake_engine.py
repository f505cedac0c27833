"""The shared fake engine keeps the promises its users rely on: the standard answers, a
test's answer or script taking what it is given, every request recorded as it arrived,
bodies bounded, and the connection-level options (refuse, hang)."""

from __future__ import annotations

import socket

import httpx

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.servers import wait_for


def test_the_standard_answers_list_the_models_and_complete_and_fail_on_demand():
    with FakeEngine(models=["a", "b"], prompt_tokens=7) as engine:
        models = httpx.get(engine.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        assert httpx.get(engine.url + "/tenant/v1/models").status_code == 200
        assert engine.lists == 2
        assert httpx.get(engine.url + "/metrics").status_code == 404  # a probe
        r = httpx.post(engine.url + "/v1/chat/completions", json={"model": "b", "messages": []})
        assert r.json()["model"] == "b" and r.json()["usage"]["prompt_tokens"] == 7
        engine.fail = True
        assert httpx.get(engine.url + "/v1/models").status_code == 500
        assert httpx.post(engine.url + "/v1/chat/completions", json={}).status_code == 500
        assert [r.json().get("model") for r in engine.posts()] == ["b", None]


def test_a_request_is_recorded_before_the_answer_and_none_falls_back_to_the_standard():
    counts: list[int] = []

    def answer(req: Request) -> Reply | None:
        counts.append(len(engine.requests))
        if req.target == "/mine":
            return Reply(response(201, b"mine"))
        return None

    with FakeEngine(answer) as engine:
        with httpx.Client(base_url=engine.url) as client:
            assert client.get("/mine", headers={"X-Case": "Kept"}).status_code == 201
            assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
        assert counts == [1, 2]
        first = engine.requests[0]
        assert first.header("x-case") == "Kept" and "X-Case" in [k for k, _ in first.headers]
        assert {r.conn for r in engine.requests} == {1}  # one kept-alive connection


def test_a_script_takes_generation_requests_and_script_takes_chooses_otherwise():
    async def script(req: Request, reader, writer) -> None:
        writer.write(response(200, b"scripted " + req.target.encode()))
        await writer.drain()

    with FakeEngine(script=script) as engine:
        assert httpx.post(engine.url + "/v1/x", content=b"{}").content == b"scripted /v1/x"
        assert httpx.get(engine.url + "/v1/models").json()["object"] == "list"
        assert httpx.get(engine.url + "/metrics").status_code == 404
    with FakeEngine(script=script, script_takes=lambda r: r.target == "/metrics") as engine:
        assert httpx.get(engine.url + "/metrics").content == b"scripted /metrics"
        assert httpx.post(engine.url + "/v1/x", json={"model": "m"}).json()["model"] == "m"


def test_bodies_are_kept_up_to_the_bound_and_read_whole():
    with FakeEngine(keep_bodies_up_to=1000) as engine:
        big = b"x" * (3 << 20)
        assert httpx.post(engine.url + "/v1/x", content=big).status_code == 200
        assert httpx.post(engine.url + "/v1/y", content=b"small").status_code == 200
        bodies = [r.body for r in engine.posts()]
        assert 1000 <= len(bodies[0]) < len(big) and set(bodies[0]) == {ord("x")}
        assert bodies[1] == b"small"  # the big one was read to its end: framing kept


def test_a_request_is_kept_as_its_bytes_too():
    sent = b"POST /v1/x?a=1 HTTP/1.1\r\nHost:  odd \r\nX-Case: Kept\r\ncontent-length: 2\r\n\r\n{}"
    with FakeEngine() as engine:
        port = int(engine.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(sent)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert [r.raw for r in engine.requests] == [sent]  # spaces and case as they came


def test_refuse_closes_at_once_and_a_hang_ends_when_the_peer_closes():
    with FakeEngine(refuse=True) as engine:
        port = int(engine.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert s.recv(10) == b""
        assert engine.connections == 1 and engine.requests == []
    with FakeEngine(answer=lambda req: Reply(then="hang")) as engine:
        port = int(engine.url.rsplit(":", 1)[1])
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /x HTTP/1.1\r\nhost: x\r\n\r\nmore bytes, read and dropped")
        wait_for(lambda: engine.requests, what="the request read")
        assert engine.ended == []
        s.close()
        wait_for(lambda: engine.ended, what="the hang to see the close")
