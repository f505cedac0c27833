"""The engine simulator served over HTTPS, for the TLS end-to-end test.

python tests/support/tls_sim.py CERTFILE KEYFILE PORT [phasewatch simulate flags]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.sim.command import add_arguments, from_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("certfile")
    parser.add_argument("keyfile")
    parser.add_argument("port", type=int)
    add_arguments(parser)
    args = parser.parse_args()
    uvicorn.run(
        from_args(args),
        host="127.0.0.1",
        port=args.port,
        ssl_certfile=args.certfile,
        ssl_keyfile=args.keyfile,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
