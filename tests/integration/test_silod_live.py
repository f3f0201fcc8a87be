"""bench/silod_live.py in its smallest form, so the live SiloD harness cannot rot.

Owns: one run of the harness against moto (the session's S3 server) behind the
harness's own bandwidth-limited proxy: two jobs of a few MB, the live controller
(silod) and the one-LRU baseline (alluxio), each on a fresh daemon with real mounts and
real job processes. Asserts what would break if the harness or the knobs it drives
rotted: every job read exactly its epochs' bytes through its mount, the controller's
cache served the repeated epochs, each system has live and simulated figures, and no
mount or process of the run is left. Never asserts live vs simulated accuracy (that is
docs/RESULTS.md's figure, measured on the larger scenarios).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.node import FUSE_MISSING, pids_with
from tests.support.servers import S3Server

REPO = Path(__file__).resolve().parents[2]


SCENARIO = """
description = "the harness's smoke test"
[cluster]
remote_io = "10MB/s"
[[cluster.nodes]]
name = "node"
gpus = 2
cache = "6MB"
[[jobs]]
name = "img-a"
submit = "0s"
gpus = 1
dataset = "img-a"
dataset_size = "5MB"
ideal_io = "4MB/s"
epochs = 6
[[jobs]]
name = "shards-b"
submit = "1s"
gpus = 1
dataset = "shards-b"
dataset_size = "9MB"
ideal_io = "6MB/s"
epochs = 1.5
"""


def test_the_smallest_live_form_runs_and_cleans_up(
    s3_server: S3Server, bucket_name: str, tmp_path: Path
) -> None:
    if FUSE_MISSING:
        pytest.skip(FUSE_MISSING)
    scenario = tmp_path / "live-smoke.toml"
    scenario.write_text(SCENARIO)
    work = tmp_path / "run"
    work.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        **s3_server.env,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "TMPDIR": str(work),  # the run's directory, so we can look for leftovers
    }
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "silod_live.py"),
            str(scenario),
            "--systems",
            "silod,alluxio",
            "--s3-endpoint",
            s3_server.endpoint_url,
            "--bucket",
            bucket_name,
            "--interval",
            "2",
            "--timeout",
            "60",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)["systems"]
    assert set(out) == {"silod", "alluxio"}
    sizes = {"img-a": 5_000_000 * 6, "shards-b": int(9_000_000 * 1.5)}
    for system, o in out.items():
        for key in ("avg_jct_s", "makespan_s", "sim_avg_jct_s", "sim_makespan_s"):
            assert math.isfinite(o[key]) and o[key] > 0, (system, key, o)
        assert o["makespan_s"] >= max(j["jct_s"] for j in o["jobs"].values()) - 1e-6
        for name, job in o["jobs"].items():
            # A fractional epoch stops at the first file past its share: at most one
            # file (a shard is 8 MiB) more than epochs x size.
            assert sizes[name] <= job["bytes_read"] < sizes[name] + (8 << 20), (system, job)
            served = job["served_bytes"]
            assert sum(served.values()) == job["bytes_read"], (system, name, served)
    # img-a's dataset fits the controller's cache: once the controller has seen the job
    # (a poll or two; until then its dataset has a 0 allocation), its epochs hit. Six
    # epochs of 1.25 s leave several after that even on a loaded machine.
    served = out["silod"]["jobs"]["img-a"]["served_bytes"]
    assert served["cache"] > 5_000_000, served
    assert pids_with(str(work)) == []
    with open("/proc/self/mountinfo") as f:
        assert str(work) not in f.read()
