"""A store as production stores behave over time, on real FUSE mounts and a real daemon.

Owns: a store throttling for a while (503 SlowDown on every GET, moto behind
tests/support/faultproxy.py) is retried as base.retry_call says and says so in the
daemon's log once per episode, not once per retry.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]


def _read_all(paths: list[Path]) -> dict[str, bytes | int]:
    """Each path read in its own thread: its bytes, or the errno its read failed with."""
    out: dict[str, bytes | int] = {}

    def read(path: Path) -> None:
        try:
            out[path.name] = path.read_bytes()
        except OSError as exc:
            out[path.name] = exc.errno or 0

    threads = [threading.Thread(target=read, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def test_a_throttling_store_is_one_warning_not_one_per_retry(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """Every GET answered 503 SlowDown: each fetch is retried (max_attempts, 5 GETs), the
    reads fail with EIO, and the daemon's log says the store is throttling in one WARNING
    line, not in one per retry (6 files x 4 retries = 24 lines before: minutes of it from
    16 fetch threads was a log line every few milliseconds)."""
    s3_server.apply_env(monkeypatch)
    files = {f"o{i}.bin": os.urandom(64 << 10) for i in range(6)}
    s3_server.create(bucket_name, files)
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node = make_node()
        node.expect_errors(r"reading o\d\.bin chunk 0")
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        p.set_plan(FaultPlan(faults=[Fault("http_503", methods="GET", path=r"o\d\.bin")]))
        got = _read_all([mp / name for name in files])
        assert got == dict.fromkeys(files, errno.EIO)
        gets = sum(1 for r in p.settled_history() if r.method == "GET" and ".bin" in r.target)
        assert gets == 5 * len(files)  # every fetch retried to max_attempts
        retried = [
            line
            for line in (node.logs / "daemon.log").read_text().splitlines()
            if " WARNING " in line and "; retry " in line
        ]
        assert len(retried) == 1, retried
        assert node.status()["datasets"][0]["store_retries"] == 4 * len(files)
        p.set_plan(FaultPlan())

        def reads() -> bool:
            for name, data in files.items():
                try:
                    if (mp / name).read_bytes() != data:
                        return False
                except OSError:
                    drop_file_cache(mp / name)
                    return False
            return True

        wait_for(reads, timeout=20, what="every file read once the store is back")
