"""--serve-processes N: one mount served by N forked pyfuse3 processes (mount/forked.py).

Owns, on real FUSE mounts: every file reads correctly whichever process serves which
request (handles opened in one process and read or released in another), status counts
each byte once, a refresh while files are open keeps each open file at its version, an
unmount (SIGTERM or fusermount3 -u) ends every process, and a killed serving process is
replaced while the mount keeps serving (its readers get an error, never a hang), and
the shared table holds its count of open files and directories however the kernel
spread their OPENs.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from silofs.mount.shared import DIR_SLOTS, FILE_SLOTS
from tests.support.fixtures import needs_fuse
from tests.support.node import force_unmount, mounted
from tests.support.poll import wait_for
from tests.support.trees import random_files

pytestmark = [needs_fuse, pytest.mark.fuse]

CHUNK = 256 << 10
# File descriptors a test process holds besides those a test opens (pytest's, the node's).
_FD_SPARE = 200


def _tree(n: int) -> dict[str, bytes]:
    return random_files(11, n, range(1, 3 * CHUNK), lambda i: f"d{i % 4}/f{i:03d}.bin")


def _serving(mp: Path) -> tuple[int, list[int]]:
    """(supervisor pid, serving pids) of the mount at `mp`: the supervisor's children."""
    out = subprocess.run(["pgrep", "-f", f"mount-process.*{mp}"], capture_output=True, text=True)
    ppid: dict[int, int] = {}
    for p in map(int, out.stdout.split()):
        try:
            ppid[p] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except FileNotFoundError:  # ended since pgrep saw it (a killed serving process)
            continue
    pids = list(ppid)
    sup = [p for p in pids if ppid[p] not in pids]
    assert len(sup) == 1, (pids, ppid)
    return sup[0], [p for p in pids if ppid[p] == sup[0]]


def _cpu(pid: int) -> int:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def test_reads_from_every_process_are_correct_and_counted_once(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    files = _tree(60)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, files)
    node = make_node()
    mp = node.mount(
        local_store.uri(bucket_name),
        tmp_path / "m",
        "--chunk-size",
        "256K",
        "--serve-processes",
        "3",
    )
    sup, kids = _serving(mp)
    assert len(kids) == 3
    before = {p: _cpu(p) for p in kids}
    errors: list[str] = []

    def reader(seed: int) -> None:
        names = sorted(files)
        random.Random(seed).shuffle(names)
        for name in names:
            with open(mp / name, "rb") as f:  # OPEN, READs, RELEASE land anywhere
                if f.read() != files[name]:
                    errors.append(name)

    for _ in range(2):  # the second round: warm (hits and the kernel's pages)
        threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert sorted(os.listdir(mp / "d1")) == sorted(
        n.split("/")[1] for n in files if n.startswith("d1/")
    )
    assert all(_cpu(p) > before[p] for p in kids), "some serving process served nothing"
    # Each file was read whole by the first round at least once; the page cache serves
    # the rest. Status sums the processes' counters: no byte is counted twice.
    total = sum(len(b) for b in files.values())
    m = node.settle(mp, total)
    assert m["bytes_read"] <= 8 * total
    served = m["served_bytes"]
    assert served["cache"] + served["buffer"] + served["store"] == m["bytes_read"]


def test_a_refresh_while_files_are_open_keeps_each_handle_at_its_version(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    rnd = random.Random(13)
    old, new = rnd.randbytes(2 * CHUNK), rnd.randbytes(2 * CHUNK)  # same size
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K", "--serve-processes", "3")
    f = a / "f.bin"
    # Several handles, opened (and read) by whichever processes the kernel picked.
    fds = [os.open(f, os.O_RDONLY) for _ in range(6)]
    try:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            assert os.pread(fd, 4096, 0) == old[:4096]
        mtime = os.stat(f).st_mtime_ns
        local_store.put(bucket_name, "f.bin", new)
        node.mount(uri, tmp_path / "b", "--chunk-size", "256K", "--refresh")
        wait_for(lambda: os.stat(f).st_mtime_ns != mtime, what="mount a to follow")

        for _ in range(3):  # opened while old handles are open: direct_io, new bytes
            assert f.read_bytes() == new
        for _ in range(3):  # each read may land in another process
            for fd in fds:
                for off in (CHUNK + 100, 0, 5000):
                    try:
                        got = os.pread(fd, 4096, off)
                    except OSError as exc:  # the store refuses the old version
                        assert exc.errno == errno.EIO
                        continue
                    assert got == old[off : off + 4096], f"new bytes at {off}, old handle"
        assert os.pread(fds[0], 4096, 0) == old[:4096]  # its cached chunk: still served
    finally:
        for fd in fds:
            os.close(fd)
    assert f.read_bytes() == new
    assert f.read_bytes() == new


def test_an_open_handle_reads_its_version_in_every_process_refreshes_later(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A handle of a file a refresh changed, read by a serving process that never saw
    it, is served from the entry of the generation it was opened in (mount/fs.py
    _adopt). That generation was deleted by the second listing after (the mount said
    only the one it serves), and such a read was EIO; mounts now say the generations
    their open handles need, which the daemon keeps while they are open."""
    rnd = random.Random(17)
    old, new = rnd.randbytes(CHUNK), rnd.randbytes(CHUNK)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"f.bin": old, "g.bin": b"0"})
    uri = local_store.uri(bucket_name)
    node = make_node()
    node.expect_errors(r"changed since (this mount listed it|listing)")
    a = node.mount(uri, tmp_path / "a", "--chunk-size", "256K", "--serve-processes", "3")
    ds = node.request("POST", "/v1/datasets", {"uri": uri})
    fds = [os.open(a / "f.bin", os.O_RDONLY) for _ in range(9)]  # opened in any process
    try:
        assert os.pread(fds[0], CHUNK, 0) == old  # the old version's chunk: in the cache
        for i in range(1, 4):  # three refreshes: the first changes f.bin
            if i == 1:
                local_store.put(bucket_name, "f.bin", new)
            local_store.put(bucket_name, "g.bin", str(i).encode())
            node.request("POST", "/v1/datasets", {"uri": uri, "refresh": True})
            wait_for(
                lambda i=i: node.request("GET", f"/v1/datasets/{ds['id']}")["generation"] == i + 1,
                what=f"listing {i + 1}",
            )
            # Every serving process moved (the daemon keeps the oldest any says): the
            # next listing deletes what they left.
            wait_for(lambda i=i: node.mount_status(a)["generation"] == i + 1, what="its report")
        assert (a / "f.bin").read_bytes() == new
        for _ in range(3):
            for fd in fds:  # its pages dropped: each read reaches one of the processes
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, CHUNK, 0) == old
    finally:
        for fd in fds:
            os.close(fd)


def test_unmount_ends_every_process(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    files = _tree(8)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, files)
    node = make_node()
    uri = local_store.uri(bucket_name)
    a = node.mount(uri, tmp_path / "a", "--serve-processes", "2")
    b = node.mount(uri, tmp_path / "b", "--serve-processes", "2")
    for mp, how in ((a, "sigterm"), (b, "fusermount")):
        sup, kids = _serving(mp)
        assert (mp / "d0/f000.bin").read_bytes() == files["d0/f000.bin"]
        if how == "sigterm":
            os.kill(sup, signal.SIGTERM)
        else:
            subprocess.run(["fusermount3", "-u", str(mp)], check=True)
        for pid in [sup, *kids]:
            wait_for(
                lambda pid=pid: (
                    not Path(f"/proc/{pid}").exists()
                    or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
                ),
                what=f"process {pid} to end ({how})",
            )
        assert not mounted(mp)
    wait_for(lambda: not node.status()["mounts"], what="the mounts to say goodbye")


def test_a_killed_serving_process_is_replaced(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    files = _tree(40)
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, files)
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "m", "--serve-processes", "2")
    sup, kids = _serving(mp)
    stop = threading.Event()
    outcomes: list[str] = []

    def reader() -> None:
        names = sorted(files)
        while not stop.is_set():
            for name in names:
                try:
                    with open(mp / name, "rb") as f:
                        data = f.read()
                    outcomes.append("ok" if data == files[name] else f"wrong {name}")
                except OSError as exc:  # a request the killed process had read: an error
                    outcomes.append(f"error {exc.errno}")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(outcomes) > 50, what="reads before the kill")
        os.kill(kids[0], signal.SIGKILL)
        wait_for(
            lambda: len(_serving(mp)[1]) == 2 and kids[0] not in _serving(mp)[1],
            what="a replacement serving process",
        )
        n = len(outcomes)
        wait_for(lambda: len(outcomes) > n + 100, what="reads after the replacement")
        # A SIGTERM to a serving process is not an unmount either: it is replaced too.
        victim = _serving(mp)[1][0]
        os.kill(victim, signal.SIGTERM)
        wait_for(
            lambda: len(_serving(mp)[1]) == 2 and victim not in _serving(mp)[1],
            what="a replacement after SIGTERM",
        )
        n = len(outcomes)
        wait_for(lambda: len(outcomes) > n + 50, what="reads after the second replacement")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not [o for o in outcomes if o.startswith("wrong")]
    assert (mp / "d0/f000.bin").read_bytes() == files["d0/f000.bin"]
    force_unmount(str(mp))


def test_open_files_and_directories_up_to_the_table_whichever_process_opened_them(
    make_node, local_store, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    """A program holding many directories and files open (a walker keeping directory
    fds, a DataLoader's workers) on a mount with four serving processes. Each process
    allocated handles only in its quarter of the shared table, and the kernel hands
    OPENs to whichever process reads them: one process's quarter full was ENFILE with
    three quarters free (2,048 directories with two processes failed at 1,849). Now the
    whole table's count holds: DIR_SLOTS directories and, as far as this process's
    RLIMIT_NOFILE lets it, FILE_SLOTS files, all readable."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = min(FILE_SLOTS, hard - DIR_SLOTS - _FD_SPARE)
    if files < 1:
        # Holding DIR_SLOTS directories and a file open needs that many fds in this
        # process besides pytest's and the node's: below, the opens fail with EMFILE,
        # which says nothing of silofs's table.
        pytest.skip(
            f"RLIMIT_NOFILE hard limit {hard} < {DIR_SLOTS + _FD_SPARE + 1}: this process "
            f"cannot hold DIR_SLOTS ({DIR_SLOTS}) directories and a file open (ulimit -Hn)"
        )
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"d/x.bin": b"x", "f.bin": b"file bytes"})
    node = make_node()
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "m", "--serve-processes", "4")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[int] = []
    try:
        for _ in range(DIR_SLOTS):
            held.append(os.open(mp / "d", os.O_RDONLY | os.O_DIRECTORY))
        for _ in range(files):
            held.append(os.open(mp / "f.bin", os.O_RDONLY))
        assert os.listdir(held[DIR_SLOTS - 1]) == ["x.bin"]
        assert os.pread(held[-1], 100, 0) == b"file bytes"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(held) == DIR_SLOTS + files
    assert (mp / "f.bin").read_bytes() == b"file bytes"
