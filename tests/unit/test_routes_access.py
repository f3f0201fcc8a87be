"""Authorization in the /v1 routes without FUSE or sockets (docs/SECURITY.md).

A real Daemon (real LMDB env, real writer task) and the real router, called with the
credentials a peer would have: the access decisions are computed from stat results
and uids/gids, so untrusted peers need no real second user here (the integration test
tests/integration/test_security.py runs the same rules as real users).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from silofs.config import NodeSettings, load_node_settings
from silofs.control.peer import Peer
from silofs.control.router import HTTPError, Request, Router
from silofs.control.server import SocketDirError, check_socket_dir
from silofs.errors import AccessDeniedError, BackendError, ObjectChangedError, UsageError
from silofs.node.access import R, W, X, cloud_allowed, mode_allows
from silofs.node.backends import BackendOptions
from silofs.node.backends.local import LocalBackend
from silofs.node.cachedir import secure_cache_dir
from silofs.node.daemon import Daemon
from silofs.node.routes import build_router
from silofs.records import job_name_error
from silofs.uri import parse_uri

NOBODY = 65534  # any uid that owns none of the files; no passwd entry needed
ROOT = Peer(pid=1, uid=0, gid=0)
ALICE = Peer(pid=2, uid=NOBODY, gid=NOBODY)
BOB = Peer(pid=3, uid=NOBODY - 1, gid=NOBODY - 1)


# ------------------------------------------------------------------ pure decisions


def test_mode_bits_use_one_class_only() -> None:
    # The owner class decides for the owner, even when others get more.
    assert not mode_allows(0o077, 5, 9, 5, [9], R)
    assert mode_allows(0o400, 5, 9, 5, [], R)
    assert mode_allows(0o040, 5, 9, 6, [1, 9], R)  # a supplementary group
    assert not mode_allows(0o704, 5, 9, 6, [9], R)  # group class decides: nothing
    assert mode_allows(0o004, 5, 9, 6, [1], R)
    assert not mode_allows(0o004, 5, 9, 6, [1], R | X)
    assert mode_allows(0o007, 5, 9, 6, [], R | W | X)


def test_cloud_policy_prefixes_and_groups() -> None:
    policy = {"s3://public/": frozenset({100}), "gs://open/": None}
    assert cloud_allowed("s3://public/imagenet/", [100], policy)
    assert not cloud_allowed("s3://public/imagenet/", [101], policy)
    assert not cloud_allowed("s3://public-private/", [100], policy)
    assert cloud_allowed("gs://open/x/", [], policy)
    assert not cloud_allowed("az://acct/c/", [100], policy)


@pytest.mark.parametrize(
    "name, ok",
    [
        ("train-1", True),
        ("ünïcode_ok.v2", True),
        ("x" * 255, True),
        ("é" * 128, False),  # 256 bytes
        ("", False),
        ("a b", False),
        ("a/b", False),
        ('a"b', False),
        ("a\\b", False),
        ("a\x00b", False),
        ("a\x7fb", False),
        ("bell\x07", False),
        ("x\ud800", False),  # a lone surrogate: not UTF-8
        (12, False),
    ],
)
def test_job_name_grammar(name: Any, ok: bool) -> None:
    assert (job_name_error(name) is None) is ok


def test_access_config(tmp_path: Path) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text('[access]\n"s3://public/" = ["users"]\n[limits]\nmax_mounts_per_uid = 3\n')
    s = load_node_settings(str(cfg))
    assert s.access == {"s3://public/": ["users"]} and s.max_mounts_per_uid == 3
    assert NodeSettings().max_connections_per_uid == 128
    for bad, needle in [
        ('"s3://public" = ["u"]', "canonical"),
        ('"file:///data/" = ["u"]', "per file"),
        ('"s3://public/" = "u"', "list of groups"),
        ('"nonsense" = ["u"]', "nonsense"),
    ]:
        cfg.write_text(f"[access]\n{bad}\n")
        with pytest.raises(UsageError, match=needle):
            load_node_settings(str(cfg))
    cfg.write_text("[limits]\nmax_connections = 0\n")
    with pytest.raises(UsageError, match="at least 1"):
        load_node_settings(str(cfg))


def test_json_bodies_that_used_to_be_500s() -> None:
    def body(raw: bytes) -> Any:
        return Request("POST", "/", {}, {}, raw, ROOT).json()

    for raw in (
        b'{"a": ' + b"[" * 50000 + b"]" * 50000 + b"}",
        b'{"a": "\\ud800"}',
        b'{"\\udfff": 1}',
    ):
        with pytest.raises(HTTPError) as info:
            body(raw)
        assert info.value.status == 400 and "\n" not in info.value.message
    assert body(b'{"a": [[[1]]], "b": "\\u00e9"}') == {"a": [[[1]]], "b": "é"}


# ------------------------------------------------------------- files, as the peer


def _local(root: Path) -> tuple[LocalBackend, dict[str, Any]]:
    backend = LocalBackend(parse_uri(str(root)), BackendOptions())
    return backend, {o.key: o for o in backend.list()}


def test_check_peer_read_walks_as_the_peer(world: Path) -> None:
    (world / "d").mkdir()
    (world / "d" / "pub").write_bytes(b"p")
    (world / "d" / "secret").write_bytes(b"s")
    (world / "d" / "secret").chmod(0o600)
    (world / "d" / "grp").write_bytes(b"g")
    os.chown(world / "d" / "grp", 0, 4242)
    (world / "d" / "grp").chmod(0o640)
    backend, objs = _local(world)
    gids = frozenset({NOBODY})
    backend.check_peer_read(objs["d/pub"], NOBODY, gids)
    with pytest.raises(AccessDeniedError, match="may not read"):
        backend.check_peer_read(objs["d/secret"], NOBODY, gids)
    with pytest.raises(AccessDeniedError):
        backend.check_peer_read(objs["d/grp"], NOBODY, gids)
    backend.check_peer_read(objs["d/grp"], NOBODY, gids | {4242})  # supplementary group
    (world / "d").chmod(0o700)  # no search on the directory: nothing inside
    with pytest.raises(AccessDeniedError, match="may not search"):
        backend.check_peer_read(objs["d/pub"], NOBODY, gids)
    (world / "d").chmod(0o755)
    # A directory swapped for a symlink after listing is never followed.
    os.rename(world / "d", world / "real")
    os.symlink(world / "real", world / "d")
    with pytest.raises(AccessDeniedError, match="symbolic link"):
        backend.check_peer_read(objs["d/pub"], NOBODY, gids)
    os.unlink(world / "d")
    os.rename(world / "real", world / "d")
    # A file replaced after listing is not the file the listing recorded.
    (world / "d" / "pub").unlink()
    (world / "d" / "pub").write_bytes(b"other")
    with pytest.raises(ObjectChangedError):
        backend.check_peer_read(objs["d/pub"], NOBODY, gids)


def test_check_peer_read_many_judges_as_one_walk_per_object(
    world: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm's batch check (one walk per directory, files opened through its fd)
    refuses exactly what check_peer_read refuses, for the same reasons, and walks each
    directory from "/" once."""
    for d in ("a", "a/b", "shut", "shut/in", "grp"):
        (world / d).mkdir()
    for f in ("top", "a/x", "a/y", "a/b/z", "shut/s", "shut/in/t", "grp/g", "a/secret"):
        (world / f).write_bytes(f.encode())
    (world / "a" / "secret").chmod(0o600)
    os.chown(world / "grp", 0, 4242)
    (world / "grp").chmod(0o750)  # searchable by group 4242 only
    (world / "gone").write_bytes(b"g")
    backend, objs = _local(world)
    (world / "shut").chmod(0o700)  # after listing: nothing under it for others
    (world / "gone").unlink()
    os.rename(world / "a" / "b", world / "real-b")  # a listed directory now a symlink
    os.symlink(world / "real-b", world / "a" / "b")
    infos = sorted(objs.values(), key=lambda o: o.key)

    def one_by_one(gids: frozenset[int]) -> dict[str, tuple[type, str]]:
        out = {}
        for o in infos:
            try:
                backend.check_peer_read(o, NOBODY, gids)
            except (BackendError, OSError) as exc:
                out[o.key] = (type(exc), str(exc))
        return out

    walks: list[str] = []
    real_open_path = LocalBackend._open_path

    def counted(self: LocalBackend, real_root: str, rel: str, *args: Any) -> Any:
        walks.append(rel)
        return real_open_path(self, real_root, rel, *args)

    for gids in (frozenset({NOBODY}), frozenset({NOBODY, 4242})):
        want = one_by_one(gids)
        monkeypatch.setattr(LocalBackend, "_open_path", counted)
        walks.clear()
        got = {
            k: (type(e), str(e))
            for k, e in backend.check_peer_read_many(infos, NOBODY, gids).items()
        }
        monkeypatch.undo()
        assert got == want
        assert sorted(walks) == ["", "a", "a/b", "grp", "shut", "shut/in"]
    assert set(want) == {"a/secret", "a/b/z", "shut/s", "shut/in/t", "gone"}
    assert "grp/g" in one_by_one(frozenset({NOBODY}))


def test_check_peer_list_covers_every_directory(world: Path) -> None:
    (world / "open" / "deep").mkdir(parents=True)
    (world / "open" / "deep" / "f").write_bytes(b"x")
    backend = LocalBackend(parse_uri(str(world)), BackendOptions())
    backend.check_peer_list(NOBODY, frozenset(), tree=True)
    (world / "open" / "deep").chmod(0o711)  # searchable, not listable
    backend.check_peer_list(NOBODY, frozenset(), tree=False)
    with pytest.raises(AccessDeniedError, match="open/deep"):
        backend.check_peer_list(NOBODY, frozenset(), tree=True)


# ----------------------------------------------------------- socket dir, cache dir


def test_socket_dir_must_be_ours(world: Path) -> None:
    check_socket_dir(str(world))
    theirs = world / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(SocketDirError, match=f"owned by uid {NOBODY}"):
        check_socket_dir(str(theirs / "sub"))  # an ancestor counts too
    loose = world / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(SocketDirError, match="writable by others"):
        check_socket_dir(str(loose))
    loose.chmod(0o1777)  # sticky, like /tmp
    check_socket_dir(str(loose))


def test_a_socket_the_daemon_cannot_bind_is_one_line(tmp_path: Path) -> None:
    """A socket path in a directory the daemon may not write (a read-only file system:
    under systemd's ProtectSystem=strict, anything outside ReadWritePaths; /proc here)
    was a FileNotFoundError/OSError traceback from bind(), in the journal."""
    import subprocess
    import sys

    from silofs.control.server import bind_unix

    with pytest.raises(SocketDirError, match="cannot listen on /proc/silofs-test.sock: "):
        bind_unix("/proc/silofs-test.sock", mode=0o666, uid=None, gid=None)
    res = subprocess.run(
        [sys.executable, "-m", "silofs", "daemon", "--socket", "/proc/silofs-test.sock"]
        + ["--cache-dir", str(tmp_path / "cache"), "--cache-size", "1G"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("silofs: error: cannot listen on /proc/silofs-test.sock: ")


def test_cache_modes(tmp_path: Path) -> None:
    cache = tmp_path / "c"
    cache.mkdir(mode=0o755)
    (cache / "data.mdb").write_bytes(b"")
    (cache / "data.mdb").chmod(0o644)
    secure_cache_dir(str(cache), None)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((cache / "data.mdb").stat().st_mode) == 0o600
    secure_cache_dir(str(cache), os.getgid())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o750
    assert stat.S_IMODE((cache / "data.mdb").stat().st_mode) == 0o640
    (cache / "lock.mdb").symlink_to("/etc/passwd")
    with pytest.raises(UsageError, match="symbolic link"):
        secure_cache_dir(str(cache), None)


# ------------------------------------------------------------ the routes themselves

Call = Callable[..., Awaitable[tuple[int, Any]]]


def route_caller(router: Router) -> Call:
    """call(peer, method, path, body=None) -> (status, decoded body): one request
    dispatched by `router` as from `peer`, without a socket. A body of bytes is sent
    as it is, anything else as JSON."""

    async def call(peer: Peer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        raw = (
            body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        )
        target, _, qs = path.partition("?")
        query = dict(p.split("=", 1) for p in qs.split("&")) if qs else {}
        resp = await router.dispatch(Request(method, target, query, {}, raw, peer))
        data = bytes(resp.body)
        return resp.status, json.loads(data) if resp.content_type == "application/json" else data

    return call


def run_routes(tmp_path: Path, test: Callable[[Daemon, Call], Awaitable[None]], **kw: Any) -> None:
    settings = NodeSettings(
        socket=str(tmp_path / "s.sock"),
        cache_dir=str(tmp_path / "cache"),
        cache_size=64 << 20,
        **kw,
    )
    daemon = Daemon(settings)
    call = route_caller(build_router(daemon))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            daemon.nursery = nursery
            nursery.start_soon(daemon.writer.run)
            await test(daemon, call)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        daemon.store.close()
        os.close(daemon.lock_fd)  # a later Daemon of the same cache dir may start


async def _ready(call: Call, peer: Peer, uri: str) -> dict:
    status, ds = await call(peer, "POST", "/v1/datasets", {"uri": uri})
    assert status == 200, ds
    with trio.fail_after(10):
        while ds["state"] not in ("ready", "error"):
            await trio.sleep(0.01)
            ds = (await call(ROOT, "GET", f"/v1/datasets/{ds['id']}"))[1]
    return ds


def test_routes_matrix(tmp_path: Path, world: Path) -> None:
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")
    (world / "data" / "secret").write_bytes(b"secret")
    (world / "data" / "secret").chmod(0o600)

    async def test(d: Daemon, call: Call) -> None:
        uri = str(world / "data")
        s, body = await call(
            ALICE, "POST", "/v1/datasets", {"uri": uri, "endpoint_url": "http://x"}
        )
        assert s == 403 and "endpoint_url" in body["error"]
        s, body = await call(ALICE, "POST", "/v1/datasets", {"uri": "s3://b/p"})
        assert s == 403 and "[access]" in body["error"]
        ds = await _ready(call, ALICE, uri)
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        s, m = await call(ALICE, "POST", "/v1/mounts", reg)
        assert s == 201, m
        s, data = await call(ALICE, "GET", f"/v1/chunks?mount={m['id']}&key=pub&index=0")
        assert (s, data) == (200, b"public")
        s, body = await call(ALICE, "GET", f"/v1/chunks?mount={m['id']}&key=secret&index=0")
        assert s == 403 and "may not read" in body["error"]
        # An older listing's version would come from the cache: only the file as it is
        # now can be judged, so an untrusted peer gets no old version.
        s, body = await call(
            ALICE, "GET", f"/v1/chunks?mount={m['id']}&key=pub&index=0&version=old"
        )
        assert s == 409 and "remount" in body["error"]
        s, body = await call(BOB, "POST", "/v1/mounts", reg)
        assert s == 403 and f"uid {NOBODY}" in body["error"]
        s, body = await call(BOB, "GET", f"/v1/chunks?mount={m['id']}&key=pub&index=0")
        assert s == 403
        assert (await call(ROOT, "POST", "/v1/mounts", reg))[0] == 201
        s, body = await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "k"})
        assert s == 429 and "limit 1" in body["error"]  # max_jobs_per_uid=1
        s, body = await call(ALICE, "POST", "/v1/mounts", {**reg, "io_limit": -1})
        assert s == 400

    run_routes(tmp_path, test, max_jobs_per_uid=1)


def test_slurm_job_names_are_for_the_user_the_prolog_registered(
    tmp_path: Path, world: Path
) -> None:
    """attack18: bob took `slurm-N` for the next job ids, so the prolog's mount for
    alice's job N was refused and her job cancelled. A slurm-N name is usable by an
    untrusted peer only once an admin's registration names its uid; a registered uid
    owns a job, before any earlier mount's."""
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        reg = {"dataset": ds["id"], "mountpoint": "/m"}
        warm = f"/v1/datasets/{ds['id']}/warm"
        # The squat: refused for a name no one registered, to mount and to warm.
        s, body = await call(BOB, "POST", "/v1/mounts", {**reg, "job": "slurm-7"})
        assert s == 403 and "Slurm prolog" in body["error"], body
        assert "job register --uid" in body["error"] and "\n" not in body["error"]
        s, body = await call(BOB, "POST", warm, {"job": "slurm-7"})
        assert s == 403 and "Slurm prolog" in body["error"], body
        assert d.mounts == {} and d.warms == {}
        # Only an admin registers, and a registration naming alice admits only alice.
        s, body = await call(BOB, "PUT", "/v1/jobs/slurm-7", {"gpus": 1, "uid": BOB.uid})
        assert s == 403 and "slurm-7" not in d.allocs.registrations
        s, body = await call(ROOT, "PUT", "/v1/jobs/slurm-7", {"gpus": 1, "uid": ALICE.uid})
        assert s == 200 and body["registration"]["uid"] == ALICE.uid, body
        assert d.job_owner("slurm-7") == ALICE.uid  # before any mount
        s, body = await call(BOB, "POST", "/v1/mounts", {**reg, "job": "slurm-7"})
        assert s == 403 and f"not registered for uid {BOB.uid}" in body["error"], body
        s, m = await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "slurm-7"})
        assert s == 201, m
        # A registration without a uid (an older prolog's) admits no untrusted peer.
        assert (await call(ROOT, "PUT", "/v1/jobs/slurm-8", {"gpus": 1}))[0] == 200
        s, body = await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "slurm-8"})
        assert s == 403 and "Slurm prolog" in body["error"], body
        # Root (SILOFS_MOUNT_AS=root) mounts slurm-N unregistered, as before.
        assert (await call(ROOT, "POST", "/v1/mounts", {**reg, "job": "slurm-9"}))[0] == 201

        # Other names as before: the first mount's uid owns one...
        for name in ("slurm-x", "slurm-7b", "my-slurm-7", "train"):
            s, body = await call(BOB, "POST", "/v1/mounts", {**reg, "job": name})
            assert s == 201, (name, body)
            assert d.job_owner(name) == BOB.uid
        s, body = await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "train"})
        assert s == 403 and f"belongs to uid {BOB.uid}" in body["error"], body
        # ...unless a registration names another: bob's earlier mount does not own it.
        s, _ = await call(ROOT, "PUT", "/v1/jobs/train", {"gpus": 1, "uid": ALICE.uid})
        assert s == 200 and d.job_owner("train") == ALICE.uid
        assert (await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "train"}))[0] == 201
        s, body = await call(BOB, "POST", "/v1/mounts", {**reg, "job": "train"})
        assert s == 403 and f"belongs to uid {ALICE.uid}" in body["error"], body

    run_routes(tmp_path, test)


def test_an_untrusted_peer_gets_no_bytes_of_a_file_a_refresh_no_longer_lists(
    tmp_path: Path, world: Path
) -> None:
    """The previous listing's version of a key the new listing lacks is served from the
    cache to a handle opened before the refresh; no such file can be judged now, so an
    untrusted peer gets none of it, whatever version it names."""
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")
    (world / "data" / "gone").write_bytes(b"secret")
    (world / "data" / "gone").chmod(0o600)

    async def test(d: Daemon, call: Call) -> None:
        uri = str(world / "data")
        ds = await _ready(call, ROOT, uri)
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        s, root_mount = await call(ROOT, "POST", "/v1/mounts", reg)
        assert s == 201, root_mount
        version = d.store.get_object(ds["id"], "gone").version
        chunk = f"/v1/chunks?key=gone&index=0&version={version}"
        assert await call(ROOT, "GET", f"{chunk}&mount={root_mount['id']}") == (200, b"secret")
        (world / "data" / "gone").unlink()
        s, body = await call(ROOT, "POST", "/v1/datasets", {"uri": uri, "refresh": True})
        assert s == 200, body
        refreshed = await _ready(call, ROOT, uri)
        assert refreshed["generation"] == ds["generation"] + 1
        s, alice_mount = await call(ALICE, "POST", "/v1/mounts", {**reg, "job": "a"})
        assert s == 201, alice_mount
        s, body = await call(ALICE, "GET", f"{chunk}&mount={alice_mount['id']}")
        assert s == 409 and "remount" in body["error"], (s, body)
        # Root's handle opened before the refresh still reads what it opened.
        assert await call(ROOT, "GET", f"{chunk}&mount={root_mount['id']}") == (200, b"secret")

    run_routes(tmp_path, test)


async def _warm_done(call: Call, peer: Peer, dsid: int) -> dict:
    with trio.fail_after(10):
        while (w := (await call(peer, "GET", f"/v1/datasets/{dsid}/warm"))[1])["state"] == (
            "running"
        ):
            await trio.sleep(0.01)
    return w


def test_warm_charges_only_own_jobs_and_fetches_only_readable_files(
    tmp_path: Path, world: Path
) -> None:
    for name in ("data", "other", "private"):
        (world / name).mkdir()
    (world / "data" / "pub").write_bytes(b"public")
    (world / "data" / "secret").write_bytes(b"secret!")
    (world / "data" / "secret").chmod(0o600)
    (world / "other" / "big").write_bytes(b"o" * 100_000)
    (world / "private").chmod(0o700)
    (world / "private" / "p").write_bytes(b"p")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        warm = f"/v1/datasets/{ds['id']}/warm"
        reg = {"dataset": ds["id"], "job": "train", "mountpoint": "/m"}
        assert (await call(ALICE, "POST", "/v1/mounts", reg))[0] == 201
        # Bob may not spend alice's job, nor warm a dataset he may not mount.
        s, body = await call(BOB, "POST", warm, {"job": "train"})
        assert s == 403 and f"belongs to uid {NOBODY}" in body["error"], body
        private = await _ready(call, ROOT, str(world / "private"))
        s, body = await call(BOB, "POST", f"/v1/datasets/{private['id']}/warm", {"job": "b"})
        assert s == 403 and "may not" in body["error"], body
        assert d.warms == {}

        # Alice's warm fetches what she may read: not the 0600 file of root's.
        s, w = await call(ALICE, "POST", warm, {"job": "train"})
        assert s == 202, w
        w = await _warm_done(call, ALICE, ds["id"])
        assert (w["state"], w["denied_objects"]) == ("done", 1), w
        assert d.usage[ds["id"]].bytes == len(b"public")
        s, body = await call(BOB, "DELETE", warm)
        assert s == 403 and f"uid {NOBODY}" in body["error"]

        # A running warm holds its job, as a mount does. (0 B/s: it waits on the limiter.)
        assert (await call(ROOT, "PUT", "/v1/jobs/slow/io", {"bytes_per_s": 0}))[0] == 200
        other = await _ready(call, ALICE, str(world / "other"))
        s, w = await call(ALICE, "POST", f"/v1/datasets/{other['id']}/warm", {"job": "slow"})
        assert s == 202 and w["state"] == "running", w
        s, body = await call(BOB, "POST", "/v1/mounts", {**reg, "job": "slow"})
        assert s == 403 and "belongs to" in body["error"]
        s, body = await call(BOB, "POST", warm, {"job": "slow"})
        assert s == 403 and "belongs to" in body["error"]
        s, body = await call(ALICE, "POST", f"/v1/datasets/{other['id']}/warm", {"job": "x"})
        assert s == 409 and "for job 'slow' is running" in body["error"]
        assert (await call(ALICE, "DELETE", f"/v1/datasets/{other['id']}/warm"))[0] == 200
        assert (await _warm_done(call, ALICE, other["id"]))["state"] == "cancelled"

        # Root warms anything, the 0600 file included.
        assert (await call(ROOT, "POST", warm, {"job": "root-warm"}))[0] == 202
        w = await _warm_done(call, ROOT, ds["id"])
        assert (w["state"], w["denied_objects"]) == ("done", 0), w
        assert d.usage[ds["id"]].bytes == len(b"public") + len(b"secret!")

    run_routes(tmp_path, test)


def test_clearing_an_io_allocation(tmp_path: Path) -> None:
    async def test(d: Daemon, call: Call) -> None:
        assert (await call(ROOT, "PUT", "/v1/jobs/j/io", {"bytes_per_s": "1MB/s"}))[0] == 200
        s, body = await call(ALICE, "DELETE", "/v1/jobs/j/io")
        assert s == 403 and d.allocs.io == {"j": 1_000_000}
        s, body = await call(ROOT, "DELETE", "/v1/jobs/j/io")
        assert (s, body["cleared"]) == (200, True)
        assert d.allocs.io == {} and d.jobs["j"].limiter.rate is None
        assert d.store.get_meta("io:j") is None
        assert (await call(ROOT, "DELETE", "/v1/jobs/j/io"))[0] == 404

    run_routes(tmp_path, test)


GROUP = "4242"  # an admin group by number: no group database entry needed


def test_the_route_table_refuses_before_the_handler_and_says_who_may(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def test(d: Daemon, call: Call) -> None:
        s, body = await call(ALICE, "PUT", "/v1/jobs/j/io", {"bytes_per_s": "1MB/s"})
        assert s == 403 and body["error"].startswith("only root or ")
        assert body["error"].endswith(
            f"group {GROUP} may change IO allocations; you are uid {NOBODY}"
        )
        assert "j" not in d.jobs  # the handler never ran
        # An offer is for root (or the daemon's uid), not the admin group; its mount is
        # not even looked up for anyone else.
        s, body = await call(ALICE, "PUT", "/v1/mounts/0123456789ab/offer?key=k&index=0", b"x")
        assert s == 403 and "may offer chunks" in body["error"]
        assert (await call(ROOT, "PUT", "/v1/mounts/0123456789ab/offer?key=k&index=0"))[0] == 404
        assert (await call(ROOT, "PUT", "/v1/jobs/j", {"gpus": 1}))[0] == 200

    caplog.set_level(logging.WARNING, logger="silofs.control.router")
    run_routes(tmp_path, test, admin_group=GROUP)
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert refused[0].startswith(f"refused PUT /v1/jobs/j/io from uid {NOBODY}: only root")


def test_relative_dataset_paths_are_refused(tmp_path: Path) -> None:
    """The daemon's cwd and ~ are not the caller's: a relative path is a 400 (clients
    send absolute paths), never a dataset under the daemon's working directory."""
    os.makedirs(tmp_path / "cwd" / "rel", exist_ok=True)

    async def test(d: Daemon, call: Call) -> None:
        for uri in ("rel", "./rel", "~/rel", "~root/rel"):
            s, body = await call(ROOT, "POST", "/v1/datasets", {"uri": uri})
            assert s == 400 and "relative" in body["error"], (uri, body)
        assert d.datasets == {}
        await _ready(call, ROOT, str(tmp_path / "cwd" / "rel"))
        assert (await call(ROOT, "GET", "/v1/datasets/rel"))[0] == 200  # its short name
        assert (await call(ROOT, "GET", "/v1/datasets/.%2Frel"))[0] == 404

    cwd = os.getcwd()
    os.chdir(tmp_path / "cwd")
    try:
        run_routes(tmp_path, test)
    finally:
        os.chdir(cwd)


# ------------------------------------------------------------- connection limits


def test_connection_limits_evict_idle_then_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over its limit, a uid's longest-idle connection is closed for the new one (a
    mount's keep-alive pool must not lock its user out); only when all are busy is the
    new one told 429."""
    import functools

    from silofs.control import server
    from silofs.control.router import Router, json_response

    path = str(tmp_path / "s.sock")
    router = Router()
    gate = trio.Event()
    busy: list[trio.Event] = [trio.Event(), trio.Event()]

    async def fast(req: Request) -> Any:
        return json_response({"ok": True})

    async def slow(req: Request) -> Any:
        busy.pop(0).set()
        await gate.wait()
        return json_response({"ok": True})

    router.add("GET", "/fast", fast)
    router.add("GET", "/slow", slow)
    limits = server.ConnectionLimits(per_uid=2, total=10, reserve=0, trusted=lambda p: False)

    async def send(path_: str) -> trio.SocketStream:
        stream = await trio.open_unix_socket(path)
        await stream.send_all(f"GET {path_} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        return stream

    async def status_of(stream: trio.SocketStream) -> str:
        data = await stream.receive_some(4096)
        return data.split(b"\r\n", 1)[0].decode() if data else "closed"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(server.serve_unix, path, router, connections=limits)
            )
            a, b = await send("/fast"), await send("/fast")
            assert [await status_of(a), await status_of(b)] == ["HTTP/1.1 200 OK"] * 2
            # Both idle, but not for long enough: refused.
            c = await send("/fast")
            assert (await status_of(c)).startswith("HTTP/1.1 429")
            monkeypatch.setattr(server, "_EVICT_IDLE_SECONDS", 0.0)
            d = await send("/fast")  # evicts a, the longest idle
            assert await status_of(d) == "HTTP/1.1 200 OK"
            assert await status_of(a) == "closed"
            # e and f evict b and d (idle) and stay busy: nothing left to evict for g.
            started = list(busy)
            e = await send("/slow")
            await started[0].wait()
            f = await send("/slow")
            await started[1].wait()
            g = await send("/fast")
            with trio.fail_after(5):
                assert (await status_of(g)).startswith("HTTP/1.1 429")
            gate.set()
            assert [await status_of(e), await status_of(f)] == ["HTTP/1.1 200 OK"] * 2
            assert [await status_of(b), await status_of(d)] == ["closed"] * 2
            for s in (a, b, c, d, e, f, g):
                await s.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_request_trickled_past_the_bound_is_evicted_like_an_idle_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that sent one byte of a request and no more held their uid's (and the
    total's) places for the idle timeout: a few users could lock every other out. Past
    _EVICT_SLOW_REQUEST_SECONDS such a connection is closed for a new one, as an idle
    one is; before, the new one is refused."""
    import functools

    from silofs.control import server
    from silofs.control.router import Router, json_response

    path = str(tmp_path / "s.sock")
    router = Router()

    async def fast(req: Request) -> Any:
        return json_response({"ok": True})

    router.add("GET", "/fast", fast)
    limits = server.ConnectionLimits(per_uid=2, total=10, reserve=0, trusted=lambda p: False)

    async def status_of(stream: trio.SocketStream) -> str:
        data = await stream.receive_some(4096)
        return data.split(b"\r\n", 1)[0].decode() if data else "closed"

    async def ask() -> str:
        stream = await trio.open_unix_socket(path)
        async with stream:
            await stream.send_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(10):
                return await status_of(stream)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(server.serve_unix, path, router, connections=limits)
            )
            slow = []
            for _ in range(2):  # a request's first byte, then nothing
                stream = await trio.open_unix_socket(path)
                await stream.send_all(b"G")
                slow.append(stream)
            assert (await ask()).startswith("HTTP/1.1 429")
            monkeypatch.setattr(server, "_EVICT_SLOW_REQUEST_SECONDS", 0.2)
            end = trio.current_time() + 10
            while (answer := await ask()) != "HTTP/1.1 200 OK":
                assert answer.startswith("HTTP/1.1 429") and trio.current_time() < end
                await trio.sleep(0.05)  # polling, with a deadline
            closed = []
            for stream in slow:  # one of them was closed for the new one
                with trio.move_on_after(2):
                    closed.append(await status_of(stream))
            assert closed == ["closed"], closed
            for s in slow:
                await s.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_sealed_chunk_file_goes_only_to_trusted_peers_on_a_unix_connection(
    tmp_path: Path, world: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk route hands a streamed chunk's sealed file (silofs/sealed.py) to a
    trusted peer that asked with fd=1 on a connection that can carry it; everyone else
    gets the bytes, after the same checks."""
    from silofs import sealed
    from silofs.cache.format import ChunkValue

    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")
    data = os.urandom(1 << 20)
    built = ChunkValue(len(data), "pub", "etag", sealed.buffer)
    built.data[:] = data
    raw = built.seal(1, 0, 4 << 20)
    del built
    assert isinstance(raw, sealed.SealedValue)
    value = sealed.seal(raw, len(data))
    del raw
    view = memoryview(value)[len(value) - len(data) :].toreadonly()

    async def streamed(*_args: Any, **_kw: Any) -> tuple[memoryview, str]:
        return view, "remote"

    monkeypatch.setattr(Daemon, "get_chunk", streamed)

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        router = build_router(d)
        answers = {}
        for who in (ALICE, ROOT):
            s, m = await call(who, "POST", "/v1/mounts", {**reg, "job": f"j{who.uid}"})
            assert s == 201, m
            for fd, unix in (("1", True), ("1", False), ("0", True)):
                query = {"mount": m["id"], "key": "pub", "index": "0", "fd": fd}
                req = Request("GET", "/v1/chunks", query, {}, b"", who, unix)
                answers[who.uid, fd, unix] = await router.dispatch(req)
        for (uid, fd, unix), resp in answers.items():
            assert resp.status == 200
            if (uid, fd, unix) == (0, "1", True):
                assert resp.fd is value and resp.body == b""
                assert resp.headers[sealed.FD_HEADER] == f"{len(value) - len(data)} {len(data)}"
            else:
                assert resp.fd is None and bytes(resp.body) == data

    run_routes(tmp_path, test)


def test_a_mounts_reports_never_run_shared_counters_backwards(tmp_path: Path, world: Path) -> None:
    """A mount reports cumulative counters; the daemon adds each report's change to the
    dataset's and the job's. A report lower than the last (any user's own mount process
    sends them) was a negative change: the dataset's counters, which every user's
    mounts share and /metrics exports as Prometheus counters, ran backwards, below 0.
    A counter that went down is taken as not moved (and the highest value seen stays
    the base: a report going down and up again counts nothing twice); a negative or
    unrepresentable one is a 400."""
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        reg = {"dataset": ds["id"], "job": "j", "mountpoint": "/m"}
        s, m = await call(ALICE, "POST", "/v1/mounts", reg)
        assert s == 201, m
        path = f"/v1/mounts/{m['id']}/stats"
        zero = {k: 0 for k in ("hit_bytes", "miss_bytes", "hits", "misses", "corrupt_chunks")}

        async def report(n: int) -> int:
            s, body = await call(ALICE, "PUT", path, {**zero, "bytes_read": n})
            return s

        def read() -> tuple[int, int]:
            view = d.datasets[ds["id"]].reads.bytes_read, d.jobs["j"].reads.bytes_read
            return view

        assert await report(1000) == 200 and read() == (1000, 1000)
        assert await report(0) == 200 and read() == (1000, 1000)
        assert await report(1500) == 200 and read() == (1500, 1500)
        assert await report(-5) == 400 and await report(1 << 63) == 400
        assert read() == (1500, 1500)

    run_routes(tmp_path, test)


def test_a_mount_registered_again_after_a_restart_counts_its_earlier_reads_once(
    tmp_path: Path, world: Path
) -> None:
    """After a daemon restart a mount registers again (`again`) and reports its counts
    since it started, most of them exported by the daemon before. Added, they made the
    dataset's and job's Prometheus counters jump by the mount's lifetime after the reset
    (counted twice by increase()/rate()). That first report is the base; the job's epoch
    count still follows every byte read. A mount registering for the first time has its
    first report counted."""
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"x" * 1000)

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        zero = {k: 0 for k in ("hit_bytes", "miss_bytes", "hits", "misses", "corrupt_chunks")}

        async def mount(job: str, again: bool) -> str:
            reg = {"dataset": ds["id"], "job": job, "mountpoint": "/m", "again": again}
            s, m = await call(ALICE, "POST", "/v1/mounts", reg)
            assert s == 201, m
            return m["id"]

        async def report(mid: str, n: int) -> None:
            s, body = await call(ALICE, "PUT", f"/v1/mounts/{mid}/stats", {**zero, "bytes_read": n})
            assert s == 200, body

        back = await mount("back", again=True)
        await report(back, 2500)
        assert d.datasets[ds["id"]].reads.bytes_read == 0
        assert d.jobs["back"].reads.bytes_read == 0
        assert d.jobs["back"].epoch == 2  # 2,500 bytes of a 1,000-byte dataset
        await report(back, 2600)
        assert d.datasets[ds["id"]].reads.bytes_read == 100
        assert d.jobs["back"].reads.bytes_read == 100

        new = await mount("new", again=False)
        await report(new, 700)
        assert d.datasets[ds["id"]].reads.bytes_read == 800
        assert d.jobs["new"].reads.bytes_read == 700

    run_routes(tmp_path, test)


def test_a_warms_bad_paths_are_named_for_the_rule_they_break(tmp_path: Path, world: Path) -> None:
    """An empty glob or one past MAX_NAME was told "must be a list of up to 64 globs",
    which it was: each rule now says itself, in one line, and no warm starts. A '[' no
    ']' closes was taken as a literal '[' by fnmatch: it is refused, naming `[[]`."""
    (world / "data").mkdir()
    (world / "data" / "pub").write_bytes(b"public")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, str(world / "data"))
        warm = f"/v1/datasets/{ds['id']}/warm"
        cases = {
            "": "a glob is 1 to",
            "x" * 5000: "not 5000",
            7: "must hold strings",
            "train/img[1.bin": "the '[' at 9 starts a set no ']' closes",
            "a[]b": "(a literal '[' is written '[[]')",
        }
        for glob, says in cases.items():
            s, body = await call(ALICE, "POST", warm, {"job": "w", "paths": [glob]})
            assert s == 400 and says in body["error"] and "\n" not in body["error"], body
        s, body = await call(ALICE, "POST", warm, {"job": "w", "paths": ["*"] * 65})
        assert s == 400 and "up to 64 globs" in body["error"], body
        assert d.warms == {}

    run_routes(tmp_path, test)
