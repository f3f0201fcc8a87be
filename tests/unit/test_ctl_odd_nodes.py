"""`silofs-ctl` and `silofs end-job` against a node that answers, but not as a silofs
daemon of this version does: JSON that is not JSON, a list where an object was meant,
an object without the fields. Each command says so in one line naming the node and
exits 1; never a traceback. The node is a tiny fake HTTP server on a Unix socket (a
thread), the commands real subprocesses.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from silofs.control.client import ANSWERED, unreadable_answer

ANSWERS = {
    "bad-json": b"{nope",
    "a-list": b"[1,2,3,4]",
    "no-fields": b"{}",
}


def _serve(listener: socket.socket, body: bytes) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # closed: the test is over
            return
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass


@pytest.fixture(params=sorted(ANSWERS))
def odd_node(request: pytest.FixtureRequest) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="silofs-odd-") as d:
        path = os.path.join(d, f"{request.param}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(16)
        thread = threading.Thread(target=_serve, args=(listener, ANSWERS[request.param]))
        thread.start()
        try:
            yield path
        finally:
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            thread.join(10)


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SILOFS_SOCKET": "/nonexistent"},
    )


COMMANDS = [
    ("status", "--socket", "{s}"),
    ("forget", "ds", "--socket", "{s}"),
    ("allocate-cache", "ds", "1GB", "--socket", "{s}"),
    ("allocate-io", "j1", "10MB/s", "--socket", "{s}"),
    ("admission", "ds", "lru", "--socket", "{s}"),
    ("refresh", "ds", "--socket", "{s}"),
    ("cluster", "status", "--nodes", "{s}"),
    ("cluster", "set", "--members", "tls://h1:7470", "--name", "c", "--nodes", "{s}"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_node_answering_odd_json_is_one_line(odd_node: str, command: tuple[str, ...]) -> None:
    res = run("silofs_ctl", *(a.format(s=odd_node) for a in command))
    if command[:2] == ("cluster", "status") and odd_node.endswith("no-fields"):
        # {} has no cluster name: read as a node in no cluster, as the daemon says it.
        assert res.returncode == 0 and "in no cluster" in res.stdout, res
        return
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert lines and lines[-1].startswith("silofs-ctl: error: "), res.stderr
    # The node is named, on the error line or on the line of that node before it.
    assert odd_node in res.stderr, res.stderr
    assert len(lines) <= 2, res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="end-job runs as root")
def test_end_job_against_an_odd_node_still_ends_by_the_mount_table(
    odd_node: str, tmp_path: Path
) -> None:
    """The epilog goes on without the daemon's list (there is no mount under --dir
    here), and names what it could not do: forgetting the job on that node (and keeps
    the job's directory for a rerun)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    res = run("silofs", "end-job", "j1", "--dir", str(job_dir), "--socket", odd_node)
    assert "Traceback" not in res.stderr, res.stderr
    if res.returncode == 0:  # {}: a DELETE answered 200 is a forgotten job
        assert "forgot job j1" in res.stdout + res.stderr
    else:
        assert res.returncode == 1
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("silofs: error: left of job j1"), res.stderr
        assert odd_node in last
    # Kept while the job is left on the node: the epilog run again ends the rest.
    assert job_dir.exists() == (res.returncode != 0)


def test_a_key_error_with_no_answer_behind_it_stays_a_bug() -> None:
    """The one-line handlers name a daemon only when one answered in this context."""
    token = ANSWERED.set(None)
    try:
        assert unreadable_answer(KeyError("x"), "silofs-ctl") is None
        ANSWERED.set("/run/silofs.sock (GET /v1/status)")
        line = unreadable_answer(KeyError("node"), "silofs-ctl")
        assert line is not None and "/run/silofs.sock (GET /v1/status)" in line
        assert unreadable_answer(RuntimeError("x"), "silofs-ctl") is None
    finally:
        ANSWERED.reset(token)


def test_unmount_asks_an_odd_daemon_for_the_process_and_goes_on_without(odd_node: str) -> None:
    """`silofs unmount` names the mount's process through the daemon before it unmounts;
    an answer that is no status stopped the unmount (a traceback). Now it is no name:
    the process is looked for in /proc, and the unmount goes on."""
    from silofs.unmount import mount_pid

    assert mount_pid(odd_node, "/nonexistent/mnt") is None
