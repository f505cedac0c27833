"""What every engine provides (the :class:`Dialect` protocol), and the pieces they share.

An engine module knows everything about one engine: its wire format (which endpoints
generate, how to ask for usage and strip it again, how to tap its streams and read
counts, timings and errors), how to recognise it, how to list its models and read their
precision, how to read its own state (running requests, KV cache), and how a client
reaches its tokenizer (the bench). The core calls it through :class:`Dialect` and never
asks which engine it is.

A *tap* watches one response body as it passes through the relay. It finds event
boundaries on bytes, marks the events that carry generated output (first/last/gaps),
keeps the few events that carry usage, timings or errors for parsing at the end, and,
when the proxy injected a usage request, removes what that added before the client
sees it. It never parses an event as JSON on the way through.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..measure.buckets import GAP_BUCKETS
from ..measure.kvcache import KVShape
from ..measure.labels import plain
from ..measure.precision import Precision
from ..measure.timeline import EngineTimings, Marks, Usage
from .framing import MAX_EVENT_BYTES, Framer, Raw

if TYPE_CHECKING:
    import httpx

    from .probe import Prober

#: The gap bucket of two events that arrive in one read.
_ZERO_GAP = bisect_left(GAP_BUCKETS, 0.0)


@dataclass(slots=True)
class Prepared:
    """What a dialect decided about a request before it goes upstream."""

    endpoint: str  # bounded label: chat, completions, ollama_chat, ...
    model: str | None
    stream: bool
    #: What goes upstream is `body` then `tail`: the client's bytes, or, where usage was
    #: injected, all of them but the closing brace (a view, not a copy) and a tail that
    #: adds the field and closes the object. Why two pieces: a copy of a body of many
    #: MiB holds the event loop for tens of milliseconds (every other stream waits).
    body: bytes | memoryview
    strip_usage: bool = False  # the proxy asked for usage: remove it on the way back
    tail: bytes = b""


@dataclass(slots=True)
class Outcome:
    """What the dialect read from a finished response."""

    usage: Usage = field(default_factory=Usage)
    engine: EngineTimings = field(default_factory=EngineTimings)
    error_kind: str | None = None  # midstream, truncated, protocol, upstream_status
    error_message: str | None = None
    finished: bool = False  # the response reached its normal end
    response_model: str | None = None  # the model the engine says answered
    finish_reasons: tuple[str, ...] = ()  # why generation stopped, per choice
    #: The usage and timing fields whose values were implausible and dropped
    #: (proxy.measure.sanity); the recorder counts them.
    dropped: list[str] = field(default_factory=list)


class Tap:
    """Base tap: event framing and the per-event bookkeeping shared by SSE and NDJSON.

    Events are found by a :class:`~proxy.engines.framing.Framer` (linear, bounded); the
    tap forwards whole events only, so what the client has received always ends on an
    event boundary and an error event of the proxy's own can follow it cleanly.
    Subclasses implement :meth:`_event`. Marks are written straight into `marks`; gap
    counts into a bucket array handed to the metrics once per request.
    """

    __slots__ = (
        "_fr",
        "_last_out",
        "done",
        "error_payload",
        "finish_payload",
        "finish_seen",
        "gap_counts",
        "gap_sum",
        "marks",
        "rewrites",
        "timings_payload",
        "usage_payload",
    )

    #: NDJSON taps split on newlines, SSE taps on blank lines.
    lines = False

    def __init__(self, marks: Marks, limit: int = MAX_EVENT_BYTES) -> None:
        self.marks = marks
        self.gap_counts = [0] * (len(GAP_BUCKETS) + 1)
        self.gap_sum = 0.0
        self._last_out = 0.0
        self.done = False  # saw the stream's terminator; without it the relay appends
        # the dialect's stream_error() and the request counts as an error (truncated)
        self.error_payload: bytes | None = None
        self.usage_payload: bytes | None = None
        self.timings_payload: bytes | None = None
        self.finish_seen = False
        self.finish_payload: bytes | None = None  # the last event that had a finish reason
        self._fr = Framer(limit, lines=self.lines)
        #: Whether the tap changes what it forwards (then :meth:`_rewrite` decides).
        self.rewrites = False

    @property
    def oversized(self) -> int:
        """Events too large to hold, passed through unmeasured."""
        return self._fr.oversized

    def _output(self, now: float) -> None:
        """An event carrying generated output passed at `now`."""
        m = self.marks
        if m.t_first is None:
            m.t_first = now
        else:
            gap = now - self._last_out
            self.gap_counts[bisect_left(GAP_BUCKETS, gap)] += 1
            self.gap_sum += gap
        self._last_out = now
        m.t_last = now
        m.output_events += 1

    def _outputs(self, now: float, n: int) -> None:
        """`n` (>= 1) events carrying output passed together at `now`: what `n` calls of
        :meth:`_output` record (every event after the first a zero gap), in one call."""
        self._output(now)
        if n > 1:
            self.gap_counts[_ZERO_GAP] += n - 1
            self.marks.output_events += n - 1

    def _event(self, ev: bytes, now: float) -> None:  # pragma: no cover - abstract
        """Look at one whole event (its terminator included)."""
        raise NotImplementedError

    def _rewrite(self, pieces: list[bytes], now: float) -> bytes:  # pragma: no cover
        """Look at each piece and return what to forward instead of them (taps that
        change a stream: ``rewrites`` set)."""
        raise NotImplementedError

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Take one chunk of the body; return the bytes to forward now (whole events).
        Raw pieces (an oversized event) go through unexamined."""
        pieces = self._fr.split(chunk)
        return self._pass(pieces, chunk, now) if pieces else b""

    def _pass(self, pieces: list[bytes], chunk: bytes, now: float) -> bytes:
        """Look at each of `pieces` (split from `chunk`); return the bytes to forward."""
        fr = self._fr
        if self.rewrites:
            return self._rewrite(pieces, now)
        event = self._event
        if fr.passed:
            for ev in pieces:
                if type(ev) is not Raw:
                    event(ev, now)
        else:
            for ev in pieces:
                event(ev, now)
        if fr.whole:  # the chunk was whole events: forward it as it came
            return chunk
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def flush(self) -> bytes:
        """Bytes still held back when the upstream ends, to forward as they are (an
        unfinished last event is looked at when it could stand as a whole one)."""
        return self._finish(self.marks.t_last or 0.0, mend=False)

    def end(self, now: float) -> bytes:
        """What to forward when the upstream's body ends (cleanly or not). When the
        stream reached its terminator or an error event, what is held goes out as the
        engine sent it; otherwise the relay appends an error event, so the stream is made
        to end on an event boundary first: an unfinished event whose lines all ended is
        closed with a blank line, one cut inside a line is dropped (a client would fail
        to parse it and never see the error)."""
        return self._finish(now, mend=True)

    def _finish(self, now: float, mend: bool) -> bytes:
        fr = self._fr
        rest = fr.take()
        whole = bool(rest) and fr.complete(rest)
        out = b""
        if whole:
            if self.rewrites:
                out = self._rewrite([rest], now)
            else:
                self._event(rest, now)
                out = rest
        out += self._release()
        if rest and not whole and (not mend or self.done or self.error_payload is not None):
            out += rest  # nothing follows it: as the engine sent it
        if mend and not self.done and self.error_payload is None:
            out += fr.closer(out if out else (fr.last if fr.in_raw else b""))
        return out

    def _release(self) -> bytes:
        """Whole events a tap held back (the SSE tap's finish events), at the end."""
        return b""


def loads(payload: bytes | None):
    """Parse a kept event payload; None when absent or not JSON (never raises)."""
    if not payload:
        return None
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def error_message(obj) -> str:
    """A short message from an engine's error object, whatever its shape."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("type") or err)[:300]
        return str(err)[:300]
    return "upstream error"


#: Longest model name or finish reason kept from a response (they go on spans).
_MAX_RESPONSE_TEXT = 256
#: Most finish reasons kept (one per choice; a client may ask for many choices).
_MAX_FINISH_REASONS = 16


def read_response(obj: dict, out: Outcome) -> None:
    """The answering model and the finish reasons, from a response object of any engine:
    OpenAI ``model`` and ``choices[].finish_reason``, Ollama ``done_reason``,
    llama-server ``stop_type``."""
    model = obj.get("model")
    if isinstance(model, str) and model and out.response_model is None:
        out.response_model = model[:_MAX_RESPONSE_TEXT]
    reasons = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices[:_MAX_FINISH_REASONS]:
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str):
                reasons.append(reason[:_MAX_RESPONSE_TEXT])
    for key in ("done_reason", "stop_type"):
        reason = obj.get(key)
        if isinstance(reason, str) and reason:
            reasons.append(reason[:_MAX_RESPONSE_TEXT])
    if reasons and not out.finish_reasons:
        out.finish_reasons = tuple(reasons)


def no_generation(status: int) -> bool:
    """An answer that by its status carries no generation to read (204 No Content, 304,
    a redirect): not a protocol error, and nothing to measure."""
    return status < 200 or status in (204, 205) or 300 <= status < 400


def settle(tap: Tap, out: Outcome, terminator: str) -> Outcome:
    """How a stream ended, from what its tap saw: an error event, no terminator (the
    engine cut it short: named in the message), or a normal end."""
    if tap.error_payload is not None:
        out.error_kind = "midstream"
        out.error_message = error_message(loads(tap.error_payload))
    elif not tap.done:
        out.error_kind = "truncated"
        out.error_message = f"stream ended without {terminator}"
    else:
        out.finished = True
    return out


#: An event carrying generated output: non-empty text, reasoning or a tool-call delta, or
#: a finish reason (the finish event carries the last token). Tolerates spaced JSON.
OUTPUT_RE = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning)":\s*"(?!")|"tool_calls":\s*\[\s*\{'
    rb'|"finish_reason":\s*"'
)
FINISH_RE = re.compile(rb'"finish_reason":\s*"')
USAGE_RE = re.compile(rb'"usage":\s*\{')
EMPTY_CHOICES_RE = re.compile(rb'"choices":\s*\[\s*\]')


# Per-event checks with the same answers as the patterns above, cheaper on the events
# that dominate a stream (a token delta, "finish_reason":null, no usage): a substring
# find decides those, the pattern runs only on the few events it cannot decide.
# (Substrings are searched with bytes.find, never `in`: `x in some_bytes` first tries x
# as an integer, and the exception that fails costs more than the search itself, several
# times an event.)

_CONTENT, _TEXT, _FINISH_KEY, _USAGE_KEY = (
    b'"content":"',
    b'"text":"',
    b'"finish_reason":',
    b'"usage":',
)


def is_output(payload: bytes) -> bool:
    """``OUTPUT_RE.search(payload) is not None``, fast for compact token deltas."""
    i = payload.find(_CONTENT)
    if i >= 0 and payload[i + 11 : i + 12] != b'"':
        return True
    i = payload.find(_TEXT)
    if i >= 0 and payload[i + 8 : i + 9] != b'"':
        return True
    return OUTPUT_RE.search(payload) is not None


def is_finish(payload: bytes) -> bool:
    """``FINISH_RE.search(payload) is not None``, fast for one ``"finish_reason":null``."""
    i = payload.find(_FINISH_KEY)
    if i < 0:
        return False
    if payload[i + 16 : i + 20] == b"null" and payload.find(_FINISH_KEY, i + 16) < 0:
        return False
    return FINISH_RE.search(payload) is not None


def has_usage(payload: bytes) -> bool:
    """``USAGE_RE.search(payload) is not None``, fast when there is no usage key."""
    return payload.find(_USAGE_KEY) >= 0 and USAGE_RE.search(payload) is not None


# --- what an engine offers the rest of the proxy ------------------------------------------


@dataclass(slots=True)
class ModelQuery:
    """What listing an engine's models needs: the client, how many names to take, and
    the models whose precision was read already (read only new ones)."""

    client: httpx.AsyncClient
    max_models: int  # names read in detail (precision, KV shape); every name is listed
    known: set[str]
    model_dir: str | None = None
    #: Whether a listed name may become a label value (proxy.measure.labels); names
    #: that do not fit are not listed (before the max_models cap: they take no place).
    fits: Callable[[str], bool] = plain


@dataclass(slots=True)
class ModelList:
    """An engine's models, with the precision of the ones read this time (None: the
    engine said nothing usable)."""

    names: list[str]
    precision: dict[str, Precision | None] = field(default_factory=dict)
    #: The KV-cache shape of the models read this time (None: the engine does not say).
    kv: dict[str, KVShape | None] = field(default_factory=dict)


#: An engine's own state per model: {model name ("" when the engine does not say):
#: {running | waiting | kv | loaded | vram | size | expiry: value}}.
EngineState = dict[str, dict[str, float]]


@dataclass(slots=True)
class EngineHistogram:
    """One of an engine's own histograms as it exported it: cumulative buckets."""

    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), +Inf last
    sum: float
    count: float


@dataclass(slots=True)
class EngineReading:
    """One scrape of an engine's own state, per model name ("" when it does not say)."""

    #: gauges: {model: {running | waiting | kv | kv_capacity | loaded | ...: value}}
    gauges: EngineState = field(default_factory=dict)
    #: its own counters, re-exported as they are: {model: {preemptions | ...: value}}
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    #: its own histograms: {model: {ttft | e2e | tpot: histogram}}
    histograms: dict[str, dict[str, EngineHistogram]] = field(default_factory=dict)
    #: the element type it keeps each model's KV cache in, where it says ("auto": the
    #: model's own dtype, from its config)
    kv_dtype: dict[str, str] = field(default_factory=dict)


class Tokenizer(Protocol):
    """An engine's own tokenizer, reached over its API (``phasewatch bench`` makes prompts
    of exact token lengths with it). It answers for one model."""

    #: The most tokens one request may hold, where the engine says (else None).
    max_model_len: int | None

    async def count(self, text: str) -> int:
        """The tokens of a one-message chat prompt of `text`: the chat template's own
        where the engine applies it; raises when the engine stops answering as it did."""


@dataclass(frozen=True, slots=True)
class Listing:
    """A model-list endpoint whose answers merge across upstreams: with several, a client
    asking it must see every model it can reach through the proxy. Each upstream whose
    engine serves the same path is asked `ask`; the `items` lists of their answers are
    merged (a model named twice, by its `key` field, kept once) under the `head` fields."""

    ask: str  # the path each upstream is asked
    items: str  # the answer's list of models: OpenAI ``data``, Ollama ``models``
    key: str  # the field of an item that names its model
    head: tuple[tuple[str, object], ...] = ()  # fields written before the list
    #: On the engine's own API (``native_prefix``): only its upstreams are asked, and an
    #: empty merge stands as the answer unless no upstream at all is up.
    native: bool = False


class Dialect(Protocol):
    """One engine as the proxy's core sees it: everything the core needs to know of an
    engine is a member here, so the core never asks which engine it is."""

    name: ClassVar[str]
    #: llama-server answers any model name with the one model it serves.
    answers_any_model: ClassVar[bool]
    #: The KV cache's element type when the engine does not say and no setting does: its
    #: documented default (llama.cpp and Ollama: f16), or None (unknown).
    kv_default_dtype: ClassVar[str | None]
    #: A cheap GET answering whether the engine is alive (the idle health probe).
    health_path: ClassVar[str]
    #: Model-management paths (and the paths under them), for --admin-api.
    admin_paths: ClassVar[frozenset[str]]
    #: Those of them whose GET and HEAD manage too (a fetch on the engine's host).
    admin_reads: ClassVar[frozenset[str]]
    #: Generation paths -> the request field whose zero unloads the model (an admin
    #: action in an ordinary request's body, refused as one by --admin-api).
    unload_fields: ClassVar[dict[str, str]]
    #: Its own ``/metrics`` samples of requests running and waiting, and of tokens
    #: generated (a counter): how a client sees load that is not its own (the bench).
    busy_gauges: ClassVar[tuple[str, ...]]
    generated_tokens: ClassVar[tuple[str, ...]]
    #: The measured endpoints, path -> bounded endpoint label (generations, and the
    #: whole-body requests such as embeddings).
    endpoints: ClassVar[dict[str, str]]
    #: The labels of `endpoints` whose answer is one whole body (embeddings, rerank ...):
    #: counted, timed and their prompt tokens read, never tapped as a stream.
    whole_endpoints: ClassVar[frozenset[str]]
    #: The path prefix of the engine's own API beside the OpenAI one (Ollama's ``/api/``):
    #: requests that act there (POST, DELETE) go only to upstreams of an engine with the
    #: same prefix, and the proxy's own errors there take :meth:`error_body`'s shape for
    #: that path. None: the engine has none.
    native_prefix: ClassVar[str | None]
    #: Model-list endpoints (path -> how their answers merge) across upstreams.
    model_lists: ClassVar[dict[str, Listing]]
    #: The request body's fields that name the model, the first present one counting
    #: (routing peeks at them before the upstream, and so the dialect, is known).
    model_fields: ClassVar[tuple[str, ...]]

    # --- recognising it -----------------------------------------------------------------
    @staticmethod
    async def detect(probe: Prober) -> bool:
        """Whether the engine behind `probe` is this one (tried in DETECTION_ORDER)."""

    # --- the request path -------------------------------------------------------------
    def endpoint(self, method: str, path: str) -> str | None:
        """The bounded endpoint label when (method, path) is measured (a generation, or a
        whole-body request such as embeddings), else None."""

    def prepare(
        self, endpoint: str, raw: bytes, inject_usage: bool, view: bytes | None = None
    ) -> Prepared | None:
        """What to send upstream; None when this request is not measured after all.
        `view`: what to parse instead of `raw` (a large body's bounded reduction, of the
        same shape; proxy.core.peek); the body sent is always `raw` or made from it."""

    def tap(
        self, content_type: str, marks: Marks, prepared: Prepared, limit: int = MAX_EVENT_BYTES
    ) -> Tap | None:
        """A tap for a streamed answer of this content type, or None (a whole body).
        `limit`: the most bytes of one event the tap holds for measurement."""

    def outcome(self, tap: Tap | None, body: bytes | None, status: int) -> Outcome:
        """What the finished answer said: usage, the engine's timings, errors."""

    def stream_error(self, message: str, endpoint: str = "") -> bytes:
        """A well-formed error event, in the stream's framing, to end a broken stream."""

    def error_body(
        self, status: int, message: str, kind: str, path: str = ""
    ) -> tuple[bytes, bytes]:
        """(content type, body) of an error the proxy itself answers on `path` with."""

    def canonical(self, model: str, listed: set[str]) -> str | None:
        """The listed name a request's model means, or None."""

    # --- off the request path -----------------------------------------------------------
    async def list_models(self, query: ModelQuery) -> ModelList | None:
        """The engine's models (None when it does not answer)."""

    async def read_state(self, client: httpx.AsyncClient, models: set[str]) -> EngineReading | None:
        """The engine's own state (None when it does not answer or has none)."""

    async def tokenizer(self, client: httpx.AsyncClient, model: str) -> Tokenizer | None:
        """The engine's tokenizer for `model` behind `client` (probed: None when the engine
        has none, or what answers is not this engine: prompt lengths are then estimated)."""

    def listed_context(self, entry: dict) -> int | None:
        """The context length (tokens) a ``/v1/models`` entry states, where this engine
        states one there."""

    async def served_file(self, client: httpx.AsyncClient) -> str | None:
        """The file the engine serves its one model from, where it says (its name tells
        the precision); None otherwise."""


def canonical_name(model: str, listed: set[str]) -> str | None:
    """A request's model when the engine lists it under exactly that name."""
    return model if model in listed else None
