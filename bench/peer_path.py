"""The peer path against local cache hits: two silofs daemons of one cluster on
127.0.0.1, reading chunks this node holds and chunks its peer serves.

Owns one measurement: a local directory of one-chunk files (so every file is homed at
one member), mounted on both nodes of a two-member cluster; node A reads everything
once (each chunk fetched once, by its home, and admitted there); then, alternating,
each pass on a fresh mount of A (no chunk buffer, the page cache of the files dropped):
the files homed at A (local cache hits: LMDB through the mount) and the files homed at
B (peer-served: A's daemon asks B's over mutual TLS, verifies, answers the mount). It
prints MB/s of each, their ratio (goal: peer >= 0.5x local), and the CPU per MiB read
of A's mount, A's daemon (the asker) and B's daemon (the home), from /proc. Every byte
read is compared with the file. Never runs in CI and never changes silofs.

    python bench/peer_path.py                     # 64 files of 4 MiB, 4 readers, 3 runs
    python bench/peer_path.py --files 32 --readers 1 --runs 5

MB is 10**6 bytes. The machine is shared: the load average and busy processes are
printed first; compare figures within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from common import (  # also puts this checkout first on sys.path
    ProcTimes,
    Samples,
    busy_processes,
    check_fuse,
    load_average,
    ratio,
    read_files,
)

from silofs.cache.format import chunk_key
from silofs.node.placement import Candidate, home
from silofs.units import parse_size
from tests.support.cluster import write_cluster
from tests.support.net import free_ports
from tests.support.node import Node

MB = 10**6
MiB = 1 << 20


def _content_id(path: Path) -> str:
    """The local backend's content id (node/backends/local.py): inode, mtime, ctime, size."""
    st = os.stat(path)
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_ctime_ns}-{st.st_size}"


def _drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _pass(node: Node, mp: str, uri: str, paths: list[str], readers: int, want: dict) -> tuple:
    """One timed pass on a fresh mount: (MB/s, CPU of the mount, bytes)."""
    node.mount(uri, mp)
    try:
        _drop(paths)
        mpid = node.mount_pid(mp)
        m0 = ProcTimes.of(mpid)
        seconds, nbytes = read_files(paths, readers)
        m1 = ProcTimes.of(mpid)
        for p in paths[:8]:  # spot check every run (all of them were checked cold)
            assert Path(p).read_bytes() == want[os.path.basename(p)], p
    finally:
        node.unmount(mp)
    return nbytes / seconds / MB, m1.minus(m0).cpu_s, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--chunk-size", type=parse_size, default=4 * MiB, help="e.g. 4M, 128K")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    check_fuse()
    print(f"load average: {load_average()}")
    for line in busy_processes():
        print(f"busy: {line}")
    chunk = args.chunk_size
    with tempfile.TemporaryDirectory(prefix="silofs-peer-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        data = root / "data"
        data.mkdir()
        rnd = random.Random(7)
        want = {}
        for i in range(args.files):
            want[f"f{i:04d}.bin"] = rnd.randbytes(chunk)
            (data / f"f{i:04d}.bin").write_bytes(want[f"f{i:04d}.bin"])
        sized = {"daemon": {"chunk_size": str(chunk)}}
        ports = free_ports(2)
        specs = write_cluster(root, ["127.0.0.1"] * 2, ports, name="bench", extra=sized)
        cache = 2 * args.files * chunk + (256 << 20)
        a = Node(specs[0].root / "node", cache, config=specs[0].config)
        b = Node(specs[1].root / "node", cache, config=specs[1].config)
        uri = f"file://{data}/"
        with a, b:
            a.start()
            b.start()
            members = [Candidate(s.address) for s in specs]
            local, peer = [], []
            for name in sorted(want):
                key = chunk_key(_content_id(data / name), chunk, 0)
                (local if home(key, members).address == specs[0].address else peer).append(name)
            print(f"{len(local)} files homed at A (local hits), {len(peer)} at B (peer-served)")
            mp_a, mp_b = str(root / "mnt-a"), str(root / "mnt-b")
            b.mount(uri, mp_b)  # B must have the dataset open to serve a local directory
            a.mount(uri, mp_a)
            for name in sorted(want):  # cold: every chunk fetched by its home
                assert (Path(mp_a) / name).read_bytes() == want[name], name
            a.unmount(mp_a)
            rates = {"local": Samples([]), "peer": Samples([])}
            cpu = {k: Samples([]) for k in ("mount", "asker", "home", "local")}
            for _ in range(args.runs):
                for kind, names in (("local", local), ("peer", peer)):
                    paths = [os.path.join(mp_a, n) for n in names]
                    a0, b0 = ProcTimes.of(a.daemon_pid), ProcTimes.of(b.daemon_pid)
                    rate, mount_cpu, nbytes = _pass(a, mp_a, uri, paths, args.readers, want)
                    a1, b1 = ProcTimes.of(a.daemon_pid), ProcTimes.of(b.daemon_pid)
                    rates[kind].values.append(rate)
                    if kind == "local":
                        cpu["local"].values.append(1000 * mount_cpu / (nbytes / MiB))
                    else:
                        mib = nbytes / MiB
                        cpu["mount"].values.append(1000 * mount_cpu / mib)
                        cpu["asker"].values.append(1000 * a1.minus(a0).cpu_s / mib)
                        cpu["home"].values.append(1000 * b1.minus(b0).cpu_s / mib)
            status = a.status()
            peer_stats = status["datasets"][0]["peer"]
            print(f"local cache hits: {rates['local'].text('{:.0f}')} MB/s")
            print(f"peer-served:      {rates['peer'].text('{:.0f}')} MB/s")
            print(f"peer / local: {ratio(rates['peer'].median, rates['local'].median):.2f}x"
                  " (goal >= 0.5x)")  # fmt: skip
            print(
                "CPU ms per peer-served MiB: "
                f"mount {cpu['mount'].text('{:.1f}')}, asking daemon {cpu['asker'].text('{:.1f}')},"
                f" home daemon {cpu['home'].text('{:.1f}')}"
            )
            print(f"CPU ms per local-hit MiB: mount {cpu['local'].text('{:.1f}')}")
            print(f"asker's peer counters: {peer_stats}")


if __name__ == "__main__":
    main()
