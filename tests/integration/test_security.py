"""Authorization as a real second user against a real root daemon (docs/SECURITY.md).

Every rule of the authorization matrix is tried by processes running as unprivileged
users created for the session (useradd), talking to a `silofs daemon` running as root.
The users' processes are forked from the test and drop to the user's uid, gid and
supplementary groups before they connect (tests/support/asuser.py), so the daemon sees them
through SO_PEERCRED exactly as it sees any local user. /dev/fuse is 0600 here, so a
second user cannot mount at all: the tests send the requests a mount process sends
(POST /v1/datasets, POST /v1/mounts, GET /v1/chunks, PUT stats).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from silofs.control.client import ControlClient
from tests.support.asuser import Identity as User
from tests.support.asuser import Session, as_user
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, silofs_cmd
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]

_ROOT_ONLY = "" if os.geteuid() == 0 else "needs root (useradd, a root daemon)"
_NO_USERADD = "" if shutil.which("useradd") else "useradd is not installed"


@dataclass
class Users:
    alice: User  # untrusted, in the cloud-access group
    bob: User  # untrusted
    carol: User  # in the admin group
    cloud_group: str
    admin_group: str


@pytest.fixture(scope="session")
def users() -> Iterator[Users]:
    if _ROOT_ONLY or _NO_USERADD:
        pytest.skip(_ROOT_ONLY or _NO_USERADD)
    tag = f"sfz{os.getpid() % 100000}"
    groups = {"cloud": f"{tag}-cloud", "admin": f"{tag}-adm"}
    made_users: list[str] = []
    made_groups: list[str] = []
    try:
        for g in groups.values():
            subprocess.run(["groupadd", g], check=True, capture_output=True)
            made_groups.append(g)
        spec = {"a": groups["cloud"], "b": None, "c": groups["admin"]}
        for short, extra in spec.items():
            name = f"{tag}-{short}"
            cmd = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-U"]
            cmd += ["-G", extra] if extra else []
            subprocess.run([*cmd, name], check=True, capture_output=True)
            made_users.append(name)
        yield Users(
            *(User.of(n) for n in made_users),
            cloud_group=groups["cloud"],
            admin_group=groups["admin"],
        )
    finally:
        # --force: a process of the user still ending (a session killed a moment ago)
        # must not leave the user on the host for every later run to find.
        for name in made_users:
            subprocess.run(["userdel", "--force", name], capture_output=True)
        for g in made_groups:
            subprocess.run(["groupdel", g], capture_output=True)


Call = tuple[str, str, Any]  # method, path, JSON body (or None)


def _calls(sock: str, calls: list[Call]) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    with ControlClient(sock, timeout=30) as c:
        for method, path, body in calls:
            status, headers, data = c.request_raw(method, path, body)
            if headers.get("content-type", "").startswith("application/json"):
                out.append((status, json.loads(data)))
            else:
                out.append((status, data))
    return out


# One live process per user for the whole test: the daemon reaps a mount whose
# registering process has exited (every 2 s), so a user's mount must outlive the request
# that registered it, as a real mount process does. (One-shot children made the job and
# limit tests flaky under load: the mount was gone before the next request.)
_sessions: dict[int, Session] = {}


@pytest.fixture(autouse=True)
def _user_sessions() -> Iterator[None]:
    yield
    for session in _sessions.values():
        session.close()
    _sessions.clear()


def call(user: User | None, sock: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """(status, decoded body) of one request, as `user` (None: as root), sent by the
    user's session process (alive until the test ends)."""
    if user is None:
        return _calls(sock, [(method, path, body)])[0]
    session = _sessions.get(user.uid)
    if session is None:
        session = _sessions[user.uid] = Session(user)
    return session.call(_calls, sock, [(method, path, body)])[0]


def error_of(answer: tuple[int, Any], status: int) -> str:
    """The one-line error of an answer that must have `status`."""
    got, body = answer
    assert got == status, answer
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert "\n" not in body["error"]
    return body["error"]


# ----------------------------------------------------------------------- the node


@dataclass
class Site:
    node: Node
    base: Path
    flat: Path  # 0755 dir: pub.txt 0644, secret.txt 0600 root
    tree: Path  # 0755 dir with a 0700 subdirectory
    private: Path  # 0700 dir
    config: Path

    @property
    def sock(self) -> str:
        return self.node.socket


def _write_config(path: Path, users: Users, extra: str = "") -> None:
    path.write_text(
        f'[daemon]\nadmin_group = "{users.admin_group}"\n'
        "[backend]\n"
        # Nothing leaves the host: cloud datasets fail to connect at once.
        'endpoint_url = "http://127.0.0.1:9"\nmax_attempts = 1\nconnect_timeout = 2.0\n'
        "[limits]\nmax_datasets_per_uid = 3\nmax_mounts_per_uid = 3\nmax_jobs_per_uid = 2\n"
        "max_connections_per_uid = 4\n"
        f'[access]\n"s3://public-{os.getpid()}/" = ["{users.cloud_group}"]\n' + extra
    )


@pytest.fixture
def site(users: Users) -> Iterator[Site]:
    # Under /tmp, not pytest's tmp_path: /tmp/pytest-of-root is 0700, and the users
    # must reach the socket and the datasets like any user on the host.
    base = Path(tempfile.mkdtemp(prefix="silofs-sec-", dir="/tmp"))
    base.chmod(0o755)
    flat, tree, private = base / "flat", base / "tree", base / "private"
    for d in (flat, tree, private, tree / "locked"):
        d.mkdir()
        d.chmod(0o755)
    (flat / "pub.txt").write_bytes(b"public bytes\n" * 100)
    (flat / "pub.txt").chmod(0o644)
    (flat / "secret.txt").write_bytes(b"root-only secret\n" * 100)
    (flat / "secret.txt").chmod(0o600)
    (flat / "shadow-link").symlink_to("/etc/shadow")
    (tree / "a.txt").write_bytes(b"a" * 1000)
    (tree / "locked" / "hidden-name.txt").write_bytes(b"h" * 10)
    (tree / "locked").chmod(0o700)
    (private / "p.txt").write_bytes(b"p" * 10)
    private.chmod(0o700)
    cfg = base / "silofs.toml"
    _write_config(cfg, users)
    node_root = base / "node"
    node_root.mkdir()
    node_root.chmod(0o755)
    node = Node(node_root, "64M", dict(os.environ))
    try:
        node.start("--config", str(cfg))
        yield Site(node, base, flat, tree, private, cfg)
    finally:
        node.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def open_ready(user: User | None, site: Site, uri: str) -> dict:
    answer = call(user, site.sock, "POST", "/v1/datasets", {"uri": uri})
    assert answer[0] == 200, answer
    dsid = answer[1]["id"]
    return wait_for(
        lambda: (
            (ds := call(None, site.sock, "GET", f"/v1/datasets/{dsid}")[1])["state"]
            in ("ready", "error")
            and ds
        ),
        what=f"dataset {uri} to be listed",
    )


def register(user: User | None, site: Site, dsid: int, job: str, **extra: Any) -> tuple[int, Any]:
    body = {"dataset": dsid, "job": job, "mountpoint": f"/nonexistent/{job}", **extra}
    return call(user, site.sock, "POST", "/v1/mounts", body)


def chunk(user: User | None, site: Site, mount_id: str, key: str) -> tuple[int, Any]:
    return call(
        user, site.sock, "GET", f"/v1/chunks?mount={mount_id}&key={quote(key)}&index=0", None
    )


# ------------------------------------------------------------------ bytes as the peer


def test_a_user_gets_only_bytes_it_could_read_itself(users: Users, site: Site) -> None:
    alice = users.alice
    ds = open_ready(alice, site, str(site.flat))
    assert ds["state"] == "ready" and ds["objects"] == 2  # the symlink is not listed
    status, reg = register(alice, site, ds["id"], "alice-job")
    assert status == 201, reg
    ok = chunk(alice, site, reg["id"], "pub.txt")
    assert ok[0] == 200 and ok[1] == b"public bytes\n" * 100
    denied = error_of(chunk(alice, site, reg["id"], "secret.txt"), 403)
    assert "may not read" in denied and "secret.txt" in denied
    # Cached by a trusted reader first: still not served to alice.
    status, root_reg = register(None, site, ds["id"], "root-job")
    assert status == 201
    assert chunk(None, site, root_reg["id"], "secret.txt")[1] == b"root-only secret\n" * 100
    assert chunk(None, site, root_reg["id"], "secret.txt")[0] == 200
    error_of(chunk(alice, site, reg["id"], "secret.txt"), 403)
    # A symlink to /etc/shadow is not in the listing, so it is no key to ask for.
    error_of(chunk(alice, site, reg["id"], "shadow-link"), 404)
    # A chmod takes effect on the next request, cached or not.
    (site.flat / "pub.txt").chmod(0o600)
    error_of(chunk(alice, site, reg["id"], "pub.txt"), 403)


def test_etc_shadow_through_the_api(users: Users, site: Site) -> None:
    """The attack the access rules stop: open /etc, mount it, ask for shadow."""
    alice = users.alice
    answer = call(alice, site.sock, "POST", "/v1/datasets", {"uri": "/etc"})
    if answer[0] == 403:  # a dir under /etc alice cannot list: already refused
        return
    assert answer[0] == 200, answer
    ds = wait_for(
        lambda: (
            (d := call(None, site.sock, "GET", f"/v1/datasets/{answer[1]['id']}")[1])["state"]
            in ("ready", "error")
            and d
        ),
        what="/etc to be listed",
    )
    status, reg = register(alice, site, ds["id"], "etc-job")
    if status == 403:  # /etc holds a directory alice cannot list: the mount is refused
        assert "may not list" in reg["error"] or "may not search" in reg["error"], reg
        return
    assert status == 201, reg
    error_of(chunk(alice, site, reg["id"], "shadow"), 403)


def test_local_directories_a_user_cannot_list(users: Users, site: Site) -> None:
    alice = users.alice
    err = error_of(call(alice, site.sock, "POST", "/v1/datasets", {"uri": str(site.private)}), 403)
    assert "may not" in err and str(site.private) in err
    # Opening a directory it may list is fine, but a mount would show the names in a
    # subdirectory it may not list: refused.
    ds = open_ready(alice, site, str(site.tree))
    err = error_of(register(alice, site, ds["id"], "tree-job"), 403)
    assert "locked" in err
    # Root opened the private dir: alice still may not mount it.
    root_ds = open_ready(None, site, str(site.private))
    error_of(register(alice, site, root_ds["id"], "p-job"), 403)
    assert register(users.carol, site, root_ds["id"], "p-job")[0] == 201  # admin may


def test_store_options_and_cloud_datasets(users: Users, site: Site) -> None:
    alice, bob, carol = users.alice, users.bob, users.carol
    body = {"uri": str(site.flat), "endpoint_url": "http://attacker.example:80"}
    err = error_of(call(alice, site.sock, "POST", "/v1/datasets", body), 403)
    assert "endpoint_url" in err
    err = error_of(
        call(alice, site.sock, "POST", "/v1/datasets", {"uri": str(site.flat), "region": "x"}),
        403,
    )
    assert "region" in err
    # The client's default body names endpoint_url: null, which is no option.
    ok = call(
        alice, site.sock, "POST", "/v1/datasets", {"uri": str(site.flat), "endpoint_url": None}
    )
    assert ok[0] == 200
    assert call(carol, site.sock, "POST", "/v1/datasets", body)[0] == 200  # admin may
    public = f"s3://public-{os.getpid()}/imagenet/"
    assert call(alice, site.sock, "POST", "/v1/datasets", {"uri": public})[0] == 200
    err = error_of(call(bob, site.sock, "POST", "/v1/datasets", {"uri": public}), 403)
    assert "[access]" in err
    error_of(call(alice, site.sock, "POST", "/v1/datasets", {"uri": "s3://private/x"}), 403)
    error_of(
        call(alice, site.sock, "POST", "/v1/datasets", {"uri": f"s3://public-{os.getpid()}x/"}), 403
    )
    assert call(carol, site.sock, "POST", "/v1/datasets", {"uri": "s3://private/x"})[0] == 200
    # Allocations stay admin-only.
    error_of(call(alice, site.sock, "PUT", "/v1/jobs/j/io", {"bytes_per_s": "1G"}), 403)
    assert call(carol, site.sock, "PUT", "/v1/jobs/j/io", {"bytes_per_s": "1G"})[0] == 200


def test_a_job_belongs_to_its_user(users: Users, site: Site) -> None:
    alice, bob, carol = users.alice, users.bob, users.carol
    ds = open_ready(alice, site, str(site.flat))
    status, reg = register(alice, site, ds["id"], "train")
    assert status == 201
    err = error_of(register(bob, site, ds["id"], "train"), 403)
    assert f"uid {alice.uid}" in err
    stats = {k: 0 for k in ("bytes_read", "hit_bytes", "miss_bytes", "hits", "misses")}
    stats["corrupt_chunks"] = 0
    error_of(call(bob, site.sock, "PUT", f"/v1/mounts/{reg['id']}/stats", stats), 403)
    error_of(chunk(bob, site, reg["id"], "pub.txt"), 403)  # its IO
    error_of(call(bob, site.sock, "DELETE", f"/v1/mounts/{reg['id']}"), 403)
    assert call(alice, site.sock, "PUT", f"/v1/mounts/{reg['id']}/stats", stats)[0] == 200
    assert register(None, site, ds["id"], "train")[0] == 201  # root may
    assert register(carol, site, ds["id"], "train")[0] == 201  # the admin group may
    # Once the job's last mount is gone, the name is free again.
    for m in call(None, site.sock, "GET", "/v1/status")[1]["mounts"]:
        assert call(None, site.sock, "DELETE", f"/v1/mounts/{m['id']}")[0] == 200
    assert register(bob, site, ds["id"], "train")[0] == 201


def test_warm_charges_own_jobs_and_fetches_only_readable_files(users: Users, site: Site) -> None:
    """POST /v1/datasets/{id}/warm spends a job's remote IO and fills the cache: it is
    held to the rules of a mount, and an untrusted user's warm fetches only the files it
    could read itself (a 0600 file of root's stays out of the cache)."""
    alice, bob, carol = users.alice, users.bob, users.carol
    ds = open_ready(alice, site, str(site.flat))
    warm = f"/v1/datasets/{ds['id']}/warm"
    assert register(alice, site, ds["id"], "train")[0] == 201
    err = error_of(call(bob, site.sock, "POST", warm, {"job": "train"}), 403)
    assert f"belongs to uid {alice.uid}" in err
    tree = open_ready(None, site, str(site.tree))
    err = error_of(
        call(bob, site.sock, "POST", f"/v1/datasets/{tree['id']}/warm", {"job": "b"}), 403
    )
    assert "locked" in err
    public = f"s3://public-{os.getpid()}/warm/"
    cloud = call(None, site.sock, "POST", "/v1/datasets", {"uri": public})[1]
    err = error_of(
        call(bob, site.sock, "POST", f"/v1/datasets/{cloud['id']}/warm", {"job": "b"}), 403
    )
    assert "[access]" in err

    status, w = call(alice, site.sock, "POST", warm, {"job": "train"})
    assert status == 202, w
    w = wait_for(
        lambda: (v := call(alice, site.sock, "GET", warm)[1])["state"] != "running" and v,
        what="alice's warm",
    )
    assert (w["state"], w["denied_objects"]) == ("done", 1), w
    cached = call(None, site.sock, "GET", f"/v1/datasets/{ds['id']}")[1]["cached_bytes"]
    assert cached == (site.flat / "pub.txt").stat().st_size  # not secret.txt
    error_of(call(bob, site.sock, "DELETE", warm), 403)
    assert call(carol, site.sock, "DELETE", warm)[0] == 200  # the admin group may
    assert call(carol, site.sock, "POST", warm, {"job": "carol-warm"})[0] == 202
    w = wait_for(
        lambda: (v := call(carol, site.sock, "GET", warm)[1])["state"] != "running" and v,
        what="carol's warm",
    )
    assert (w["state"], w["denied_objects"]) == ("done", 0), w
    everything = sum((site.flat / n).stat().st_size for n in ("pub.txt", "secret.txt"))
    assert call(None, site.sock, "GET", f"/v1/datasets/{ds['id']}")[1]["cached_bytes"] == everything


def test_per_uid_limits(users: Users, site: Site) -> None:
    alice, bob = users.alice, users.bob
    dirs = []
    for i in range(4):
        d = site.base / f"ds{i}"
        d.mkdir()
        d.chmod(0o755)
        (d / "f").write_bytes(b"x")
        dirs.append(d)
    ids = [open_ready(alice, site, str(d))["id"] for d in dirs[:3]]
    # Three idle datasets: a fourth makes the daemon forget the oldest idle one.
    assert open_ready(alice, site, str(dirs[3]))["state"] == "ready"
    ids = [open_ready(alice, site, str(d))["id"] for d in dirs[:3]]
    assert register(alice, site, ids[0], "j1")[0] == 201
    assert register(alice, site, ids[1], "j2")[0] == 201
    err = error_of(register(alice, site, ids[2], "j3"), 429)  # a third job
    assert "jobs" in err and "limit 2" in err
    assert register(alice, site, ids[2], "j1")[0] == 201
    # Three datasets in use: no fourth.
    err = error_of(call(alice, site.sock, "POST", "/v1/datasets", {"uri": str(dirs[3])}), 429)
    assert "datasets" in err
    error_of(register(alice, site, ids[2], "j2"), 429)  # a fourth mount
    assert register(bob, site, ids[2], "bob-job")[0] == 201  # per uid, not global
    assert register(None, site, ids[2], "root-job")[0] == 201  # root is exempt


def _hold_connections(sock_path: str, n: int) -> list[str]:
    """Open n connections, one request each, keeping them all open; their status lines."""
    socks, lines = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\n")
        head = s.recv(65536).split(b"\r\n", 1)[0].decode()
        lines.append(head)
        socks.append(s)
    for s in socks:
        s.close()
    return lines


def test_connections_per_uid(users: Users, site: Site) -> None:
    lines = as_user(users.alice, _hold_connections, site.sock, 6)
    assert lines[:4] == ["HTTP/1.1 200 OK"] * 4, lines
    assert all(line.startswith("HTTP/1.1 429") for line in lines[4:]), lines
    assert _hold_connections(site.sock, 6) == ["HTTP/1.1 200 OK"] * 6  # root is exempt


def _answer(s: socket.socket) -> tuple[str, bytes]:
    """One whole answer on `s`: (its status line, its body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        assert more, "closed before an answer"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k == "content-length"
    )
    while len(body) < length:
        more = s.recv(1 << 20)
        assert more, "closed mid-answer"
        body += more
    return lines[0], body


def _then_held(sock_path: str, chunk_path: str, then: bytes, within: float) -> float | None:
    """One connection asks for a chunk at `chunk_path` and reads its answer whole (from
    then on a thread serves it), sends `then` and reads nothing more: the seconds until
    the daemon closed it, or None if it had not within `within`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sock_path)
    with s:
        s.sendall(f"GET {chunk_path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        status, _ = _answer(s)
        assert status == "HTTP/1.1 200 OK", status
        s.sendall(then)
        t0 = time.monotonic()
        poller = select.poll()
        poller.register(s, select.POLLRDHUP)  # POLLHUP comes unasked; unread bytes do not
        if not poller.poll(int(within * 1000)):
            return None
        return time.monotonic() - t0


def test_a_thread_served_connection_of_another_user_is_held_to_request_bounds(
    users: Users, site: Site
) -> None:
    """After its first chunk a mount's connection is served by one of the daemon's 64
    threads. An untrusted user's connection that then sends one byte of a request, or
    never reads a 16 MiB chunk's answer, is closed within 5 s of the byte (plus 16 s for
    the answer at 1 MiB/s), not held with its thread for the idle timeout (300 s); root's
    trickled request is not cut so soon."""
    bob = users.bob
    big = site.base / "big"
    big.mkdir()
    big.chmod(0o755)
    (big / "small.txt").write_bytes(b"s" * 1000)
    (big / "big.bin").write_bytes(os.urandom(16 << 20))
    for f in big.iterdir():
        f.chmod(0o644)
    dsid = open_ready(bob, site, str(big))["id"]
    answer = register(bob, site, dsid, "bob-thread", chunk_size=16 << 20)
    assert answer[0] == 201, answer
    mount = answer[1]["id"]
    small = f"/v1/chunks?mount={mount}&key=small.txt&index=0"
    session = _sessions[bob.uid]
    took = session.call(_then_held, site.sock, small, b"G", 60.0)
    assert took is not None and took < 15, took
    whole = f"GET /v1/chunks?mount={mount}&key=big.bin&index=0 HTTP/1.1\r\nhost: x\r\n\r\n"
    took = session.call(_then_held, site.sock, small, whole.encode(), 90.0)
    assert took is not None and 10 < took < 45, took
    assert call(bob, site.sock, "GET", "/v1/status")[0] == 200

    answer = register(None, site, dsid, "root-thread")
    assert answer[0] == 201, answer
    small = f"/v1/chunks?mount={answer[1]['id']}&key=small.txt&index=0"
    assert _then_held(site.sock, small, b"G", 8.0) is None


# ------------------------------------------------------------------- cache file modes


def _try_open(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except PermissionError:
        return "denied"
    return "read"


def test_cache_files_are_private_and_fixed_at_start(users: Users, site: Site) -> None:
    cache = Path(site.node.cache_dir)
    modes = {p: stat.S_IMODE(os.stat(cache / p).st_mode) for p in ("data.mdb", "lock.mdb")}
    assert modes == {"data.mdb": 0o600, "lock.mdb": 0o600}
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert as_user(users.alice, _try_open, str(cache / "data.mdb")) == "denied"
    # An existing cache left readable by an older daemon is fixed at the next start.
    site.node.stop()
    cache.chmod(0o755)
    (cache / "data.mdb").chmod(0o644)
    assert as_user(users.alice, _try_open, str(cache / "data.mdb")) == "read"
    site.node.start("--config", str(site.config))
    assert stat.S_IMODE((cache / "data.mdb").stat().st_mode) == 0o600
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert as_user(users.alice, _try_open, str(cache / "data.mdb")) == "denied"


def test_socket_directory_owned_by_another_user_is_refused(users: Users, site: Site) -> None:
    evil = site.base / "evil"
    evil.mkdir()
    os.chown(evil, users.alice.uid, users.alice.gid)
    loose = site.base / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    for d, needle in ((evil, f"owned by uid {users.alice.uid}"), (loose, "writable by others")):
        res = subprocess.run(
            [
                *silofs_cmd("daemon"),
                "--socket",
                str(d / "ctl.sock"),
                "--cache-dir",
                str(site.base / "cache2"),
                "--cache-size",
                "64M",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode != 0
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], res.stderr
        assert not (d / "ctl.sock").exists()


# ---------------------------------------------------------------- bad input: 400s


def _raw(sock_path: str, request: bytes) -> tuple[str, bytes]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    s.sendall(request)
    data = b""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in data and time.monotonic() < deadline:
        more = s.recv(65536)
        if not more:
            break
        data += more
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


def _post_raw(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def test_bad_input_is_a_one_line_400_and_metrics_survive(users: Users, site: Site) -> None:
    alice = users.alice
    ds = open_ready(alice, site, str(site.flat))
    bodies = {
        "deep JSON": b'{"uri": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        "nested 40 deep": b'{"uri": ' + b"[" * 40 + b"]" * 40 + b"}",
        "lone surrogate in a job": json.dumps(
            {"dataset": ds["id"], "job": "x\ud800", "mountpoint": "/m"}
        ).encode(),
        "5,000-digit io_limit": b'{"dataset": %d, "job": "big", "mountpoint": "/m", "io_limit": %s}'
        % (ds["id"], b"9" * 5000),
        "negative io_limit": json.dumps(
            {"dataset": ds["id"], "job": "neg", "mountpoint": "/m", "io_limit": -5}
        ).encode(),
        "control char in a job": json.dumps(
            {"dataset": ds["id"], "job": "a\x07b", "mountpoint": "/m"}
        ).encode(),
        "256-byte job": json.dumps(
            {"dataset": ds["id"], "job": "é" * 128, "mountpoint": "/m"}
        ).encode(),
    }
    for what, body in bodies.items():
        path = "/v1/datasets" if what.startswith(("deep", "nested")) else "/v1/mounts"
        for who in (alice, None):
            line, resp = (
                as_user(who, _raw, site.sock, _post_raw(path, body))
                if who
                else _raw(site.sock, _post_raw(path, body))
            )
            assert line.startswith("HTTP/1.1 400"), (what, line, resp[:200])
            err = json.loads(resp)["error"]
            assert "\n" not in err, what
    sizes = {"bytes_per_s": "9" * 5000 + "G"}
    error_of(call(None, site.sock, "PUT", "/v1/jobs/j/io", sizes), 400)
    error_of(call(None, site.sock, "PUT", "/v1/jobs/j/io", {"bytes_per_s": -1}), 400)
    cache = {"bytes": "9" * 5000}
    error_of(call(None, site.sock, "PUT", f"/v1/datasets/{ds['id']}/cache", cache), 400)
    line, _ = _raw(site.sock, b"HEAD * HTTP/1.1\r\nhost: x\r\n\r\n")
    assert line.startswith("HTTP/1.1 400"), line
    line, _ = as_user(alice, _raw, site.sock, b"HEAD * HTTP/1.1\r\nhost: x\r\n\r\n")
    assert line.startswith("HTTP/1.1 400"), line
    # Nothing bad was stored: /metrics still answers everyone, the job list has no such job.
    status, text = call(alice, site.sock, "GET", "/metrics")
    assert status == 200 and b"silofs_" in text
    jobs = {j["name"] for j in call(None, site.sock, "GET", "/v1/status")[1]["jobs"]}
    assert not jobs & {"big", "neg", "x\ud800"}


@contextlib.contextmanager
def _node_behind_a_proxy(
    s3_server, bucket_name: str, cache: str, extra_toml: str = ""
) -> Iterator[tuple[Node, FaultProxy, Site]]:
    """A node daemon whose store is moto behind a FaultProxy, the bucket open to every
    user; its Site (only the socket and base are used). Removed afterwards."""
    up = urlsplit(s3_server.endpoint_url)
    base = Path(tempfile.mkdtemp(prefix="silofs-sec-", dir="/tmp"))
    base.chmod(0o755)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80)) as proxy:
        cfg = base / "silofs.toml"
        cfg.write_text(
            f'[backend]\nendpoint_url = "{proxy.url}"\n{extra_toml}'
            f'[access]\n"s3://{bucket_name}/" = ["*"]\n'
        )
        node = Node(base / "node", cache, dict(os.environ))
        try:
            node.start("--config", str(cfg))
            yield node, proxy, Site(node, base, base, base, base, cfg)
        finally:
            node.cleanup()
            shutil.rmtree(base, ignore_errors=True)


def test_another_users_warms_leave_a_mounts_misses_a_thread(
    users: Users, s3_server, monkeypatch: pytest.MonkeyPatch, bucket_name: str
) -> None:
    """bob warms four datasets whose GETs the store holds for 6 s (32 GETs at once, 8
    per warm, against the daemon's 16 fetch threads); a mount's miss on another dataset
    meanwhile answers at once. Before, threads were taken first come first served: the
    miss queued behind bob's GETs for two rounds of them (12 s), and 30 warms of a store
    answering in 50 ms made another mount's misses 6x slower. Warms and hint walks now
    hold at most 3/4 of the threads (node/fetch.py BACKGROUND)."""
    s3_server.apply_env(monkeypatch)
    objects = {"a/x.bin": os.urandom(64 << 10)}
    for k in range(4):
        objects.update({f"b{k}/f{i}.bin": os.urandom(64 << 10) for i in range(40)})
    s3_server.create(bucket_name, objects)
    with _node_behind_a_proxy(s3_server, bucket_name, "256M") as (node, proxy, site):
        mp = node.mount(s3_server.uri(bucket_name, "a/"), site.base / "mnt", "--no-start-daemon")
        uris = [s3_server.uri(bucket_name, f"b{k}/") for k in range(4)]
        sets = [open_ready(users.bob, site, u) for u in uris]
        assert all(ds["state"] == "ready" for ds in sets), sets
        held = Fault("delay", methods="GET", path=r"/b\d/f", seconds=6.0)
        proxy.set_plan(FaultPlan(faults=[held]))
        for k, ds in enumerate(sets):
            warm = f"/v1/datasets/{ds['id']}/warm"
            answer = call(users.bob, node.socket, "POST", warm, {"job": f"bob-{k}"})
            assert answer[0] == 202, answer
        proxy.wait_stats(lambda s: s["delay"] >= 16, timeout=30)  # every thread held
        started = time.monotonic()
        assert (mp / "x.bin").read_bytes() == objects["a/x.bin"]
        took = time.monotonic() - started
        assert took < 4.0, f"the miss waited {took:.1f} s behind bob's warms"
        proxy.set_plan(FaultPlan())


def test_a_dataset_with_a_running_warm_is_not_forgotten_for_another_users_room(
    users: Users, s3_server, monkeypatch: pytest.MonkeyPatch, bucket_name: str
) -> None:
    """bob opened a dataset first; alice warms it (no mount). bob, at his dataset limit,
    opens more: the oldest dataset he opened that nothing uses is forgotten to make
    room. Before, a running warm did not count as a use: alice's warm's dataset was
    forgotten under it (its record and store client dropped while its GETs ran, her
    `silofs warm` polling it answered 404 and failed), so any user who opened a dataset
    first could end another's warm of it by opening others. Now his idle dataset is
    forgotten instead and alice's warm ends done."""
    s3_server.apply_env(monkeypatch)
    objects = {f"d/f{i}.bin": os.urandom(64 << 10) for i in range(24)}
    objects.update({f"{p}/x.bin": b"x" * 100 for p in ("e", "f")})
    s3_server.create(bucket_name, objects)
    limits = "[limits]\nmax_datasets_per_uid = 2\n"
    with _node_behind_a_proxy(s3_server, bucket_name, "64M", limits) as (node, proxy, site):
        shared = open_ready(users.bob, site, s3_server.uri(bucket_name, "d/"))
        proxy.set_plan(FaultPlan(faults=[Fault("delay", methods="GET", path=r"/d/f", seconds=2.0)]))
        warm = f"/v1/datasets/{shared['id']}/warm"
        answer = call(users.alice, node.socket, "POST", warm, {"job": "alice-warm"})
        assert answer[0] == 202, answer
        proxy.wait_stats(lambda s: s["delay"] >= 1, timeout=30)  # the warm's GETs wait
        open_ready(users.bob, site, s3_server.uri(bucket_name, "e/"))
        open_ready(users.bob, site, s3_server.uri(bucket_name, "f/"))  # e/ forgotten
        names = {ds["name"] for ds in node.status()["datasets"]}
        assert {"d", "f"} <= names and "e" not in names, names
        proxy.set_plan(FaultPlan())
        done = wait_for(
            lambda: (
                (v := call(users.alice, node.socket, "GET", warm))[1]["state"] != "running" and v
            ),
            what="alice's warm",
        )
        assert done[0] == 200 and done[1]["state"] == "done", done
