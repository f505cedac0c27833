"""phasewatch: an instrumenting reverse proxy for self-hosted LLM engines.

The package, from the bottom layer up (a layer imports only from the layers below it):

- ``measure/``: the request timeline and its figures, every Prometheus metric, precision
  labels, the recorder (observations and the per-request log line), the summary table;
- ``transport/``: the upstream HTTP client(s);
- ``engines/``: one module per engine (wire tap, detection, models, precision, gauges);
- ``core/``: the data path (access, routing, admission gate, relay);
- ``services/``: side services (GPU power, engine state, status page data);
- ``settings``, ``api`` (the own routes), ``app`` (the ASGI dispatcher);
- ``runtime/``: uvicorn, workers, log lines;
- ``tools/``: the command line, bench, report, demo;
- ``sim/``: the engine simulator (nothing above imports it but ``tools/``).
"""

__version__ = "0.1.0"
