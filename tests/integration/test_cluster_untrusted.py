"""A chunk another member served, asked for by another local user: two real node daemons
of one cluster on 127.0.0.1 reading one moto bucket, their sockets reachable by every
user, and a local user made for the test (useradd, no admin group) as the asking user.

A trusted mount's connection may be answered a peer-served chunk by its place in the
connection's hand-off region (silofs/sealed.py Region: a memory file of the daemon's,
passed once and mapped by the mount). Its pages stay charged to the daemon while they
are mapped, so an untrusted user could pin the daemon's memory with them: such a user
asking with `region=1` (and `fd=1`, as a mount does) on its thread-served connection
gets the bytes and no descriptor (node/api/chunks.py peer_chunk, docs/SECURITY.md),
while root asking the same way on its own connection is handed the region.
"""

from __future__ import annotations

import array
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from silofs.cache.format import chunk_key
from silofs.control.client import ControlClient
from silofs.node.placement import Candidate, home
from silofs.sealed import FD_HEADER, REGION_HEADER
from tests.support.asuser import Identity, Session
from tests.support.cluster import write_cluster
from tests.support.cluster_run import ClusterDaemon
from tests.support.fixtures import needs_fuse
from tests.support.net import free_ports
from tests.support.netcluster import list_objects
from tests.support.poll import wait_for
from tests.support.slurm import job_user

pytestmark = [needs_fuse, pytest.mark.fuse]

FILES = 16
CHUNK = 1 << 20  # each file one chunk


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    fds: int  # descriptors that came with it (closed on arrival)


def _answer(s: socket.socket, buf: bytearray) -> Answer:
    """One answer read from `s`, every descriptor that rides with its bytes counted and
    closed; what is read beyond it stays in `buf`."""
    fds = 0
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(buf) >= end + 4 + length:
                body = bytes(buf[end + 4 : end + 4 + length])
                del buf[: end + 4 + length]
                return Answer(int(lines[0].split(" ")[1]), headers, body, fds)
        data, ancillary, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(16 * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % 4])
                for fd in got:
                    os.close(fd)
                    fds += 1
        assert data, "closed before a whole answer"
        buf += data


def _ask_chunks(sock_path: str, mount: str, keys: list[str]) -> list[tuple[Any, ...]]:
    """On one connection: the first key's chunk (the connection is then served from a
    thread, as a mount's is), then each key's chunk 0 asked as a mount asks (`fd=1`,
    `region=1`). For each: (key, status, descriptors received, the region header, the
    fd header, the body)."""
    out: list[tuple[Any, ...]] = []
    buf = bytearray()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock_path)
        for i, key in enumerate([keys[0], *keys]):
            target = f"/v1/chunks?mount={mount}&key={key}&index=0"
            if i:
                target += "&fd=1&region=1"
            s.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            a = _answer(s, buf)
            if i:
                out.append((key, a.status, a.fds, a.headers.get(REGION_HEADER),
                            a.headers.get(FD_HEADER), a.body))  # fmt: skip
    return out


def _open_and_register(sock_path: str, uri: str, job: str) -> str:
    """Open `uri` (once listed) and register a mount of it under `job`: its id. Run by
    the process that then asks for chunks (the daemon reaps a mount whose registering
    process has gone)."""
    with ControlClient(sock_path, timeout=30) as c:
        dsid = c.request("POST", "/v1/datasets", {"uri": uri})["id"]
        wait_for(lambda: c.request("GET", f"/v1/datasets/{dsid}")["state"] == "ready",
                 what=f"{uri} listed")  # fmt: skip
        body = {"dataset": dsid, "job": job, "mountpoint": f"/nonexistent/{job}",
                "chunk_size": CHUNK}  # fmt: skip
        return c.request("POST", "/v1/mounts", body)["id"]


@pytest.fixture
def asking_user() -> Iterator[Identity]:
    """A real local user made for the test and removed after it (a clean CI machine has
    no second user to borrow)."""
    with job_user() as user:
        yield Identity.of(user.pw_name)


@pytest.fixture
def pair(
    s3_server, monkeypatch, bucket_name: str, tmp_path: Path, asking_user: Identity
) -> Iterator[dict]:
    """Two daemons of one cluster, sockets in a directory every user may reach, the
    bucket's prefix open to every user ([access] "*")."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a daemon other users reach, and to become them")
    who = asking_user
    s3_server.apply_env(monkeypatch)
    rnd = random.Random(5)
    tree = {f"f{i:02d}.bin": rnd.randbytes(200_000 + i) for i in range(FILES)}
    s3_server.create(bucket_name, tree)
    uri = s3_server.uri(bucket_name)
    public = Path(tempfile.mkdtemp(prefix="silofs-untrusted-", dir="/tmp"))
    public.chmod(0o755)
    specs = write_cluster(
        tmp_path, ["127.0.0.1"] * 2, free_ports(2),
        cluster={"peer_timeout_seconds": 2.0, "peer_backoff_seconds": 0.5},
        extra={"backend": {"endpoint_url": s3_server.endpoint_url}},
    )  # fmt: skip
    for spec in specs:
        with spec.config.open("a") as f:
            f.write(f'[access]\n"{uri}" = ["*"]\n')
    nodes = [ClusterDaemon(s, socket=str(public / f"{s.name}.sock")) for s in specs]
    session = None
    try:
        for n in nodes:
            n.start()
        for n in nodes:
            wait_for(lambda n=n: all(m["state"] == "up" for m in n.cluster()["members"]),
                     what="the members up")  # fmt: skip
        session = Session(who)
        members = [Candidate(m["address"], m["weight"]) for m in nodes[0].cluster()["members"]]
        homes = {
            key: home(chunk_key(f"s3:{etag}:{size}", CHUNK, 0), members).address
            for key, size, etag in list_objects(s3_server, bucket_name)
        }
        assert sorted(homes) == sorted(tree)
        yield {"nodes": nodes, "tree": tree, "uri": uri, "session": session, "homes": homes}
    finally:
        if session is not None:
            session.close()
        for n in nodes:
            n.cleanup()
        shutil.rmtree(public, ignore_errors=True)
    problems = [x for n in nodes for x in n.log_problems()]
    assert not problems, "\n".join(problems)


def test_an_untrusted_user_gets_a_peer_served_chunk_as_bytes_never_a_region(pair: dict) -> None:
    nodes, tree, uri, session = pair["nodes"], pair["tree"], pair["uri"], pair["session"]
    # Each half of the keys must hold some homed at the other member (peer-served: the
    # untrusted user's 'requests_out > 0', root's region). Placement hashes the members'
    # ports, new each run: with keys[:8] and keys[8:] and node 0 asking, either half had
    # none of the member's in 2 * 2**-8 of runs (1 in 128). The node whose member is
    # home of more keys (8 or more of 16) asks, and those keys go alternately to each half.
    homes = pair["homes"]
    theirs_of = [sum(homes[k] != n.spec.address for k in tree) for n in nodes]
    asker = nodes[theirs_of.index(max(theirs_of))]
    keys = sorted(tree)
    peer_served = [k for k in keys if homes[k] != asker.spec.address]
    local = [k for k in keys if homes[k] == asker.spec.address]
    theirs = sorted(peer_served[::2] + local[::2])
    ours = sorted(peer_served[1::2] + local[1::2])
    assert len(peer_served) >= 2

    mount = session.call(_open_and_register, asker.socket, uri, "untrusted-job")
    answers = session.call(_ask_chunks, asker.socket, mount, theirs)
    assert [(a[0], a[1]) for a in answers] == [(k, 200) for k in theirs]
    for key, _, fds, region, fd_header, body in answers:
        assert (fds, region, fd_header) == (0, None, None), key
        assert body == tree[key], key
    peer = asker.status()["datasets"][0]["peer"]
    assert peer["requests_out"] > 0 and peer["bytes_in"] > 0, peer  # some were the member's

    # Root, the same asks on its own connection: the region is handed over (so the path
    # above was open to the untrusted user's asks, and closed by its trust).
    mount = _open_and_register(asker.socket, uri, "root-job")
    answers = _ask_chunks(asker.socket, mount, ours)
    assert all(a[1] == 200 for a in answers), answers
    named = [a for a in answers if a[3] is not None]
    assert named, "no chunk of root's came named in a region: the test shows nothing"
    assert sum(a[2] for a in answers) == 1 + sum(1 for a in answers if a[4] is not None)
