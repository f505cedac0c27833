"""The compiled parts of the relay's per-read checks (everything else is in pyproject.toml).

Built by every install, the container image's included (deploy/Dockerfile's build stage
has a compiler): proxy.engines.token_read and proxy.transport.wire say what they answer.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("proxy.transport._chunk", ["proxy/transport/_chunk.c"]),
        Extension("proxy.engines._sse", ["proxy/engines/_sse.c"]),
    ]
)
