"""Latency and bandwidth proxy for benchmarks: "plays the cloud link" in front of an emulator.

A thin wrapper over tests/faultproxy.py (stdlib only). Prints its URL on the first line of
stdout; point the client's endpoint at it. Runs until SIGINT/SIGTERM, then prints its
counters to stderr.

    python bench/delayproxy.py --upstream 127.0.0.1:9000 --first-byte-ms 20 --bandwidth 50MB/s
    python bench/delayproxy.py --upstream 127.0.0.1:9000 --fault http_503=0.01,methods=GET

MB is 10**6 bytes; the bandwidth cap is one token bucket shared by all connections.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tests.support.faultproxy import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
