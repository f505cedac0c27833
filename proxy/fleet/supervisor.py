"""Background loops that outlive their bugs.

A loop that reads an engine (model lists, gauges) meets whatever an engine answers; one
odd answer must not end the loop and freeze what it feeds until a restart. :func:`every`
runs a step at its interval, logs the first failure of a streak once (with its
traceback) and the recovery once, and carries on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def every(
    interval: float,
    step: Callable[[], Awaitable[object]],
    what: str,
    first_delay: float = 0.0,
    next_delay: Callable[[], float] | None = None,
) -> None:
    """Run `step` every `interval` seconds until cancelled; `what` names it in the log.
    `next_delay`, when given, says how long to wait after each step instead."""
    failing = False
    await asyncio.sleep(first_delay)
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            if not failing:
                log.exception("%s failed; trying again every %gs", what, interval)
            failing = True
        else:
            if failing:
                log.info("%s works again", what)
            failing = False
        await asyncio.sleep(interval if next_delay is None else next_delay())
