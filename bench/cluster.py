"""One cache across the nodes of a cluster, against each node's cache alone: N nodes
(network namespaces on one bridged subnet, tests/support/netcluster.py) read one dataset
from one store behind a limited link, two epochs, each node in its own random order.

    python bench/cluster.py [--nodes 4] [--quick] [--json] [--only shared|alone]
        [--files N] [--file-size 256K] [--readers 4] [--store s3rver|moto]
        [--store-rate 50MB/s] [--store-latency-ms 20] [--node-rate 25Gbit/s]
        [--cache-slack 0.1] [--keep DIR] [--profile PREFIX] [--perf PREFIX] [--syscalls]
        [--timeline] [--pin]

Each node's link to the others is shaped to --node-rate, 25 Gbit/s by default: the NICs
of GPU cluster nodes carry 25-400 Gbit/s, and a 1 Gbit/s link (~119 MiB/s) would cap
peer-served reads below the 0.5x-of-local-hits goal by construction (local hits run at
several hundred MiB/s here), so the bench would measure the shaping, not the peer path.
On this host's two cores the veths never reach 25 Gbit/s: the peer path's CPU is what
bounds it. The fault-case tests keep their 1 Gbit/s links (tests/support/netcluster.py).

Each node's cache is 1/N of the dataset (plus --cache-slack: rendezvous hashing gives a
member a binomial share of the chunks, and a home that owns more than its cache holds
misses on the rest in every epoch). "alone": no [cluster], every node fetches what it
misses from the store (~(2N - 1) x the dataset over two epochs for N = 4: 7 D). "shared":
the nodes are one cluster; a chunk's home fetches it once and serves it to the others
(goal: <= 1.1 D). Every byte read is compared to the source (wrong_bytes).

Then, in the shared cluster with its caches warm, one node reads the files homed at it
(local cache hits) and as many homed elsewhere (served by their homes) in alternating
rounds: the rate of each, and the CPU per MiB of the asking daemon, the homes' daemons
and the asking mount, from /proc; per chunk, each process's CPU, its threads' wait for
a core (schedstat's run-queue time) and how often they ran, the readers' CPU and the
reads' latency; the whole host's cores busy during each kind of round (/proc/stat:
whether the rounds wait on CPU or on wake-ups); and, labelled as a projection beside the
goal's figure, what the asking node alone (its daemon and mount) spends per peer-served
chunk and the rate its cores would allow with the homes on other hosts. --pin measures
that shape instead of projecting it: for the peer/local rounds the asking node (its
daemon, its mount and the readers) runs on core 0 and the homes on core 1, a one-core
node whose homes are on other hosts. --profile PREFIX runs py-spy on the asking daemon, its
mount and one home's daemon during more peer rounds (their figures are not comparable)
and prints where their busy time goes. --syscalls runs more peer rounds under `perf stat`
(tracepoints) and adds `syscalls_per_peer_chunk`: each process's system calls, context
switches (voluntary and not) and CPU per peer-served chunk, steadier than the rounds'.
--timeline has every daemon and mount of the run mark each stage of a chunk's way
(silofs/trace.py) and adds `timeline_us`: over 3 more peer rounds, the wall time of each
stage (the hand-offs between the mount, the asking daemon and the home, and each one's
work) at p50 and p90, and `batchable`: how many asks of one home, and misses of the
mount, were in flight or began together (what several chunks per exchange could carry).

Prints one JSON object with --json (the figures below otherwise), with the host's load.
Goals on the bench host: shared store_bytes <= 1.1 D; shared epoch 2 >= 2x faster than
alone; peer-served reads >= 0.5x the rate of local cache hits. Needs root (namespaces),
FUSE and tc; leaves no namespace, mount or process behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ProcTimes,
    Profiler,
    check_fuse,
    load_average,
    need_tools,
    profile_summary,
)

from silofs.units import parse_size  # noqa: E402
from tests.support.faultproxy import parse_rate  # noqa: E402
from tests.support.net import Link, NetnsUnavailable  # noqa: E402
from tests.support.netcluster import (  # noqa: E402
    MIB,
    Cluster,
    ClusterSpec,
    EpochReads,
    FileRead,
    cluster,
    drop_pages,
    epoch,
    read_file,
)
from tests.support.servers import S3Server, ServerError, start_moto, start_s3rver  # noqa: E402
from tests.support.trees import random_files  # noqa: E402

BUCKET = "cluster-bench"
QUICK = {"files": 256, "file_size": 128 << 10, "store_rate": 20e6}
FULL = {"files": 2048, "file_size": 256 << 10, "store_rate": 50e6}


def log(args: argparse.Namespace, text: str) -> None:
    """Progress on stderr (stdout is the JSON's with --json)."""
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


# -- one mode ----------------------------------------------------------------------------
def run_mode(
    args: argparse.Namespace, root: Path, store: S3Server, files: dict[str, bytes], shared: bool
) -> dict[str, Any]:
    size = sum(map(len, files.values()))
    spec = ClusterSpec(
        nodes=args.nodes,
        cache_size=math.ceil(size / args.nodes * (1 + args.cache_slack)),
        chunk_size=args.chunk_size,
        clustered=shared,
        node_link=Link(rate=args.node_rate),
        store_rate=args.store_rate,
        store_first_byte=args.store_latency_ms / 1000,
        cluster={"peer_timeout_seconds": 5.0},
    )
    mode = "shared" if shared else "alone"
    with cluster(root / mode, store, spec) as c:
        uri = store.uri(BUCKET)
        mounts = {role: c.mount(role, uri) for role in spec.roles}
        out: dict[str, Any] = {"store_bytes": 0, "epoch_s": [], "hit_ratio": [], "epochs": []}
        before = {r: _counters(c, r) for r in spec.roles}
        for e in (1, 2):
            base = c.store_bytes()
            cpu0 = _cpu(c)
            reads = epoch(mounts, files, seed=args.seed * 10 + e, readers=args.readers)
            cpu = _cpu_delta(cpu0, _cpu(c))
            for role in reads:
                c.nodes[role].node.settle(mounts[role], e * size)
            after = {r: _counters(c, r) for r in spec.roles}
            figures = _epoch_figures(reads, before, after, c.store_bytes() - base, cpu)
            before = after
            out["epochs"].append(figures)
            out["epoch_s"].append(figures["seconds"])
            out["hit_ratio"].append(figures["hit_ratio"])
            out["store_bytes"] += figures["store_bytes"]
            log(args, f"  {mode} epoch {e}: {_line(figures, size)}")
        out["peer_bytes"] = sum(e["peer_bytes"] for e in out["epochs"])
        out["wrong_bytes"] = sum(e["wrong_bytes"] for e in out["epochs"])
        out["read_errors"] = sum(e["read_errors"] for e in out["epochs"])
        out["store_over_dataset"] = round(out["store_bytes"] / size, 3)
        if shared:
            out["peer_vs_local"] = peer_vs_local(args, c, mounts, files)
        out["log_problems"] = [p for cn in c.nodes.values() for p in cn.node.log_problems()][:5]
        return out


def _counters(c: Cluster, role: str) -> dict[str, int]:
    """A node's cumulative counters: its mount's bytes read and the bytes of the store
    GETs its misses caused (here, or at their home: a chunk read over several FUSE
    requests is one GET, whose later requests the mount's buffer serves), and the
    chunk bytes members sent it."""
    cn = c.nodes[role]
    status = cn.status()
    m = cn.node.mount_status(cn.mountpoint)  # type: ignore[arg-type]
    cl = status.get("cluster") or {}
    return {
        "bytes_read": m["bytes_read"],
        "store": m["remote_bytes"],
        "hit_bytes": m["hit_bytes"],
        "peer_in": sum(p.get("bytes_in", 0) for p in cl.get("members", [])),
    }


def _cpu(c: Cluster) -> dict[str, float]:
    out = {}
    for role, cn in c.nodes.items():
        out[f"{role}:daemon"] = ProcTimes.of(cn.pid).cpu_s
        if cn.mountpoint is not None:
            out[f"{role}:mount"] = ProcTimes.of(cn.node.mount_pid(cn.mountpoint)).cpu_s
    return out


def _cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    daemons = sum(b[k] - a[k] for k in b if k.endswith(":daemon"))
    mounts = sum(b[k] - a[k] for k in b if k.endswith(":mount"))
    return {"daemons_s": round(daemons, 2), "mounts_s": round(mounts, 2)}


def _epoch_figures(
    reads: dict[str, EpochReads],
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    store_bytes: int,
    cpu: dict[str, float],
) -> dict[str, Any]:
    by_node = {}
    for role in reads:
        read = after[role]["bytes_read"] - before[role]["bytes_read"]
        store = after[role]["store"] - before[role]["store"]
        by_node[role] = round(1 - store / read, 4) if read else None
    total_read = sum(after[r]["bytes_read"] - before[r]["bytes_read"] for r in reads)
    total_store = sum(after[r]["store"] - before[r]["store"] for r in reads)
    return {
        "seconds": round(max(r.seconds for r in reads.values()), 2),
        "store_bytes": store_bytes,
        "hit_ratio": round(1 - total_store / total_read, 4) if total_read else None,
        "hit_ratio_by_node": by_node,
        "peer_bytes": sum(after[r]["peer_in"] - before[r]["peer_in"] for r in reads),
        "wrong_bytes": sum(r.wrong_bytes for r in reads.values()),
        "read_errors": sum(len(r.errors) for r in reads.values()),
        "slowest_read_s": round(max(r.slowest for r in reads.values()), 3),
        "cpu": cpu,
    }


def _line(f: dict[str, Any], size: int) -> str:
    return (
        f"{f['seconds']:.1f} s, store {f['store_bytes'] / size:.2f} D, hit ratio "
        f"{f['hit_ratio']}, peer {f['peer_bytes'] / size:.2f} D, wrong {f['wrong_bytes']}, "
        f"errors {f['read_errors']}, slowest read {f['slowest_read_s']} s, cpu {f['cpu']}"
    )


# -- peer-served against local hits ------------------------------------------------------
def peer_vs_local(
    args: argparse.Namespace, c: Cluster, mounts: dict[str, Any], files: dict[str, bytes]
) -> dict[str, Any]:
    """On the first node, with the caches warm: the files homed there (local cache hits)
    and as many homed elsewhere (served by their homes), read in alternating rounds."""
    role = c.spec.roles[0]
    cn = c.nodes[role]
    mp = mounts[role]
    homes = c.homes(BUCKET)
    local = sorted(k for (k, i), h in homes.items() if h == role and i == 0)
    others = sorted(k for (k, i), h in homes.items() if h != role and i == 0)
    random.Random(args.seed).shuffle(others)
    peer = others[: len(local)]
    rates: dict[str, list[float]] = {"local": [], "peer": []}
    cpu: dict[str, dict[str, float]] = {"local": {}, "peer": {}}
    mount_pid = cn.node.mount_pid(mp)
    homes_pids = [x.pid for r, x in c.nodes.items() if r != role]
    peer_in0 = _counters(c, role)["peer_in"]

    pids = {"daemon": [cn.pid], "mount": [mount_pid], "homes": homes_pids}
    ns: dict[str, dict[str, int]] = {"local": {}, "peer": {}}

    def times() -> tuple[ProcTimes, ...]:
        homes = [ProcTimes.of(p) for p in homes_pids]
        home_loops = [_loop_times(p) for p in homes_pids]
        return (
            ProcTimes.of(cn.pid),
            ProcTimes.of(mount_pid),
            ProcTimes(sum(h.user_s for h in homes), sum(h.sys_s for h in homes), 0),
            _loop_times(cn.pid),
            ProcTimes(sum(h.user_s for h in home_loops), sum(h.sys_s for h in home_loops), 0),
        )

    before = {p: os.sched_getaffinity(p) for p in (cn.pid, mount_pid, os.getpid(), *homes_pids)}
    if args.pin:
        # The asking node (its daemon, its mount, the readers in this process) on one
        # core, the homes on the other: a node whose homes run on other hosts.
        for pid in (cn.pid, mount_pid, os.getpid()):
            _pin(pid, {0})
        for pid in homes_pids:
            _pin(pid, {1})
    waits: dict[str, dict[str, int]] = {"local": {}, "peer": {}}
    slices: dict[str, dict[str, int]] = {"local": {}, "peer": {}}
    seconds_of: dict[str, list[float]] = {"local": [], "peer": []}
    readers_s: dict[str, float] = {"local": 0.0, "peer": 0.0}
    host: dict[str, dict[str, int]] = {"local": {}, "peer": {}}
    for _ in range(args.rounds):
        for kind, keys in (("local", local), ("peer", peer)):
            drop_pages(mp, keys)
            n0 = {name: _sched_sum(ps) for name, ps in pids.items()}
            h0 = _host_ticks()
            t0 = times()
            r0 = _self_cpu_s()
            start = time.monotonic()
            reads = _read_keys(mp, keys, files, args.readers)
            seconds = time.monotonic() - start
            readers_s[kind] += _self_cpu_s() - r0
            t1 = times()
            h1 = _host_ticks()
            for i, key in enumerate(("busy", "all")):
                host[kind][key] = host[kind].get(key, 0) + h1[i] - h0[i]
            for name, ps in pids.items():
                run, wait, runs = _sched_sum(ps)
                ns[kind][name] = ns[kind].get(name, 0) + run - n0[name][0]
                waits[kind][name] = waits[kind].get(name, 0) + wait - n0[name][1]
                slices[kind][name] = slices[kind].get(name, 0) + runs - n0[name][2]
            seconds_of[kind] += [r.seconds for r in reads]
            rates[kind].append(sum(r.nbytes for r in reads) / seconds / MIB)
            names = ("daemon", "mount", "homes", "daemon_loop", "homes_loop")
            for name, a, b in zip(names, t0, t1, strict=True):
                cpu[kind][name] = cpu[kind].get(name, 0.0) + b.cpu_s - a.cpu_s
                cpu[kind][f"{name}_sys"] = cpu[kind].get(f"{name}_sys", 0.0) + b.sys_s - a.sys_s
    if args.pin:
        for pid, cores in before.items():
            _pin(pid, cores)
    peer_mib = len(peer) * args.file_size * args.rounds / MIB
    local_mib = len(local) * args.file_size * args.rounds / MIB
    local_rate, peer_rate = statistics.median(rates["local"]), statistics.median(rates["peer"])
    if args.profile:
        _profile_peer_round(args, c, mp, peer, files)
    if args.perf:
        _perf_peer_round(args, c, mp, peer, files)
    calls = _syscalls_peer_round(args, c, mp, peer, files) if args.syscalls else None
    timeline = _timeline_peer_round(args, c, mp, peer, files) if args.timeline else None
    return {
        "node": role,
        **({"pinned": "asking node on core 0, homes on core 1"} if args.pin else {}),
        "files": {"local": len(local), "peer": len(peer)},
        "rounds": args.rounds,
        "local_mib_s": round(local_rate, 1),
        "peer_mib_s": round(peer_rate, 1),
        "peer_over_local": round(peer_rate / local_rate, 3) if local_rate else None,
        "peer_served_mib": round((_counters(c, role)["peer_in"] - peer_in0) / MIB, 1),
        "cpu_ms_per_peer_mib": {
            "asking_daemon": round(1000 * cpu["peer"]["daemon"] / peer_mib, 2),
            "asking_mount": round(1000 * cpu["peer"]["mount"] / peer_mib, 2),
            "home_daemons": round(1000 * cpu["peer"]["homes"] / peer_mib, 2),
        },
        # Of the daemons', their trio loops' (the rest: connection and exchange threads).
        "loop_ms_per_peer_mib": {
            "asking_daemon": round(1000 * cpu["peer"]["daemon_loop"] / peer_mib, 2),
            "home_daemons": round(1000 * cpu["peer"]["homes_loop"] / peer_mib, 2),
        },
        # Of those, the kernel's part (system time: sockets, TLS records through the
        # veths and the bridge, page faults).
        "sys_ms_per_peer_mib": {
            "asking_daemon": round(1000 * cpu["peer"]["daemon_sys"] / peer_mib, 2),
            "asking_mount": round(1000 * cpu["peer"]["mount_sys"] / peer_mib, 2),
            "home_daemons": round(1000 * cpu["peer"]["homes_sys"] / peer_mib, 2),
        },
        # The same CPU at nanosecond resolution (the threads' run time from schedstat,
        # live threads only), per peer-served chunk: steadier than the ticks above.
        "cpu_us_per_peer_chunk": {
            name: round(ns["peer"][name] / 1000 / (len(peer) * args.rounds))
            for name in ("daemon", "mount", "homes")
        },
        "cpu_ms_per_local_mib": {
            "daemon": round(1000 * cpu["local"]["daemon"] / local_mib, 2),
            "mount": round(1000 * cpu["local"]["mount"] / local_mib, 2),
        },
        **_waits_and_asker(
            args, len(peer), len(local), ns, waits, seconds_of, readers_s, local_rate
        ),
        # How often each process's threads were put on a core per chunk: the
        # wake-ups a chunk costs (and any preemption at this load).
        "runs_per_peer_chunk": {
            name: round(slices["peer"][name] / (len(peer) * args.rounds), 2)
            for name in ("daemon", "mount", "homes")
        },
        # The whole host's cores (/proc/stat, every process and the kernel's own work,
        # other engineers' suites included) during each kind of round: busy / all, and
        # busy per chunk against the processes counted above plus the readers. Cores
        # far from busy with chunks waiting for a core (wait_us_per_peer_chunk) mean
        # the rounds wait on wake-ups, not on CPU.
        "host_busy": {
            kind: round(host[kind]["busy"] / host[kind]["all"], 2) if host[kind]["all"] else None
            for kind in ("peer", "local")
        },
        "host_cpu_us_per_chunk": {
            kind: round(host[kind]["busy"] / _TICKS * 1e6 / (n * args.rounds))
            for kind, n in (("peer", len(peer)), ("local", len(local)))
        },
        "runs_per_local_chunk": round(
            (slices["local"]["daemon"] + slices["local"]["mount"]) / (len(local) * args.rounds), 2
        ),
        **({"syscalls_per_peer_chunk": calls} if calls is not None else {}),
        **({"timeline_us": timeline} if timeline is not None else {}),
    }


def _waits_and_asker(
    args: argparse.Namespace,
    n_peer: int,
    n_local: int,
    ns: dict[str, dict[str, int]],
    waits: dict[str, dict[str, int]],
    seconds_of: dict[str, list[float]],
    readers_s: dict[str, float],
    local_mib_s: float,
) -> dict[str, Any]:
    """Where a peer-served chunk waits, and what the asking node alone spends on it.

    `wait_us_per_peer_chunk`: the time each process's threads were ready to run but
    waited for a core (schedstat's run-queue time): on two cores shared by four nodes
    and the readers, most of a chunk's wall time beyond its CPU. `asking_node_alone`
    is a projection, not the goal's figure: the CPU the asking node's own daemon and
    mount spend per peer-served chunk against the mount's per local hit, and the rate
    its cores would give peer reads if the homes ran on other hosts (as in a real
    cluster) and the node did nothing else; the readers' own CPU (the same per byte
    either way) is left out of both."""
    chunks = {"peer": n_peer * args.rounds, "local": n_local * args.rounds}
    chunk_mib = args.chunk_size / MIB
    peer_us = {k: ns["peer"][k] / 1000 / chunks["peer"] for k in ("daemon", "mount")}
    local_us = (ns["local"]["daemon"] + ns["local"]["mount"]) / 1000 / chunks["local"]
    asker_us = peer_us["daemon"] + peer_us["mount"]
    cores = 1 if args.pin else os.cpu_count() or 1  # --pin: the asking node had core 0

    def latency(kind: str) -> dict[str, float]:
        got = sorted(seconds_of[kind])
        return {f"p{q}": round(1000 * got[(len(got) - 1) * q // 100], 2) for q in (50, 90, 99)}

    return {
        "wait_us_per_peer_chunk": {
            name: round(waits["peer"][name] / 1000 / chunks["peer"])
            for name in ("daemon", "mount", "homes")
        },
        "wait_us_per_local_chunk": round(
            (waits["local"]["daemon"] + waits["local"]["mount"]) / 1000 / chunks["local"]
        ),
        "readers_cpu_us_per_chunk": {
            kind: round(1e6 * readers_s[kind] / chunks[kind]) for kind in chunks
        },
        "read_ms": {kind: latency(kind) for kind in chunks},
        "asking_node_alone": {
            "note": "projection, not the goal's figure: homes on other hosts",
            "cpu_us_per_peer_chunk": round(asker_us),
            "cpu_us_per_local_chunk": round(local_us),
            "peer_mib_s_if_cpu_bound": round(cores * 1e6 / asker_us * chunk_mib, 1),
            "local_mib_s_if_cpu_bound": round(cores * 1e6 / local_us * chunk_mib, 1),
            "peer_over_local_if_cpu_bound": round(local_us / asker_us, 3),
        },
        # The ceiling above over the local hits' measured rate (which is not CPU-bound).
        "asking_node_ceiling_over_local": round(
            cores * 1e6 / asker_us * chunk_mib / local_mib_s, 3
        ),
    }


def _self_cpu_s() -> float:
    """This process's CPU seconds (its readers'), at microsecond resolution."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sched_sum(pids: list[int]) -> tuple[int, int, int]:
    """(ns on CPU, ns ready but waiting for a CPU, times put on a CPU) of the
    processes' live threads (/proc/PID/task/*/schedstat): a round's threads live
    through it (a thread that ends takes its time with it)."""
    run = wait = runs = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    fields = f.read().split()
                run, wait = run + int(fields[0]), wait + int(fields[1])
                runs += int(fields[2])
            except (OSError, ValueError, IndexError):
                pass  # ended meanwhile
    return run, wait, runs


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` on `cores` (the threads it starts later inherit it from
    the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # ended meanwhile


_TICKS = os.sysconf("SC_CLK_TCK")


def _host_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of the host's cores since boot (/proc/stat's cpu line:
    idle and iowait are not busy; guest time is counted in user already)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _loop_times(pid: int) -> ProcTimes:
    """CPU of a daemon's main thread: its trio loop (handlers, routing, the cache)."""
    return ProcTimes.of(pid, tid=pid)


def _profile_peer_round(
    args: argparse.Namespace, c: Cluster, mp: Path, keys: list[str], files: dict[str, bytes]
) -> None:
    """More peer rounds under py-spy: the asking daemon, its mount and one home's."""
    asker = c.nodes[c.spec.roles[0]]
    home = c.nodes[c.spec.roles[1]]
    outs = [f"{args.profile}-{name}.txt" for name in ("asker", "mount", "home")]
    drop_pages(mp, keys)
    pids = (asker.pid, asker.node.mount_pid(mp), home.pid)
    with Profiler(pids[0], outs[0]), Profiler(pids[1], outs[1]), Profiler(pids[2], outs[2]):
        _read_keys(mp, keys * 6, files, args.readers, drop=True)
    for out in outs:
        log(args, f"\n{out}:\n{profile_summary(out)}")


def _perf_peer_round(
    args: argparse.Namespace, c: Cluster, mp: Path, keys: list[str], files: dict[str, bytes]
) -> None:
    """More peer rounds (30 x the peer files, page cache dropped before each read) under
    `perf record -g` (cpu-clock, 4 kHz) of the asking daemon, its mount and one home's
    daemon: PREFIX-{asker,mount,home}.data, with each one's samples by shared object
    and its top symbols in PREFIX-*.txt (`perf report --no-children`). Native code only:
    Python 3.11 has no perf trampoline, so the interpreter's samples are libpython's
    (_PyEval_EvalFrameDefault and its helpers), not the Python functions."""
    asker = c.nodes[c.spec.roles[0]]
    home = c.nodes[c.spec.roles[1]]
    pids = {"asker": asker.pid, "mount": asker.node.mount_pid(mp), "home": home.pid}
    procs = {}
    for name, pid in pids.items():
        argv = ["perf", "record", "-q", "-g", "-e", "cpu-clock", "-F", "4000", "-p", str(pid),
                "-o", f"{args.perf}-{name}.data"]  # fmt: skip
        try:
            procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)  # fmt: skip
        except FileNotFoundError:
            sys.exit("--perf needs perf (linux-perf)")
    time.sleep(1.0)  # perf attaches
    _read_keys(mp, keys * 30, files, args.readers, drop=True)
    for proc in procs.values():
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    for name in pids:
        data, txt = f"{args.perf}-{name}.data", f"{args.perf}-{name}.txt"
        with open(txt, "w") as out:
            for sort in ("dso", "dso,sym"):
                out.write(subprocess.run(
                    ["perf", "report", "-i", data, "--no-children", "--stdio", "-g", "none",
                     "--sort", sort, "--percent-limit", "0.3"],
                    capture_output=True, text=True).stdout)  # fmt: skip
        log(args, f"  perf: {data}, {txt}")


# What --syscalls counts (perf stat, tracepoints): the calls a peer-served chunk makes
# on each side, its context switches (voluntary: a wait; involuntary: a preemption) and
# its CPU (task-clock, ms).
_SYSCALLS = ("futex", "recvfrom", "sendto", "recvmsg", "sendmsg", "setsockopt", "read",
             "writev", "poll", "epoll_wait", "epoll_ctl", "brk", "mmap", "munmap")  # fmt: skip
_PERF_EVENTS = ",".join([*(f"syscalls:sys_enter_{n}" for n in _SYSCALLS), "context-switches",
                         "task-clock"])  # fmt: skip


def _syscalls_peer_round(
    args: argparse.Namespace, c: Cluster, mp: Path, keys: list[str], files: dict[str, bytes]
) -> dict[str, Any]:
    """More peer rounds (6 x the peer files, page cache dropped before each read) under
    `perf stat` on the asking daemon, its mount and all the homes: each one's system
    calls, context switches and CPU per peer-served chunk. The homes' figures are per
    chunk the asker read, all homes together (each answers about 1/(N-1) of them)."""
    asker = c.nodes[c.spec.roles[0]]
    homes = [x.pid for r, x in c.nodes.items() if r != c.spec.roles[0]]
    pids = {"daemon": [asker.pid], "mount": [asker.node.mount_pid(mp)], "homes": homes}
    with tempfile.TemporaryDirectory(prefix="silofs-perf-") as tmp:
        procs = {}
        for name, ps in pids.items():
            argv = ["perf", "stat", "-x", ",", "-e", _PERF_EVENTS,
                    "-p", ",".join(map(str, ps)), "-o", f"{tmp}/{name}"]  # fmt: skip
            try:
                procs[name] = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
            except FileNotFoundError:
                sys.exit("--syscalls needs perf (linux-perf)")
        time.sleep(1.0)  # perf attaches
        before = {name: _switches(ps) for name, ps in pids.items()}
        n = len(keys) * 6
        _read_keys(mp, keys * 6, files, args.readers, drop=True)
        after = {name: _switches(ps) for name, ps in pids.items()}
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        out: dict[str, Any] = {"chunks": n}
        for name in pids:
            counts: dict[str, float] = {}
            for line in Path(f"{tmp}/{name}").read_text().splitlines():
                fields = line.split(",")
                if len(fields) > 2 and fields[2]:
                    try:
                        counts[fields[2].removeprefix("syscalls:sys_enter_")] = float(fields[0])
                    except ValueError:  # <not counted>, <not supported>
                        pass
            per = {k: round(v / n, 2) for k, v in counts.items() if k != "task-clock"}
            per["cpu_us"] = round(1000 * counts.get("task-clock", 0.0) / n)
            per["voluntary_switches"] = round((after[name][0] - before[name][0]) / n, 2)
            per["involuntary_switches"] = round((after[name][1] - before[name][1]) / n, 2)
            out[name] = per
            log(args, f"  syscalls per peer-served chunk, {name}: {per}")
    return out


def _switches(pids: list[int]) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of the processes' live threads."""
    vol = invol = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            vol += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches:"):
                            invol += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                pass  # ended meanwhile
    return vol, invol


# The marks of a peer-served chunk (silofs/trace.py), in the order they are made: the
# mount's ask and its answer, the asking daemon's mount connection thread (the request's
# head read, its answer sent), its exchange with the home (begun; answered and checked)
# and the home's member thread (head read, answer sent).
_MARKS = ("mount:ask", "head:/v1/chunks", "ask:begin", "head:/v1/peer/chunk",
          "sent:/v1/peer/chunk", "ask:checked", "sent:/v1/chunks", "mount:answered")  # fmt: skip
_STAGES = (
    ("mount_to_daemon", "the mount's request sent -> the daemon thread has read and parsed it"),
    ("daemon_before_ask", "the daemon: route, listing row, placement, claim, ask's head"),
    ("asker_to_home", "the ask sent -> the home's thread has read and parsed it"),
    ("home_serves", "the home: look-up, check, the answer encrypted and sent"),
    ("home_to_asker", "the answer sent -> the asker has received it and checked every block"),
    ("daemon_answers", "the daemon: counters, the answer to the mount sent"),
    ("daemon_to_mount", "the answer sent -> the mount's request has returned with it"),
)


def _timeline_peer_round(
    args: argparse.Namespace, c: Cluster, mp: Path, keys: list[str], files: dict[str, bytes]
) -> dict[str, Any]:
    """More peer rounds (3 x the peer files, page cache dropped before each read) with
    the processes' marks (silofs/trace.py, on for this run: --timeline), joined by chunk:
    the wall time of each stage of a peer-served chunk's way, p50 and p90 in us, and the
    mount's whole ask. Measured under tracing (a write(2) per mark, 8 a chunk): beside
    the goal's figures, not one of them."""
    trace_dir = Path(os.environ["SILOFS_TRACE_DIR"])
    t0 = time.monotonic()
    _read_keys(mp, keys * 3, files, args.readers, drop=True)
    t1 = time.monotonic()
    marks: dict[str, list[tuple[float, str]]] = {}
    by_process: dict[str, list[tuple[float, str, str]]] = {}
    for path in trace_dir.glob("*.trace"):
        for line in path.read_text().splitlines():
            at, stage, chunk = line.split(" ", 2)
            if t0 <= float(at) <= t1 + 1.0:
                marks.setdefault(chunk, []).append((float(at), stage))
                by_process.setdefault(path.stem, []).append((float(at), stage, chunk))
    chains = []
    for seq in marks.values():
        seq.sort()
        i = 0
        while i < len(seq):  # one chain per ask of the mount: its marks in order
            if seq[i][1] != _MARKS[0]:
                i += 1
                continue
            chain, j = [seq[i][0]], i + 1
            for stage in _MARKS[1:]:
                while j < len(seq) and seq[j][1] != stage and seq[j][1] != _MARKS[0]:
                    j += 1
                if j == len(seq) or seq[j][1] != stage:
                    break
                chain.append(seq[j][0])
            if len(chain) == len(_MARKS):
                chains.append(chain)
            i = j if j > i else i + 1
    # Chains whole, of the reads: one its mount's buffer served asked nothing, and one
    # the asking daemon's loop served (not its connection thread) has no ask marks.
    out: dict[str, Any] = {"chunks": len(chains), "reads": len(keys) * 3}
    out["batchable"] = _batchable(by_process)
    if not chains:
        return out

    def pcts(values: list[float]) -> dict[str, int]:
        values = sorted(values)
        return {f"p{q}": round(values[len(values) * q // 100] * 1e6) for q in (50, 90)}

    for k, (name, _) in enumerate(_STAGES):
        out[name] = pcts([ch[k + 1] - ch[k] for ch in chains])
    out["mount_ask"] = pcts([ch[-1] - ch[0] for ch in chains])
    return out


def _batchable(by_process: dict[str, list[tuple[float, str, str]]]) -> dict[str, Any]:
    """What several chunks per exchange could carry on the peer-served path, from the
    timeline's marks (each process's own file: PID.trace): for the asking daemon's asks
    of a home (ask:begin -> ask:checked in its mount connection threads; the home is the
    process that read the chunk's ask in between) and for the mount's misses to its
    daemon (mount:ask -> mount:answered), per exchange: how many others of the same pair
    were in flight as it began, and how many began within 50 and 200 us after it (what
    one message could carry had the first waited that long: 0 is a batch of one); and
    the chunks per exchange had each pair made one exchange at a time, the asks that
    came meanwhile riding the next one together (each batch as long as its longest)."""
    homes: dict[str, list[tuple[float, str]]] = {}
    for pid, seq in by_process.items():
        for at, stage, chunk in seq:
            if stage == "head:/v1/peer/chunk":
                homes.setdefault(chunk, []).append((at, pid))
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for pid, seq in by_process.items():
        begun: dict[tuple[str, str], list[float]] = {}
        for at, stage, chunk in sorted(seq):
            for first, last, kind in (("ask:begin", "ask:checked", "peer"),
                                      ("mount:ask", "mount:answered", "mount")):  # fmt: skip
                if stage == first:
                    begun.setdefault((kind, chunk), []).append(at)
                elif stage == last and begun.get((kind, chunk)):
                    b = begun[(kind, chunk)].pop(0)
                    if kind == "mount":
                        pairs.setdefault((f"mount {pid}", pid), []).append((b, at))
                        continue
                    home = [h for t, h in homes.get(chunk, []) if b <= t <= at]
                    if home:
                        pairs.setdefault((f"peer {pid}", home[0]), []).append((b, at))

    def figures(kind: str) -> dict[str, Any]:
        in_flight, w50, w200, batches, n = [], [], [], 0, 0
        for (name, _), spans in pairs.items():
            if not name.startswith(kind):
                continue
            spans.sort()
            n += len(spans)
            for i, (b, _) in enumerate(spans):
                in_flight.append(sum(1 for ob, oe in spans if ob <= b < oe) - 1)
                later = [ob - b for ob, _ in spans[i + 1 :] if ob - b <= 200e-6]
                w200.append(len(later))
                w50.append(sum(1 for d in later if d <= 50e-6))
            j, free_at = 0, -math.inf
            while j < len(spans):  # one exchange at a time: who has come rides along
                start = max(spans[j][0], free_at)
                batch = [s for s in spans[j:] if s[0] <= start]
                free_at = start + max(e - b for b, e in batch)
                j, batches = j + len(batch), batches + 1

        def share(values: list[int]) -> dict[str, float]:
            return {str(k): round(values.count(k) / len(values), 3) for k in sorted(set(values))}

        if not n:
            return {"exchanges": 0}
        return {
            "exchanges": n,
            "others_in_flight": share(in_flight),
            "others_begun_within_50us": share(w50),
            "others_begun_within_200us": share(w200),
            "chunks_per_exchange_one_at_a_time": round(n / batches, 2),
        }

    return {"asker_to_home": figures("peer"), "mount_to_daemon": figures("mount")}


def _read_keys(
    mp: Path, keys: list[str], files: dict[str, bytes], readers: int, drop: bool = False
) -> list[FileRead]:
    def one(key: str) -> FileRead:
        if drop:
            drop_pages(mp, [key])
        r = read_file(mp / key, files[key])
        if r.error or r.wrong:
            raise AssertionError(f"{key}: {r.error or f'{r.wrong} wrong bytes'}")
        return r

    with ThreadPoolExecutor(readers) as pool:
        return list(pool.map(one, keys))


# -- the store and the whole run ---------------------------------------------------------
def start_store(args: argparse.Namespace, tmp: Path) -> S3Server:
    if args.store == "moto":
        return start_moto("moto-s3", log_path=tmp / "moto.log")
    return start_s3rver(tmp / "s3rver", tmp / "s3rver.log")


def upload(store: S3Server, files: dict[str, bytes]) -> None:
    client = store.client()
    client.create_bucket(Bucket=BUCKET)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=BUCKET, Key=kv[0], Body=kv[1]), files.items()))  # fmt: skip  # noqa: E501


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The side-by-side ratios and the goals."""
    out: dict[str, Any] = {}
    shared, alone = result.get("shared"), result.get("alone")
    if shared:
        out["shared_store_over_dataset"] = shared["store_over_dataset"]
        pvl = shared.get("peer_vs_local") or {}
        out["peer_over_local"] = pvl.get("peer_over_local")
    if alone:
        out["alone_store_over_dataset"] = alone["store_over_dataset"]
    if shared and alone:
        out["epoch2_speedup"] = round(alone["epoch_s"][1] / shared["epoch_s"][1], 2)
        out["alone_over_shared_store_bytes"] = round(
            alone["store_bytes"] / shared["store_bytes"], 2
        )
    goals = {}
    if "shared_store_over_dataset" in out:
        goals["shared_store_bytes_le_1.1D"] = out["shared_store_over_dataset"] <= 1.1
    if "epoch2_speedup" in out:
        goals["shared_epoch2_ge_2x_faster"] = out["epoch2_speedup"] >= 2.0
    if out.get("peer_over_local") is not None:
        goals["peer_ge_0.5x_local"] = out["peer_over_local"] >= 0.5
    out["goals_met"] = goals
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a small dataset for this host")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--only", choices=("shared", "alone"), default=None)
    ap.add_argument("--files", type=int, default=None)
    ap.add_argument("--file-size", type=parse_size, default=None)
    ap.add_argument("--chunk-size", type=parse_size, default=None, help="default: file size")
    ap.add_argument("--readers", type=int, default=4, help="reader threads per node")
    ap.add_argument("--pin", action="store_true",
                    help="peer/local rounds: asking node on core 0, homes on 1")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="peer/local rounds")
    ap.add_argument("--store", choices=("s3rver", "moto"), default="s3rver")
    ap.add_argument("--store-rate", type=parse_rate, default=None)
    ap.add_argument("--store-latency-ms", type=float, default=20.0)
    # A GPU node's NIC, not a 1 Gbit/s link that caps the peer path by itself (docstring).
    ap.add_argument("--node-rate", type=parse_rate, default=parse_rate("25Gbit/s"))
    ap.add_argument("--cache-slack", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default=None, help="work under this directory and keep it")
    ap.add_argument("--profile", default=None, help="py-spy the peer path: PREFIX-*.txt")
    ap.add_argument("--timeline", action="store_true",
                    help="more peer rounds, traced: each stage's wall time")  # fmt: skip
    ap.add_argument("--perf", default=None,
                    help="perf record the peer path: PREFIX-*.data and .txt")  # fmt: skip
    ap.add_argument("--syscalls", action="store_true",
                    help="perf stat the peer path: system calls, switches per chunk")  # fmt: skip
    args = ap.parse_args()
    shape = QUICK if args.quick else FULL
    args.files = args.files or shape["files"]
    args.file_size = args.file_size or shape["file_size"]
    args.chunk_size = args.chunk_size or args.file_size
    args.store_rate = args.store_rate or shape["store_rate"]
    need_tools(
        {
            "--profile": args.profile and "py-spy",
            "--perf": args.perf and "perf",
            "--syscalls": "perf" if args.syscalls else None,
        }
    )
    check_fuse()
    if os.geteuid() != 0:
        sys.exit("bench/cluster.py makes network namespaces: run it as root")
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="silofs-cluster-") as tmpdir:
        tmp = Path(args.keep) if args.keep else Path(tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        files = random_files(args.seed, args.files, args.file_size, "train/{i:05d}.bin")
        size = sum(map(len, files.values()))
        try:
            store = start_store(args, tmp)
        except ServerError as exc:
            sys.exit(f"cannot start the store: {exc}")
        try:
            upload(store, files)
            result: dict[str, Any] = {
                "nodes": args.nodes,
                "dataset_bytes": size,
                "files": args.files,
                "file_size": args.file_size,
                "chunk_size": args.chunk_size,
                "cache_per_node": math.ceil(size / args.nodes * (1 + args.cache_slack)),
                "readers_per_node": args.readers,
                "store": {
                    "server": args.store,
                    "rate": args.store_rate,
                    "first_byte_ms": args.store_latency_ms,
                },
                "node_link_rate": args.node_rate,
            }
            if args.timeline:  # the processes of the cluster started next inherit it
                os.environ["SILOFS_TRACE_DIR"] = str(tmp / "trace")
                (tmp / "trace").mkdir(exist_ok=True)
            for mode in ("alone", "shared"):
                if args.only in (None, mode):
                    log(args, f"{mode}: {args.nodes} nodes, dataset {size / MIB:.0f} MiB")
                    result[mode] = run_mode(args, tmp, store, files, mode == "shared")
        except NetnsUnavailable as exc:
            sys.exit(f"network namespaces unavailable: {exc}")
        finally:
            store.stop()
    result["summary"] = summary(result)
    result["host"] = {
        "cores": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_average(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
