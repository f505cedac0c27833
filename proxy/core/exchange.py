"""One measured request as it travels the relay: its marks, its answer, its outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engines import Outcome, Prepared, Tap
from ..measure.kvcache import KVModel
from ..measure.timeline import EngineTimings, Marks, Usage

if TYPE_CHECKING:
    from ..fleet.upstream import Upstream


@dataclass(slots=True, eq=False)
class Exchange:
    """Everything known about one measured request; handed to the recorder at the end
    (it reads it through :class:`proxy.measure.recorder.Finished`)."""

    request_id: str
    upstream: Upstream
    prepared: Prepared
    marks: Marks
    model_label: str
    precision: str
    status: int = 0
    outcome: str = "ok"  # ok | error | aborted | rejected
    error_kind: str | None = None
    error_message: str | None = None
    abort_phase: str | None = None
    tap: Tap | None = None
    result: Outcome = field(default_factory=Outcome)
    #: The bounded client label (proxy.core.clients).
    client: str = "unknown"
    #: Who holds the request for limits shared by every client (the admission queue):
    #: its API key's name, else its address.
    owner: str = ""
    #: Set by the tracing hook (--otel): the trace id of a sampled request (for the
    #: exemplars and the log line), the hook's own handle of its span, and the trace
    #: context headers (traceparent, tracestate) to send upstream.
    trace_id: str | None = None
    trace: Any = None
    trace_headers: list[tuple[bytes, bytes]] | None = None
    #: Errors that did not fail the request (events too large to measure, a body in a
    #: coding phasewatch cannot decode): the recorder counts them with the others.
    side_errors: list[str] = field(default_factory=list)
    #: Requests of this upstream and model in flight when it was admitted, itself
    #: included (the decode batch it joined; 0 until admitted).
    batch: int = 0
    #: The client's flow while the answer is relayed (the stall watcher reads them): since
    #: when the client holds the stream back (it stopped reading; None while it reads),
    #: and when it last caught up.
    held_since: float | None = None
    released: float | None = None

    def client_flow(self, paused: bool, now: float) -> None:
        """The client stopped reading (`paused`) or caught up again, at `now`."""
        if paused:
            if self.held_since is None:
                self.held_since = now
        elif self.held_since is not None:
            self.held_since, self.released = None, now

    @property
    def upstream_name(self) -> str:
        return self.upstream.name

    @property
    def endpoint(self) -> str:
        return self.prepared.endpoint

    @property
    def stream(self) -> bool:
        return self.prepared.stream

    @property
    def streamed(self) -> bool:
        """Whether the answer was tapped as a stream (first-token marks exist)."""
        return self.tap is not None

    @property
    def usage(self) -> Usage:
        return self.result.usage

    @property
    def engine_timings(self) -> EngineTimings:
        return self.result.engine

    @property
    def dropped(self) -> list[str]:
        return self.result.dropped

    @property
    def gaps(self) -> tuple[list[int], float] | None:
        tap = self.tap
        return None if tap is None else (tap.gap_counts, tap.gap_sum)

    @property
    def kv(self) -> KVModel | None:
        """The model's KV cache as far as it is known (for the per-request bytes)."""
        return self.upstream.kv_of(self.model_label)

    def fail(self, kind: str, message: str, status: int | None = None) -> None:
        self.outcome, self.error_kind, self.error_message = "error", kind, message
        if status is not None:
            self.status = status

    def abort_phase_now(self) -> str:
        """The phase a request is in when its client hangs up."""
        m = self.marks
        if m.t_admit is None:
            return "queue"
        if m.t_first is None:
            return "prefill"
        if self.tap is not None and self.tap.finish_seen:
            return "usage"
        return "decode"
