"""The two C twins of the relay's per-read checks (everything else is in pyproject.toml).

Optional: where no compiler is at hand the build goes on without them, and their Python
versions run (proxy.transport.lean.whole_chunk_py, proxy.engines.token_read.token_kind_py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("proxy.transport._chunk", ["proxy/transport/_chunk.c"], optional=True),
        Extension("proxy.engines._sse", ["proxy/engines/_sse.c"], optional=True),
    ]
)
