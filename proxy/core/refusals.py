"""Refusals: the answers the proxy gives itself instead of an upstream's, in one shape.

A refusal is counted, said in the log (at most one line per reason every few seconds,
:mod:`proxy.core.limited`) and answered as an error in the shape the client parses.
One refused before any measured exchange existed (a body too large, a pool that is all
down) is counted in ``rejected_total{reason}``; one of a measured exchange (the queue
full, the proxy draining) marks the exchange ``rejected``, and the recorder counts it
with the other requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ErrorShape
from .headers import Headers
from .limited import LimitedLog

if TYPE_CHECKING:
    from ..measure.metrics import Metrics
    from .answer import Reply
    from .exchange import Exchange

#: A refused client may come back in a second.
RETRY_AFTER: tuple[tuple[bytes, bytes], ...] = ((b"retry-after", b"1"),)


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused request: what the client gets, and how it is counted and said."""

    status: int
    message: str
    kind: str  # the error's type, as clients parse it
    #: The bounded reason: the ``rejected_total`` label and the log line's ``limit``.
    reason: str = ""
    #: The log line's format and its arguments; empty: "refused a request (<reason>):
    #: <message>".
    log_format: str = ""
    args: tuple[object, ...] = ()
    headers: tuple[tuple[bytes, bytes], ...] = ()
    #: The engine's own error shape (its native API), else OpenAI's.
    shape: ErrorShape | None = None
    #: Counted in ``rejected_total`` (when refused before any exchange existed).
    counted: bool = True
    #: No log line (an answer the client is expected to get, such as "not found").
    quiet: bool = False


class Refused(Exception):
    """Raised where a request cannot go on; the relay answers `refusal`."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class Refusals:
    """Answers refusals: counts, says and sends them (the one place that does)."""

    def __init__(self, metrics: Metrics, limited_log: LimitedLog) -> None:
        self.metrics = metrics
        self.limited_log = limited_log

    async def refuse(self, reply: Reply, r: Refusal, ex: Exchange | None = None) -> None:
        """Answer `r`; `ex`: the measured exchange it ends, if one exists."""
        if ex is not None:
            ex.outcome, ex.status = "rejected", r.status  # the recorder counts it
        elif r.counted:
            self.metrics.rejected_total.labels(r.reason).inc()
        if not r.quiet:
            if r.log_format:
                self.limited_log.warning(r.reason, r.log_format, *r.args)
            else:
                self.limited_log.warning(
                    r.reason, "refused a request (%s): %s", r.reason, r.message
                )
        headers: Headers = list(r.headers)
        await reply.error(r.status, r.message, r.kind, headers, r.shape)
