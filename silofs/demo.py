"""`silofs demo`: the newcomer's first run, on a local directory as the bucket.

Owns making a small sample dataset, mounting it with a private daemon (its own socket
and cache under the demo dir, so it touches nothing else on the machine), reading it
twice as a training epoch would, and printing what the cache did; each run starts with
an empty cache. Never needs a cloud account and leaves no mount or daemon behind.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import click

from silofs.control.client import ControlClient, ControlError
from silofs.mountinfo import fuse_device_refusal
from silofs.pids import pid_alive
from silofs.records import shown
from silofs.units import count

SMALL_FILES = 500
SMALL_SIZE = 110 << 10
BIG_SIZE = 64 << 20


def make_dataset(root: Path, files: int = SMALL_FILES, big: int = BIG_SIZE) -> None:
    marker = root / ".complete"
    if marker.exists():
        return
    rnd = random.Random(0)
    for i in range(files):
        path = root / "train" / f"class{i % 10}" / f"img{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rnd.randbytes(SMALL_SIZE))
    (root / "shards").mkdir(exist_ok=True)
    (root / "shards" / "shard-000.tar").write_bytes(os.urandom(big))
    marker.write_text("")


def read_epoch(mnt: Path) -> tuple[int, int, float]:
    """Read every file once in random order, as a training epoch does."""
    files = [p for p in mnt.rglob("*") if p.is_file()]
    random.shuffle(files)
    t0 = time.monotonic()
    total = 0
    for p in files:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
            # Forget the pages so the next epoch is served by silofs, not the page cache.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return len(files), total, time.monotonic() - t0


def _silofs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "silofs", *args], capture_output=True, text=True)


def _mount_stats(socket: str, expected: int) -> dict:
    """The demo mount's counters once they account for `expected` bytes read (a mount
    reports its counters to the daemon a few times a second), or as they are after 5 s."""
    deadline = time.monotonic() + 5
    with ControlClient(socket) as c:
        while True:
            m = c.request("GET", "/v1/status")["mounts"][0]
            if m["bytes_read"] >= expected or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def default_dir() -> Path:
    """The demo's directory when --dir is not given: one per user, so a second user of a
    host (or root before them) does not find the first's files, which it may not write."""
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid with no passwd entry (a container)
        user = str(os.geteuid())
    return Path(f"/var/tmp/silofs-demo-{user}")


def ownership_error(root: Path, euid: int) -> str | None:
    """Why `root` may not hold this user's demo, or None: it must be a directory of
    this user's, not a symlink (anyone can create a name in /var/tmp before them)."""
    try:
        st = root.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory"
    if euid != 0 and st.st_uid != euid:
        return f"{root} belongs to another user"
    return None


def run_demo(root: Path, epochs: int, files: int = SMALL_FILES, big: int = BIG_SIZE) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # not a directory (a file, a dangling symlink): said below
        pass
    # After the mkdir: a name made by someone else first (a race in /var/tmp) is caught.
    why = ownership_error(root, os.geteuid())
    if why is not None:
        raise click.ClickException(f"{why}: choose another --dir")
    data, mnt, socket = root / "bucket", root / "mnt", str(root / "control.sock")
    # Before the sample dataset is written: a user the FUSE device refuses cannot run
    # the demo at all.
    if (refusal := fuse_device_refusal(str(mnt))) is not None:
        raise click.ClickException(refusal)
    click.echo(
        shown(f"sample dataset: {data} ({files} x 110KiB files and one {big >> 20}MiB shard)")
    )
    make_dataset(data, files, big)
    mnt.mkdir(parents=True, exist_ok=True)
    # Every run starts cold, as the first did: a cache kept from an earlier run would
    # serve epoch 1 too, and the demo would show nothing. Its daemon (left by a run that
    # was killed) goes first: it holds the cache open.
    _stop_daemon(socket)
    shutil.rmtree(root / "cache", ignore_errors=True)
    res = _silofs(
        "mount",
        str(data),
        str(mnt),
        "--socket",
        socket,
        "--job",
        "demo",
        "--cache-dir",
        str(root / "cache"),
        "--cache-size",
        "1G",
    )
    if res.returncode != 0:
        raise click.ClickException(res.stderr.strip().removeprefix("silofs: error: "))
    click.echo(shown(f"mounted file://{data}/ at {mnt}"))
    read = 0
    try:
        for epoch in range(1, epochs + 1):
            n, nbytes, secs = read_epoch(mnt)
            read += nbytes
            m = _mount_stats(socket, read)
            click.echo(
                f"epoch {epoch}: {count(n, 'file')}, {nbytes / 1e6:.0f} MB in {secs:.2f}s "
                f"({nbytes / 1e6 / secs:.0f} MB/s); cache hits so far "
                f"{m['hit_bytes'] / 1e6:.0f} MB of {m['bytes_read'] / 1e6:.0f} MB read, "
                f"remote GETs {m['remote_gets']}"
            )
    finally:
        unmounted = _silofs("unmount", str(mnt), "--socket", socket)
        _stop_daemon(socket)
    if unmounted.returncode != 0:
        # The last part of "cannot unmount M: fusermount3: failed to unmount M: REASON".
        why = unmounted.stderr.strip().rpartition(": ")[2].partition(" (")[0] or "no reason given"
        raise click.ClickException(
            f"could not unmount {mnt}: {why} (close what uses it, then `fusermount3 -u {mnt}`)"
        )
    click.echo("unmounted; epoch 2 onwards came from the local cache (remote GETs stay flat)")


def _stop_daemon(socket: str) -> None:
    try:
        with ControlClient(socket) as c:
            pid = c.request("GET", "/v1/status")["node"]["pid"]
        os.kill(pid, signal.SIGTERM)
    except (ControlError, ProcessLookupError):
        return
    deadline = time.monotonic() + 15  # it flushes pending admissions first
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
