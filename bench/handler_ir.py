"""Instructions silofs's FUSE handlers run per warm 110 KiB file, counted by callgrind.

Prints, per file, the instructions of LOOKUP, OPEN + RELEASE and READ (silofs.mount.fs
called in a loop, as bench/fs_ops.py does, over a real LMDB env whose values are in the
page cache), each a fresh mount's: every pass builds a new ListingView, ChunkReader and
SilofsFS, so each file is looked up, decoded and its attributes built once per pass, as
after a mount starts. With --kept one mount serves every pass, as in bench/throughput.py's
warm passes (the kernel forgot the names, the page cache was dropped, the mount kept
what it had learnt): the passes after the first find what the mount keeps per name and
per inode. Each figure is the difference between a run of 3 passes and one of 1
(startup, and with --kept the first pass, cancel out), over --files files. Needs
valgrind; no root, no FUSE. It leaves out what FUSE itself costs (bench/throughput.py
measures that). --git-rev REV counts REV's handlers first, in a process of their own
(tests/support/baseline.py). --ceiling also counts the ceiling's four handlers
(bench/rawfuse.py MemFS, the same files read into memory at its start) the same way,
so each request's figure has the ceiling's beside it:

    python bench/handler_ir.py [--files 300] [--kept] [--ceiling] [--git-rev main]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import common  # noqa: F401 - this checkout (or a baseline) first on sys.path
import trio
from fs_ops import SMALL, cached_files, fresh_mount, retire
from rawfuse import MemFS

import silofs.mount.reader as reader_mod
from silofs.cache.store import CacheStore
from silofs.mount.listing_view import ROOT_INODE
from tests.support import baseline

MODES = ("L", "LO", "LOR")  # lookup; + open and release; + read


def build(d: str, files: int) -> None:
    """The env and listing of `files` cached 110 KiB files under small/, and the same
    files under d/tree/small for the ceiling."""
    with open(os.path.join(d, "record"), "wb") as f:
        pickle.dump(cached_files(d, files, with_tree=True), f)


async def one_pass(fs: Any, parent: int, names: list[bytes], mode: str) -> None:
    """One pass of the handlers `mode` names over every file, the same for silofs and
    the ceiling: LOOKUP, then OPEN and RELEASE ("LO"), with a whole READ between ("LOR").
    One call a pass, not a file: nothing is added to the per-file figures."""
    for name in names:
        attr = await fs.lookup(parent, name, None)
        if mode == "L":
            continue
        fi = await fs.open(attr.st_ino, os.O_RDONLY, None)
        if mode == "LOR":
            assert len(await fs.read(fi.fh, 0, 112 << 10)) == SMALL
        await fs.release(fi.fh)


def ceiling_passes(d: str, count: int, mode: str) -> None:
    """`count` passes of the ceiling's handlers (bench/rawfuse.py MemFS, the files read
    into memory at start) over every file, as passes() does silofs's."""
    with open(os.path.join(d, "record"), "rb") as f:
        _, names = pickle.load(f)
    fs = MemFS(os.path.join(d, "tree"))
    gc.disable()
    small = fs.children[ROOT_INODE][b"small"]

    async def run() -> None:
        for _ in range(count):
            await one_pass(fs, small, names, mode)

    trio.run(run)


def passes(d: str, count: int, mode: str, kept: bool = False) -> None:
    """`count` passes of the handlers over every file (run under callgrind), each a fresh
    mount's, or with `kept` all one mount's."""
    with open(os.path.join(d, "record"), "rb") as f:
        record, names = pickle.load(f)
    store = CacheStore(os.path.join(d, "env"), 1 << 30)
    # Without the cyclic collector: when its full passes fall depends on every allocation
    # since start, so one more or less in a run moved it by 10-20 M instructions (a
    # negative LOOKUP figure once). The handlers make no cycles: refcounting frees all.
    gc.disable()
    # No snapshot renewal by the clock: a reader renews its LMDB snapshot once it is
    # SNAPSHOT_REUSE_SECONDS old (0.25 s), at most 4 times a second: one per 250-2,500
    # files at this host's FUSE rates, but under callgrind (~50x slower) one every few
    # dozen files, and how many fell in the measured passes followed the host's load.
    # Set on the module the handlers read it from, so a --git-rev tree's run takes it too.
    reader_mod.SNAPSHOT_REUSE_SECONDS = float("inf")

    async def run() -> None:
        mount = fresh_mount(store, record) if kept else None
        for _ in range(count):
            view, reader, fs = mount or fresh_mount(store, record)
            small = view.lookup(ROOT_INODE, b"small")
            assert small is not None
            await one_pass(fs, small.inode, names, mode)
            if mount is None:
                view.close()
                retire(reader)  # its snapshot ends; the env stays open for the next
        if mount is not None:
            mount[0].close()
            retire(mount[1])

    trio.run(run)


def counted(d: str, count: int, mode: str, kept: bool, ceiling: bool = False) -> int:
    """Instructions of a whole run of `count` passes under callgrind (of the ceiling's
    handlers with `ceiling`)."""
    out = os.path.join(d, f"cg.{mode}.{count}{'.ceiling' if ceiling else ''}")
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
        + [__file__, "--passes", str(count), "--mode", mode, "--dir", d]
        + (["--kept"] if kept else [])
        + (["--ceiling"] if ceiling else []),
        check=True,
        capture_output=True,
        # One hash seed for every run: with a random one per process, dict probes (the
        # names, the kept replies) differ between the 3-pass and 1-pass runs, which moved
        # a figure by +-2 k per file from one run to the next.
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    with open(out) as f:
        m = re.search(r"^totals: (\d+)", f.read(), re.M)
    assert m is not None, "no totals line in callgrind's output"
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument(
        "--kept", action="store_true", help="one mount serves every pass (throughput.py's case)"
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also count the ceiling's handlers (bench/rawfuse.py MemFS) over the same files",
    )
    ap.add_argument("--passes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    baseline.add_argument(ap, "handlers (counted first, in a process of their own)")
    args = ap.parse_args()
    if args.passes is not None:  # one run under callgrind
        if args.ceiling:
            ceiling_passes(args.dir, args.passes, args.mode)
        else:
            passes(args.dir, args.passes, args.mode, args.kept)
        # No interpreter finalization: what it frees and collects at exit differed by
        # ~1 M instructions between runs (gc_collect_main, the frees of module teardown),
        # which the 3-minus-1 difference spread over the files: READ moved by 2-4 k per
        # file from one run to the next.
        sys.stdout.flush()
        os._exit(0)
    if shutil.which("valgrind") is None:
        raise SystemExit("handler_ir.py needs valgrind")
    if args.git_rev:
        baseline.run_self_first(args.git_rev, __file__)
    with tempfile.TemporaryDirectory(prefix="silofs-handler-ir-") as d:
        build(d, args.files)
        kinds = [False, True] if args.ceiling else [False]
        per = {
            (c, m): (counted(d, 3, m, args.kept, c) - counted(d, 1, m, args.kept, c))
            / 2
            / args.files
            for c in kinds
            for m in MODES
        }
    for c in kinds:
        lookup, read = per[c, "L"], per[c, "LOR"] - per[c, "LO"]
        open_release = per[c, "LO"] - per[c, "L"]
        what = (
            "the ceiling's (rawfuse.py MemFS)"
            if c
            else ("one mount kept" if args.kept else "a fresh mount each")
        )
        print(
            f"instructions per warm 110 KiB file ({args.files} files, 3 passes minus 1, "
            f"{what}): LOOKUP {lookup / 1e3:.1f} k, OPEN + RELEASE {open_release / 1e3:.1f} k, "
            f"READ {read / 1e3:.1f} k, all four {per[c, 'LOR'] / 1e3:.1f} k"
        )


if __name__ == "__main__":
    main()
