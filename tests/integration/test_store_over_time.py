"""A store as production stores behave over time, on real FUSE mounts and a real daemon.

Owns: a store throttling for a while (503 SlowDown on every GET, moto behind
tests/support/faultproxy.py) is retried as base.retry_call says and says so in the
daemon's log once per episode, not once per retry.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
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


def test_a_hung_store_s_miss_is_eio_by_read_deadline_not_after_every_attempt(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A store that accepts GETs and never answers: each try ends at read_timeout and no
    retry begins past read_deadline, so the miss is EIO after about read_deadline (two
    tries here), not max_attempts x read_timeout (5 tries, ~150 s at the defaults), and
    reads of the file are served again once the store answers."""
    s3_server.apply_env(monkeypatch)
    data = os.urandom(64 << 10)
    s3_server.create(bucket_name, {"h.bin": data})
    config = tmp_path / "silofs.toml"
    config.write_text("[backend]\nread_timeout = 2.0\nmax_attempts = 5\nread_deadline = 3.0\n")
    up = urlsplit(s3_server.endpoint_url)
    node = make_node(args=("--config", str(config)))
    node.expect_errors(r"reading h\.bin chunk 0")
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        p.set_plan(FaultPlan(faults=[Fault("delay", seconds=60.0, path=r"h\.bin")]))
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            with open(mp / "h.bin", "rb", buffering=0) as f:
                f.read(4096)
        took = time.monotonic() - t0
        assert err.value.errno == errno.EIO
        gets = p.stats["delay"]
        # Two tries (the second began 2 s + backoff in, before the 3 s deadline) per
        # time the kernel asked; 5 each before, and 10+ s.
        assert gets in (2, 4), p.stats
        assert took < 9.0, f"EIO after {took:.1f}s"
        p.set_plan(FaultPlan())

        def served() -> bool:
            try:
                return (mp / "h.bin").read_bytes() == data
            except OSError:
                drop_file_cache(mp / "h.bin")
                return False

        wait_for(served, timeout=20, what="h.bin read once the store answers")


def _credentials_file(path: Path, key_id: str) -> None:
    path.write_text(
        f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = secret-of-{key_id}\n"
    )


def test_a_rotated_credentials_file_is_read_again_when_the_store_refuses_the_old_key(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """The daemon's key comes from ~/.aws/credentials; the file is rewritten with a new
    key and the old one revoked (a key rotation; a tool renewing session credentials in
    the file). Cached chunks are served throughout, and the next uncached read and the
    next listing sign with the new key: before, the daemon kept the key it read first
    and every miss was EIO until it was restarted."""
    s3_server.apply_env(monkeypatch)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    creds = tmp_path / "credentials"
    _credentials_file(creds, "AKIASILOFSOLDKEY0000")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    files = {"a.bin": os.urandom(64 << 10), "b.bin": os.urandom(64 << 10)}
    s3_server.create(bucket_name, files)
    up = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        node = make_node()
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "mnt", "--endpoint-url", p.url)
        assert (mp / "a.bin").read_bytes() == files["a.bin"]
        wait_for(lambda: node.status()["datasets"][0]["cached_chunks"] == 1, what="admitted")
        _credentials_file(creds, "AKIASILOFSNEWKEY0000")
        old_key = ("authorization", "Credential=AKIASILOFSOLDKEY0000/")
        p.set_plan(FaultPlan(faults=[Fault("http_403", header=old_key)]))
        drop_file_cache(mp / "a.bin")
        assert (mp / "a.bin").read_bytes() == files["a.bin"]  # a hit: no request
        assert (mp / "b.bin").read_bytes() == files["b.bin"]
        s3_server.put(bucket_name, "c.bin", b"listed with the new key")
        res = subprocess.run(
            [sys.executable, "-m", "silofs_ctl", "refresh", "--wait", s3_server.uri(bucket_name)]
            + ["--socket", node.socket],
            capture_output=True,
            text=True,
            env=node.env,
            timeout=120,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        wait_for(lambda: (mp / "c.bin").exists(), timeout=10, what="c.bin listed")
        assert (mp / "c.bin").read_bytes() == b"listed with the new key"
        refused = [r for r in p.settled_history() if r.fault == "http_403"]
        assert len(refused) <= 2, refused  # the GET and the page signed with the old key
        log = (node.logs / "daemon.log").read_text()
        assert log.count("AWS credentials changed") == 1, log[-3000:]


def test_a_hung_store_leaves_other_datasets_misses_a_fetch_thread(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """One dataset's store accepts GETs and never answers (read_timeout, 30 s, each
    attempt, 5 attempts): 20 readers' misses hold the daemon's fetch_threads (16) and
    no more, and a miss of another dataset, on a store that answers, is served at once
    in one of the 4 threads kept past them, as are status and hits. Before, the hung
    store's GETs held every thread, each through all its attempts, and another
    dataset's miss waited 151 s."""
    s3_server.apply_env(monkeypatch)
    hung = {f"s{i}.bin": os.urandom(64 << 10) for i in range(20)}
    s3_server.create(bucket_name, {**hung, "cached.bin": b"cached before the hang"})
    s3_server.create(bucket_name + "-fine", {"x.bin": b"a store that answers"})
    up = urlsplit(s3_server.endpoint_url)
    node = make_node()
    node.expect_errors(r"reading s\d+\.bin chunk 0")
    readers: list[threading.Thread] = []
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        mp = node.mount(s3_server.uri(bucket_name), tmp_path / "hung", "--endpoint-url", p.url)
        fine = s3_server.uri(bucket_name + "-fine")
        other = node.mount(fine, tmp_path / "fine", "--endpoint-url", s3_server.endpoint_url)
        assert (mp / "cached.bin").read_bytes() == b"cached before the hang"
        p.set_plan(FaultPlan(faults=[Fault("delay", seconds=120.0, path=r"s\d+\.bin")]))
        readers = [
            threading.Thread(target=_read_all, args=([mp / name],), daemon=True) for name in hung
        ]
        for t in readers:
            t.start()
        p.wait_stats(lambda s: s["delay"] >= 16, timeout=20)
        t0 = time.monotonic()
        assert (other / "x.bin").read_bytes() == b"a store that answers"
        took = time.monotonic() - t0
        assert node.status()["datasets"]  # the daemon answers
        drop_file_cache(mp / "cached.bin")
        assert (mp / "cached.bin").read_bytes() == b"cached before the hang"
        assert took < 5, f"a miss of another dataset waited {took:.1f}s behind the hung store"
        assert p.stats["delay"] == 16  # fetch_threads: the spares are other datasets'
    for t in readers:  # the proxy closed: the hung GETs fail, their reads end
        t.join(timeout=120)
    assert not any(t.is_alive() for t in readers)
