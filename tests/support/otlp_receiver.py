"""A real OTLP/HTTP receiver for tests: an HTTP server on loopback that decodes what the
exporters send with the official ``opentelemetry-proto`` messages.

``POST /v1/traces`` takes an ``ExportTraceServiceRequest``, ``POST /v1/metrics`` an
``ExportMetricsServiceRequest`` (protobuf, gzip or not). Spans and metric data points
are kept, flattened into plain dicts, for the test to read; :meth:`wait_spans` polls
with a deadline instead of sleeping.
"""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan


def value(v: AnyValue):
    """A protobuf AnyValue as a Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(x) for x in v.array_value.values)
    if kind is None:
        return None
    return getattr(v, kind)


def attrs(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


class Receiver:
    """OTLP/HTTP receiver on 127.0.0.1 (a free port); `endpoint` is its base URL."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.points: list[dict] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep the test output clean
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    reply = receiver._traces(body).SerializeToString()
                elif self.path == "/v1/metrics":
                    reply = receiver._metrics(body).SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _traces(self, body: bytes) -> ExportTraceServiceResponse:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out = []
        for rs in req.resource_spans:
            resource = attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        {
                            "service": resource.get("service.name"),
                            "resource": resource,
                            "scope": ss.scope.name,
                            "name": s.name,
                            "kind": PbSpan.SpanKind.Name(s.kind),
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attributes": attrs(s.attributes),
                            "status": s.status.code,
                            "events": [
                                {
                                    "name": e.name,
                                    "time": e.time_unix_nano,
                                    "attributes": attrs(e.attributes),
                                }
                                for e in s.events
                            ],
                        }
                    )
        with self.lock:
            self.requests += 1
            self.spans.extend(out)
        return ExportTraceServiceResponse()

    def _metrics(self, body: bytes) -> ExportMetricsServiceResponse:
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        out = []
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind != "histogram":
                        continue
                    for p in m.histogram.data_points:
                        out.append(
                            {
                                "name": m.name,
                                "unit": m.unit,
                                "attributes": attrs(p.attributes),
                                "count": p.count,
                                "sum": p.sum,
                                "bounds": tuple(p.explicit_bounds),
                            }
                        )
        with self.lock:
            self.requests += 1
            self.points.extend(out)
        return ExportMetricsServiceResponse()

    def wait_spans(self, predicate, timeout: float = 30.0) -> list[dict]:
        """Spans once `predicate(spans)` holds; fails the test after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver did not get the spans in {timeout}s: {spans}")
            time.sleep(0.05)

    def wait_points(self, predicate, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                points = list(self.points)
            if predicate(points):
                return points
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver did not get the metrics in {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
