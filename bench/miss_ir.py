"""Instructions and bytecodes a mount spends on a warm read its daemon answers (a miss).

A peer-served chunk reaches the mount as a daemon-answered miss: the chunk is not in the
node's LMDB, so the mount's READ asks its daemon (GET /v1/chunks), whose mount
connection's thread answers it by naming the chunk's place in the connection's hand-off
region (silofs/sealed.py Region, node/api/chunks.py peer_chunk). This bench counts what
the MOUNT's side of that costs, per one-chunk 110 KiB file: LOOKUP, OPEN + RELEASE and
READ of silofs.mount.fs called in a loop (as bench/handler_ir.py does for hits), one
mount kept, over an LMDB env that lists the files and caches none of them, against a
stand-in daemon in a process of its own: serve_unix with the chunk route served from
the connection's thread (Route.inline) answering from a region, as a member-served
chunk is. The stand-in does no daemon work (no placement, no peer exchange): what is
counted is the mount's and what the mount's client does for it.

Two counts, each exact under load (neither is a time):

- callgrind's instructions of the counting process (the mount's handlers and its client;
  the stand-in daemon is another process, not counted): the difference between a run of
  3 passes and one of 1, per file. With --hit the same files cached instead (hits, as
  handler_ir.py --kept counts them) for the comparison.
- --bytecodes: Python bytecodes per file per handler and per function (sys.settrace
  with f_trace_opcodes, the third pass), and the C functions each handler calls.

    python bench/miss_ir.py [--files 300] [--hit] [--bytecodes] [--git-rev main]

--git-rev REV counts REV's mount first, in a process of its own (tests/support/
baseline.py); the stand-in daemon is this tree's in both. Needs valgrind (not for
--bytecodes); no root, no FUSE. What FUSE itself costs (the kernel's requests, pyfuse3)
is not here: bench/cluster.py measures the whole path.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import types

import common  # noqa: F401 - this checkout (or a baseline) first on sys.path
import trio
from fs_ops import CHUNK, SMALL, cached_files

from tests.support import baseline

BODY_SEED = 7


def build(d: str, files: int, hit: bool) -> None:
    """The env of `files` 110 KiB files under small/, their chunks cached only with `hit`
    (fs_ops.cached_files caches them; for misses its chunks are deleted again)."""
    record, names = cached_files(d, files)
    if not hit:
        import lmdb

        env = lmdb.open(os.path.join(d, "env"), max_dbs=16, map_size=1 << 30)
        chunks = env.open_db(b"chunks")
        with env.begin(write=True, db=chunks) as txn:
            keys = [k for k, _ in txn.cursor()]
            for k in keys:
                txn.delete(k)
        env.close()
    with open(os.path.join(d, "record"), "wb") as f:
        pickle.dump((record, names), f)


def stand_in(path: str) -> None:
    """The stand-in daemon (run as `--serve PATH`): every chunk asked is 110 KiB of
    random bytes, written into the connection's region and named there, from the
    connection's thread, as node/api/chunks.py peer_chunk answers a member-served chunk."""
    from silofs import sealed
    from silofs.control.router import Caller, Request, Response, Route, Router
    from silofs.control.server import serve_unix

    body = os.urandom(SMALL)
    router = Router()

    def inline(req: Request) -> Response | None:
        region = req.region if req.query.get("region") == "1" else None
        if region is None:
            return None
        view = region.view(SMALL)
        assert view is not None
        view[:] = body
        where = region.where(view)
        headers = {"x-silofs-source": "cache", sealed.REGION_HEADER: where}
        fd = None if region.sent else region.value
        region.sent = True
        return Response(200, b"", "application/octet-stream", headers, fd=fd)

    async def loop_answer(req: Request) -> Response:
        return Response(200, body, "application/octet-stream", {"x-silofs-source": "cache"})

    router.add_route(
        Route("GET", "/v1/chunks", loop_answer, Caller.LOCAL, threaded=True, inline=inline)
    )
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    trio.run(lambda: serve_unix(path, router))


def kept_mount(d: str, sock: str) -> tuple:
    """One mount's handlers over d's env, its reader asking the stand-in at `sock`."""
    from silofs.cache.store import CacheStore
    from silofs.control.client import AsyncControlClient
    from silofs.mount.fs import Presentation, SilofsFS
    from silofs.mount.listing_view import ListingView
    from silofs.mount.reader import ChunkReader

    with open(os.path.join(d, "record"), "rb") as f:
        record, names = pickle.load(f)
    store = CacheStore(os.path.join(d, "env"), 1 << 30)

    async def never() -> None:
        raise AssertionError("the stand-in never forgets the mount")

    client = AsyncControlClient(sock)
    view = ListingView(store, 1, record)
    reader = ChunkReader(
        store,
        client,
        dataset_id=1,
        chunk_size=CHUNK,
        buffer_bytes=CHUNK,  # ~37 of the files: a pass over more finds none of them
        readahead_bytes=4 * CHUNK,
        reregister=never,
    )
    reader.registered("m1", False)
    fs = SilofsFS(view, reader, Presentation(0, 0, 0o444, 0o555, 3600.0))
    return view, reader, fs, names


HANDLERS = ("LOOKUP", "OPEN", "READ", "RELEASE")


def passes(d: str, sock: str, count: int, trace: bool = False) -> dict | None:
    """`count` passes of LOOKUP, OPEN, READ, RELEASE over every file, one mount kept
    (run under callgrind); with `trace`, the bytecodes of the last pass by handler and
    function, and the C calls by handler."""
    from silofs.mount.listing_view import ROOT_INODE

    view, reader, fs, names = kept_mount(d, sock)
    # Without the cyclic collector: when its passes fall depends on every allocation
    # since start (handler_ir.py); the handlers make no cycles that matter here.
    gc.disable()
    ctx = types.SimpleNamespace(pid=os.getpid(), uid=0, gid=0, umask=0o22)
    current: list[str | None] = [None]
    ops: collections.Counter = collections.Counter()
    funcs: collections.Counter = collections.Counter()
    ccalls: collections.Counter = collections.Counter()

    def local(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "opcode" and current[0]:
            ops[current[0]] += 1
            code = frame.f_code
            funcs[(current[0], f"{_module(code.co_filename)}:{code.co_qualname}")] += 1
        return local

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    def prof(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "c_call" and current[0]:
            ccalls[(current[0], getattr(arg, "__qualname__", str(arg)))] += 1

    def mark(name: str | None) -> None:
        current[0] = name

    async def run() -> None:
        # Not reader.start(): its tasks (the idle snapshot's release, the waiting
        # reads' watcher) wake on the clock, so how often they ran would depend on
        # how fast the passes went, which callgrind and the host's load change.
        reader.renew()
        small = view.lookup(ROOT_INODE, b"small")
        assert small is not None
        for p in range(count):
            on = trace and p == count - 1
            if on:
                sys.settrace(tracer)
                sys.setprofile(prof)
            for name in names:
                on and mark("LOOKUP")
                attr = await fs.lookup(small.inode, name, ctx)  # type: ignore[arg-type]
                on and mark("OPEN")
                fi = await fs.open(attr.st_ino, os.O_RDONLY, ctx)  # type: ignore[arg-type]
                on and mark("READ")
                data = await fs.read(fi.fh, 0, 112 << 10)
                on and mark("RELEASE")
                await fs.release(fi.fh)
                on and mark(None)
                assert len(data) == SMALL
            if on:
                sys.settrace(None)
                sys.setprofile(None)
        await reader.client.aclose()

    trio.run(run)
    if not trace:
        return None
    n = len(names)
    modules: collections.Counter = collections.Counter()
    for (h, fn), c in funcs.items():
        modules[f"{h} {fn.split(':')[0]}"] += c
    return {
        "handlers": {h: ops[h] / n for h in HANDLERS},
        "modules": {m: c / n for m, c in modules.most_common(25)},
        "funcs": {f"{h} {fn}": c / n for (h, fn), c in funcs.most_common(80)},
        "ccalls": {f"{h} {fn}": c / n for (h, fn), c in sorted(ccalls.items()) if c / n >= 0.5},
    }


def _module(path: str) -> str:
    """A code object's module as a short name: silofs/mount/reader.py, trio/_core/_run.py."""
    parts = path.split(os.sep)
    for top in ("silofs", "trio", "pyfuse3"):
        if top in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(top) :])
    return parts[-1]


def counted(d: str, sock: str, count: int) -> int:
    """Instructions of `count` passes (the whole process, startup included)."""
    out = os.path.join(d, f"cg.{count}")
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
        + [__file__, "--passes", str(count), "--dir", d, "--sock", sock],
        check=True,
        capture_output=True,
    )
    with open(out) as f:
        m = re.search(r"^totals: (\d+)", f.read(), re.M)
    assert m, "no summary in callgrind's output"
    return int(m.group(1))


def listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        return probe.connect_ex(path) == 0


def measure(files: int, hit: bool, bytecodes: bool, keep: str | None = None) -> dict:
    """This tree's figures per file (the stand-in daemon started and stopped here)."""
    from tests.support.poll import wait_for

    d = tempfile.mkdtemp(prefix="silofs-missir-")
    sock = os.path.join(d, "daemon.sock")
    daemon = subprocess.Popen([sys.executable, __file__, "--serve", sock])
    try:
        build(d, files, hit)
        wait_for(lambda: listening(sock), 20.0, "the stand-in daemon's socket")
        if bytecodes:
            return passes(d, sock, 3, trace=True) or {}
        one, three = counted(d, sock, 1), counted(d, sock, 3)
        if keep:  # for callgrind_annotate
            os.makedirs(keep, exist_ok=True)
            for n in (1, 3):
                shutil.copy(os.path.join(d, f"cg.{n}"), os.path.join(keep, f"cg.{n}"))
        return {"instructions_per_file": (three - one) / (2 * files)}
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(d, ignore_errors=True)


def show(label: str, figures: dict) -> None:
    if "instructions_per_file" in figures:
        print(f"{label}: {figures['instructions_per_file'] / 1e3:.1f} k instructions per file "
              "(LOOKUP + OPEN + READ + RELEASE)")  # fmt: skip
        return
    print(f"{label}: bytecodes per file")
    for h, c in figures["handlers"].items():
        print(f"  {h:8s} {c:8.1f}")
    print(f"  {'all':8s} {sum(figures['handlers'].values()):8.1f}")
    print("  by module:")
    for m, c in figures["modules"].items():
        print(f"    {m:60s} {c:7.1f}")
    print("  by function:")
    for fn, c in figures["funcs"].items():
        print(f"    {fn:60s} {c:7.1f}")
    print("  C calls per file (>= 0.5):")
    for fn, c in figures["ccalls"].items():
        print(f"    {fn:60s} {c:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--hit", action="store_true", help="the files cached: hits, to compare")
    ap.add_argument("--bytecodes", action="store_true", help="bytecodes, not instructions")
    ap.add_argument("--keep", metavar="DIR", help="keep callgrind's two outputs in DIR")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--passes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    baseline.add_argument(ap, "mount (counted first, in a process of their own)")
    args = ap.parse_args()
    if args.serve:
        stand_in(args.serve)
        return
    if args.passes:
        passes(args.dir, args.sock, args.passes)
        return
    if shutil.which("valgrind") is None and not args.bytecodes:
        sys.exit("miss_ir.py needs valgrind (or --bytecodes)")
    if args.git_rev:
        baseline.run_self_first(args.git_rev, __file__)
    label = f"{'hits' if args.hit else 'daemon-answered misses'}, {args.files} files"
    show(label, measure(args.files, args.hit, args.bytecodes, args.keep))


if __name__ == "__main__":
    main()
