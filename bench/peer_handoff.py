"""A peer-served chunk handed from the asking daemon to its mount: its bytes through the
Unix socket against a sealed memory file passed by descriptor (silofs/sealed.py), per
chunk or one per connection (sealed.Region, the hand-off region silofs uses).

Owns one measurement, the hand-off alone, in two processes over a socketpair: a child
(as the daemon) that, for each one-byte ask, fills a fresh buffer of the chunk's size
(where the decrypted TLS records would land) and answers with a 64-byte head and either
the bytes (one sendmsg) or the sealed file's descriptor (SCM_RIGHTS: memfd_create,
ftruncate, a populated mapping, the seals), or fills the connection's one region (made,
sealed and passed with the first answer) and answers with the head alone; and this
process (as the mount) receiving the bytes into a fresh buffer, or mapping the received
file read-only after checking its seals and range (sealed.map_received) and dropping the
mapping once used, or mapping the region once and copying each chunk out of it
(`region`) or only looking at it (`region-view`). It prints, per size and kind, both
sides' CPU per chunk (getrusage: microseconds) and the wall time, medians of --runs,
kinds alternating, and the ratios of the sums to the bytes'. Never runs in CI and never
changes silofs.

    python bench/peer_handoff.py                 # 128K, 512K and 1M, 2000 chunks, 5 runs
    python bench/peer_handoff.py --sizes 128K --chunks 5000

The machine is shared: the load average is printed; compare figures within one run.
"""

from __future__ import annotations

import argparse
import array
import mmap
import os
import resource
import socket
import statistics
import time

from common import load_average  # also puts this checkout first on sys.path

from silofs import heap, sealed
from silofs.units import parse_size

HEAD = 64


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _daemon(sock: socket.socket, size: int, chunks: int, kind: str, payload: bytes) -> None:
    """The child: answer each ask with the chunk's bytes or its sealed file."""
    head = b"h" * HEAD
    region = sealed.Region()
    for _ in range(chunks):
        sock.recv(1)
        if kind in ("region", "region-view"):
            kind = "region"
        if kind == "bytes":
            value = heap.uninitialized(size)
            value[:] = payload
            sock.sendmsg([head, value])
            continue
        if kind == "region":
            # One region for the connection, sealed and passed once, filled per chunk.
            view = region.view(size)
            assert view is not None and region.value is not None
            view[:] = payload
            view.release()
            if not region.sent:
                region.sent = True
                fds = array.array("i", [region.value.fd])
                sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            else:
                sock.send(head)
            continue
        built = sealed.buffer(HEAD + size)
        assert isinstance(built, sealed.SealedValue)
        built[HEAD:] = payload
        done = sealed.seal(built, size)
        fds = array.array("i", [done.fd])
        sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        del done, built


def _mount(sock: socket.socket, size: int, chunks: int, kind: str) -> None:
    """This process: ask, and take each answer as the mount's client would."""
    mapped: mmap.mmap | None = None
    for _ in range(chunks):
        sock.send(b"x")
        if kind in ("region", "region-view"):
            if mapped is None:
                _, ancillary, _, _ = sock.recvmsg(HEAD, socket.CMSG_SPACE(4))
                fds = array.array("i")
                fds.frombytes(ancillary[0][2][:4])
                mapped = sealed.map_region(fds[0])
            else:
                got = 0
                while got < HEAD:
                    got += len(sock.recv(HEAD - got))
            with memoryview(mapped) as view:
                if kind == "region":  # copied out, as the mount's client does
                    bytes(view[:size])
            continue
        if kind == "bytes":
            body = heap.uninitialized(HEAD + size)
            view, got = memoryview(body), 0
            while got < len(body):
                got += sock.recv_into(view[got:])
            continue
        _, ancillary, _, _ = sock.recvmsg(HEAD, socket.CMSG_SPACE(4))
        fds = array.array("i")
        fds.frombytes(ancillary[0][2][:4])
        data = sealed.map_received(fds[0], f"{HEAD} {size}")
        data.release()


def one_run(size: int, chunks: int, kind: str) -> tuple[float, float, float]:
    """(mount us, daemon us, wall us) per chunk."""
    payload = os.urandom(size)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    children0 = _cpu_s(resource.RUSAGE_CHILDREN)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            _daemon(theirs, size, chunks, kind, payload)
        finally:
            os._exit(0)
    theirs.close()
    cpu0, t0 = _cpu_s(resource.RUSAGE_SELF), time.perf_counter()
    _mount(ours, size, chunks, kind)
    cpu1, t1 = _cpu_s(resource.RUSAGE_SELF), time.perf_counter()
    os.waitpid(pid, 0)
    ours.close()
    daemon = _cpu_s(resource.RUSAGE_CHILDREN) - children0
    return tuple(1e6 * x / chunks for x in (cpu1 - cpu0, daemon, t1 - t0))  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128K,512K,1M", help="chunk sizes, comma-separated")
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    sealed.MIN_BYTES = 0  # every size in a memory file when asked for one
    print(f"load before: {load_average()}")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        one_run(size, 200, "bytes")  # warm the allocator and the socket's buffers
        runs: dict[str, list[tuple[float, float, float]]] = {
            "bytes": [],
            "memfd": [],
            "region": [],
            "region-view": [],
        }
        for _ in range(args.runs):
            for kind in runs:
                runs[kind].append(one_run(size, args.chunks, kind))
        sums = {}
        for kind, rows in runs.items():
            mount, daemon, wall = (statistics.median(col) for col in zip(*rows, strict=True))
            sums[kind] = mount + daemon
            print(
                f"{size >> 10:>5} KiB {kind:11}: mount {mount:6.1f} us, daemon {daemon:6.1f} us,"
                f" sum {mount + daemon:6.1f} us, wall {wall:6.1f} us per chunk"
            )
        for kind in ("memfd", "region", "region-view"):
            print(
                f"{size >> 10:>5} KiB {kind} over bytes (CPU sums): "
                f"{sums[kind] / sums['bytes']:.2f}x"
            )
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
