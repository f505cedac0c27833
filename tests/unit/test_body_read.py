"""The body reader's stall deadline (proxy.core.budget.Body.read): it is a deadline on
progress, not on the whole body; a body that stops arriving is Stalled; and a
cancellation that is not the deadline's stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from proxy.core.budget import Body, BodyBudget, Stalled


def pieces(n: int, gap: float, stall_after: bool = False):
    """An ASGI receive giving `n` pieces of a body `gap` seconds apart (then waiting for
    ever, with `stall_after`, instead of ending the body)."""
    sent = 0

    async def receive() -> dict:
        nonlocal sent
        if sent:
            await asyncio.sleep(gap)
        sent += 1
        if sent > n:
            await asyncio.Event().wait()
        more = sent < n or stall_after
        return {"type": "http.request", "body": b"x" * 10, "more_body": more}

    return receive


def read(receive, stall: float) -> bytes:
    async def go() -> bytes:
        reading = Body(BodyBudget(1 << 20)).read(receive, 1 << 20, None, stall)
        return await asyncio.wait_for(reading, 30)  # a deadline that never fires fails here

    return asyncio.run(go())


def test_a_body_that_keeps_coming_is_read_whole_past_the_deadline():
    # 20 pieces 50 ms apart take ~1 s in all, twice the 0.5 s deadline: each piece moves it
    assert read(pieces(20, 0.05), stall=0.5) == b"x" * 200


def test_a_body_that_stops_arriving_is_stalled():
    with pytest.raises(Stalled):
        read(pieces(3, 0.0, stall_after=True), stall=0.3)


def test_a_cancellation_of_the_reader_is_not_a_stall():
    async def go() -> None:
        body = Body(BodyBudget(1 << 20))
        task = asyncio.create_task(body.read(pieces(1, 0.0, stall_after=True), 1 << 20, None, 30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert body.reserved == 10  # what it held is the caller's to release

    asyncio.run(go())


def test_the_deadline_leaves_no_timer_behind():
    async def go() -> int:
        body = Body(BodyBudget(1 << 20))
        await body.read(pieces(2, 0.0), 1 << 20, None, 30)
        loop = asyncio.get_running_loop()
        return len([h for h in loop._scheduled if not h.cancelled()])  # type: ignore[attr-defined]

    assert asyncio.run(go()) == 0


def test_the_pieces_make_the_body_and_one_piece_is_the_body():
    """Pieces are gathered in arrival order (the e2e suite holds the memory: a 44 MiB body
    is held once, test_hostile_third_bodies); a body of one piece is that piece."""
    parts = [bytes([i]) * (1000 + i) for i in range(1, 40)]

    def given(pieces: list[bytes]):
        it = iter(pieces)

        async def receive() -> dict:
            body = next(it)
            return {"type": "http.request", "body": body, "more_body": body is not pieces[-1]}

        return receive

    async def go(pieces: list[bytes]) -> bytes:
        return await Body(BodyBudget(1 << 20)).read(given(pieces), 1 << 20, None, 30)

    assert asyncio.run(go(parts)) == b"".join(parts)
    assert asyncio.run(go(parts[:1])) is parts[0]
