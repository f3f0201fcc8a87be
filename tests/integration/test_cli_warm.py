"""`silofs warm`: fills a dataset's share with a uniform sample, charged to a job, with
progress on a terminal and in status; resumable and cancellable."""

from __future__ import annotations

import os
import pty
import random
import signal
import subprocess
import threading
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache, silofs_cmd
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]


@pytest.fixture
def dataset(make_node, local_store, bucket_name, monkeypatch) -> tuple[Node, str, int]:
    local_store.apply_env(monkeypatch)
    rnd = random.Random(7)
    objects = {
        f"train/c{i % 4}/f{i:03d}.bin": rnd.randbytes(rnd.randrange(100_000, 300_000))
        for i in range(60)
    }
    local_store.create(bucket_name, objects)
    node = make_node(cache_size="64M")
    return node, local_store.uri(bucket_name), sum(len(v) for v in objects.values())


def ds_view(node: Node, uri: str) -> dict:
    return next((d for d in node.status()["datasets"] if d["uri"] == uri), {})


def test_warm_half_the_dataset_then_read_it_all(dataset, tmp_path: Path) -> None:
    node, uri, size = dataset
    half = size // 2
    node.request("PUT", f"/v1/datasets/{quote(uri, safe='')}/cache", {"bytes": half})
    res = node.run("warm", uri, "--job", "prep")
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith(f"silofs: warmed {uri}: "), res.stderr
    d = ds_view(node, uri)
    assert d["warm"]["state"] == "done" and d["warm"]["target_bytes"] == half
    # Full up to the allocation, short of it by less than one (<= 300 kB) object.
    assert half - 300_000 < d["cached_bytes"] <= half, d
    job = next(j for j in node.status()["jobs"] if j["name"] == "prep")
    assert job["remote_bytes"] == d["warm"]["fetched_bytes"] >= d["cached_bytes"]
    # It stops at the allocation: at most the last few chunks in flight are wasted.
    assert d["warm"]["fetched_bytes"] <= half + 8 * 300_000, d["warm"]

    # Run again: what it holds is skipped, never fetched again. The room left (under one
    # object) may take a small chunk the new random order starts with, plus the few in
    # flight when it stops; never more than the allocation is cached.
    room = half - d["cached_bytes"]
    res = node.run("warm", uri, "--job", "prep")
    assert res.returncode == 0, res.stderr
    again = ds_view(node, uri)
    assert again["warm"]["skipped_bytes"] == d["cached_bytes"], again["warm"]
    assert again["warm"]["fetched_bytes"] <= room + 8 * 300_000, again["warm"]
    assert d["cached_bytes"] <= again["cached_bytes"] <= half, again

    # Reading everything hits about half: the warm took a uniform sample, and a full
    # dataset admits nothing more.
    mp = node.mount(uri, tmp_path / "mnt", "--job", "train")
    total = 0
    for path in sorted(mp.rglob("*.bin")):
        total += len(path.read_bytes())
        drop_file_cache(path)
    assert total == size
    m = node.settle(str(mp), size)
    ratio = m["hit_bytes"] / m["bytes_read"]
    assert 0.4 <= ratio <= 0.52, m


def test_a_warm_whose_paths_match_nothing_says_so(dataset) -> None:
    """--paths of a directory's name ('train/c0', not 'train/c0/*') or a typo warmed
    nothing and said "warmed ...: 0B cached of 0B", exit 0: the epoch read cold."""
    node, uri, _ = dataset
    for paths in (["train/c0/"], ["train/c0"], ["trian/*", "nope"]):
        res = node.run("warm", uri, "--job", "prep", *(a for p in paths for a in ("--paths", p)))
        assert res.returncode == 1, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("silofs: error: no object of "), lines
        assert all(repr(p) in lines[0] for p in paths) and "'train/*'" in lines[0], lines
    # A '[' is a set's start: one no ']' closes is refused by name, and a match of
    # nothing with a '[' in a glob says how to write a literal one.
    for glob, says in (("train/c0[", "starts a set no ']' closes"), ("train/[c]0[/]", "[[]")):
        res = node.run("warm", uri, "--job", "prep", "--paths", glob)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1 and says in lines[0], res
    assert ds_view(node, uri)["cached_bytes"] == 0
    res = node.run("warm", uri, "--job", "prep", "--paths", "train/c0/*")
    assert res.returncode == 0 and "warmed" in res.stderr, res.stderr
    assert ds_view(node, uri)["warm"]["matched_objects"] == 15


def test_warm_shows_progress_stops_on_ctrl_c_and_resumes(dataset, tmp_path: Path) -> None:
    node, uri, size = dataset
    # ~6 MB matched: at 512 kB/s the warm runs ~12 s, so the Ctrl-C below lands while it
    # runs even on a loaded CI host (at 2 MB/s it once finished first, exit 0 not 130).
    node.request("PUT", "/v1/jobs/slow/io", {"bytes_per_s": "512kB/s"})
    master, slave = pty.openpty()  # a terminal: the progress bar is drawn
    proc = subprocess.Popen(
        silofs_cmd("warm", uri, "--job", "slow", "--paths", "train/c[01]/*"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env=node.env,
        # Ctrl-C as a terminal delivers it: a suite started in the background (`cmd &`,
        # as CI may) has SIGINT ignored, the child would inherit that, and Python then
        # installs no KeyboardInterrupt handler (the warm ran to its end, exit 0).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    try:
        w = wait_for(
            lambda: (w := (ds_view(node, uri).get("warm") or {})).get("done_bytes", 0) > 0 and w,
            what="warm progress in status",
        )
        assert w["state"] == "running" and w["paths"] == ["train/c[01]/*"]
        assert w["matched_bytes"] < size  # two of the four classes
        out = b""
        while b"ETA" not in out:
            out += os.read(master, 4096)
        assert b"warm [" in out
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        rest = b""
        try:
            while chunk := os.read(master, 4096):
                rest += chunk
        except OSError:  # EIO once the child's end is closed
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 130
    assert b"run it again to resume" in rest, rest
    stopped = wait_for(lambda: (w := ds_view(node, uri)["warm"])["state"] != "running" and w)
    assert stopped["state"] == "cancelled"
    assert 0 < stopped["fetched_bytes"] < stopped["target_bytes"]

    node.request("PUT", "/v1/jobs/slow/io", {"bytes_per_s": None})
    res = node.run("warm", uri, "--job", "slow", "--paths", "train/c[01]/*")
    assert res.returncode == 0, res.stderr
    done = ds_view(node, uri)["warm"]
    assert done["state"] == "done" and done["skipped_bytes"] >= stopped["fetched_bytes"] // 2
    assert done["done_bytes"] == done["target_bytes"] == done["matched_bytes"]


def test_a_warm_of_a_paused_job_says_so_and_goes_on_at_the_raise(dataset) -> None:
    """allocate-io JOB 0 pauses a warm charged to JOB (promise 2): the CLI says it is
    paused, on a line of its own (not a terminal here), instead of hanging silently."""
    node, uri, size = dataset
    node.request("PUT", "/v1/jobs/prep/io", {"bytes_per_s": 0})
    proc = subprocess.Popen(
        silofs_cmd("warm", uri, "--job", "prep"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=node.env,
        cwd=node.root,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("warm paused" in line for line in lines), 30, what="the pause")
        (said,) = [line for line in lines if "warm paused" in line]
        assert "job prep's remote IO allocation is 0" in said, said
        assert "silofs-ctl allocate-io prep RATE" in said, said
        assert proc.poll() is None
        assert ds_view(node, uri)["warm"]["fetched_bytes"] == 0
        node.request("PUT", "/v1/jobs/prep/io", {"bytes_per_s": None})
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    # "warm resumed" comes too unless the warm ended before the CLI's next look (0.2 s).
    assert lines[-1].startswith(f"silofs: warmed {uri}: "), lines
    assert ds_view(node, uri)["warm"]["fetched_bytes"] == size  # a 64M cache holds it all
