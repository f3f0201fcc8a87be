"""`silofs-ctl` as an operator types it: one error style, rates with units, a mistyped
job refused, an allocation removed; against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from silofs.control.client import ControlError
from tests.support.node import Node


def ctl(
    *args: str, socket: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    extra = ["--socket", socket] if socket else []
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def one_line_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert res.returncode == code, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{res.stderr}"
    assert lines[0].startswith("silofs-ctl: error: "), lines[0]
    assert "Usage:" not in res.stderr and "Error:" not in res.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("frobnicate",), "no such command"),
        (("allocate-io",), "missing argument"),
        (("allocate-io", "job", "1MB/s", "--no-such-flag"), "no such option"),
        (("allocate-cache", "ds", "12Q"), "not a size"),
        # Rounded to 0 B, and allocated so, silently; bytes are whole (1.5GiB is).
        (("allocate-cache", "ds", "0.5"), "not a whole number of bytes"),
        (("admission", "ds", "fifo"), "invalid value"),
        # JuiceFS users mean Mbps, rclone users KiB/s: a bare number is refused, as
        # `silofs mount --io-limit 100` refuses it.
        (("allocate-io", "job", "100"), "needs a unit"),
        (("allocate-io", "job"), "missing argument 'rate'"),
        (("allocate-io", "job", "1MB/s", "--clear"), "--clear takes no rate"),
        # An empty --socket (a variable that was not set) asked the default daemon.
        (("status", "--socket", ""), "--socket is empty"),
        (("forget", "x", "--socket", ""), "--socket is empty"),
        (("job", "show", "x", "--socket", ""), "--socket is empty"),
    ],
)
def test_usage_errors_are_one_line_with_our_prefix_and_exit_2(
    args: tuple[str, ...], needle: str
) -> None:
    one_line_error(ctl(*args), 2, needle)


def test_an_unreachable_daemon_is_one_line_and_exit_1(tmp_path: Path) -> None:
    one_line_error(ctl("status", socket=str(tmp_path / "none.sock")), 1, "cannot reach")


def test_allocate_io_refuses_unknown_jobs_and_clears(make_node, tmp_path: Path) -> None:
    node: Node = make_node()
    sock = node.socket

    def allocations() -> dict:
        return node.request("GET", "/v1/allocations")["io"]

    # Nothing knows "train" yet: refused, nothing stored.
    # Exit 1: what the node knows is its answer, as for `forget` and `refresh` of an
    # unknown name (this was 2, a usage error's code, while those were 1).
    one_line_error(ctl("allocate-io", "train", "10MB/s", socket=sock), 1, "no job 'train'")
    assert allocations() == {} and node.status()["jobs"] == []
    # --create says its mounts are coming.
    res = ctl("allocate-io", "train", "10MB/s", "--create", socket=sock)
    assert res.returncode == 0 and res.stdout.strip() == "train: remote IO allocation 10.0MB/s", res
    assert allocations() == {"train": 10_000_000}

    # A typo of a known job: refused with a suggestion; the known one is allocated as is.
    line = one_line_error(ctl("allocate-io", "trian", "5MB/s", socket=sock), 1, "no job 'trian'")
    assert "did you mean 'train'" in line
    assert "trian" not in allocations()
    assert all(j["name"] != "trian" for j in node.status()["jobs"])
    res = ctl("allocate-io", "train", "0", socket=sock)  # 0 (stop remote IO) needs no unit
    assert res.returncode == 0, res
    assert allocations() == {"train": 0}

    # Persisted: a restarted daemon has it, and still knows the job.
    node.stop()
    node.start()
    assert allocations() == {"train": 0}
    assert ctl("allocate-io", "train", "1.5Gbps", socket=sock).returncode == 0
    assert allocations() == {"train": 187_500_000}
    # A rate so small that one chunk's miss waits days is a rate (set), and said.
    res = ctl("allocate-io", "train", "1B/s", socket=sock)
    assert res.returncode == 0 and allocations() == {"train": 1}, res
    assert res.stdout.strip() == (
        "train: remote IO allocation 1B/s (slow: a miss of one 4.0MiB chunk waits about 48d13h)"
    ), res
    res = ctl("allocate-io", "train", "100KB/s", socket=sock)  # 42 s a chunk: not slow
    assert res.stdout.strip() == "train: remote IO allocation 100.0KB/s", res

    # --clear removes the allocation (unlimited again), persistently; the row stays.
    res = ctl("allocate-io", "train", "--clear", socket=sock)
    assert res.returncode == 0 and "removed" in res.stdout, res
    assert allocations() == {}
    job = next(j for j in node.status()["jobs"] if j["name"] == "train")
    assert job["io_allocation"] is None
    res = ctl("allocate-io", "train", "--clear", socket=sock)
    one_line_error(res, 1, "no remote io allocation")
    node.stop()
    node.start()
    assert allocations() == {}


def test_a_relative_dataset_path_is_resolved_by_the_client(make_node, tmp_path: Path) -> None:
    """The daemon runs elsewhere (its cwd is not ours): `silofs-ctl allocate-cache ./data`
    means the directory here, and the daemon refuses a relative path sent to it."""
    node: Node = make_node()
    (tmp_path / "here" / "data").mkdir(parents=True)
    here = tmp_path / "here"
    want = f"file://{tmp_path}/here/data/"
    # Not on the node yet: refused, with the absolute path in the daemon's words.
    res = ctl("allocate-cache", "./data", "1M", socket=node.socket, cwd=here)
    one_line_error(res, 1, "no dataset './data' on this node", "--create")
    assert node.request("GET", "/v1/allocations")["cache"] == {}
    res = ctl("allocate-cache", "./data", "1M", "--create", socket=node.socket, cwd=here)
    assert res.returncode == 0, res
    first, note = res.stdout.splitlines()  # the note: kept until the dataset is opened
    assert first == f"{want}: cache allocation 1.0MiB" and "not opened on this node" in note
    assert node.request("GET", "/v1/allocations")["cache"] == {want: 1 << 20}
    # Known now (it holds an allocation), by any spelling; a typo of it is not.
    res = ctl("allocate-cache", f"{here}/data/", "2M", socket=node.socket)
    assert res.returncode == 0, res
    line = one_line_error(ctl("allocate-cache", f"{here}/dta", "2M", socket=node.socket), 1)
    assert f"did you mean {want}?" in line
    assert node.request("GET", "/v1/allocations")["cache"] == {want: 2 << 20}
    res = ctl("allocate-cache", f"{here}/data/", "1.5MiB", socket=node.socket)  # whole bytes
    assert res.returncode == 0 and res.stdout.strip() == f"{want}: cache allocation 1.5MiB", res
    assert node.request("GET", "/v1/allocations")["cache"] == {want: 3 << 19}
    res = ctl("allocate-cache", f"{here}/data/", "0.5", socket=node.socket)
    one_line_error(res, 2, "SIZE", "not a whole number of bytes")
    assert node.request("GET", "/v1/allocations")["cache"] == {want: 3 << 19}
    with pytest.raises(ControlError, match="relative") as exc:  # the API itself
        node.request("POST", "/v1/datasets", {"uri": "here/data"})
    assert exc.value.status == 400


@pytest.mark.parametrize(
    "args",
    [
        ("allocate-io", "data/", "1MB/s", "--create"),
        ("allocate-io", "a b", "--clear"),
        ("job", "register", "--gpus", "1", "data/"),
        ("job", "show", "data/"),
        ("forget", "--kind", "job", "data/"),
    ],
)
def test_a_job_argument_breaking_the_grammar_names_itself(args: tuple[str, ...]) -> None:
    # Refused before any request (no daemon here): the line says which argument is
    # wrong and what a job name is, not only the rule (the daemon's 400 is the rule).
    line = one_line_error(ctl(*args, socket="/nonexistent/ctl.sock"), 2, "is not a job name")
    bad = "a b" if "a b" in args else "data/"
    assert f"JOB {bad!r} is not a job name (a job name is 1-255 bytes" in line


def test_forget_an_unknown_path_says_dataset_not_job_grammar(make_node, tmp_path: Path) -> None:
    node: Node = make_node()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_bytes(b"x")
    # `forget data/` once answered only the job grammar: data/ is no dataset on the node,
    # and could never be a job; the line says both, with the path the client resolved.
    line = one_line_error(ctl("forget", "data/", socket=node.socket, cwd=tmp_path), 1)
    assert line == (
        f"silofs-ctl: error: no dataset 'data/' ({tmp_path}/data) on this node, and "
        "'data/' is no job name (a job name is 1-255 bytes of UTF-8, printable, without "
        "whitespace, '/', '\"' or '\\')"
    )
    line = one_line_error(
        ctl("forget", "--kind", "dataset", "data/", socket=node.socket, cwd=tmp_path), 1
    )
    assert line == f"silofs-ctl: error: no dataset 'data/' ({tmp_path}/data) on this node"
    # A name that could be a job keeps the words the Slurm epilog matches as "gone".
    for args in (("nojob",), ("--kind", "job", "nojob"), ("--kind", "dataset", "nojob")):
        res = ctl("forget", *args, socket=node.socket)
        one_line_error(res, 1, "no dataset or job named 'nojob' on this node")
    # Opened, the same spelling is forgotten as the dataset it names.
    node.request("POST", "/v1/datasets", {"uri": str(tmp_path / "data")})
    res = ctl("forget", "data/", socket=node.socket, cwd=tmp_path)
    assert res.returncode == 0, res
    assert res.stdout.strip() == f"forgot dataset file://{tmp_path}/data/", res


@pytest.mark.parametrize("scheduler,cache", [("gavel", "silod"), ("fifo", "alluxio")])
def test_simulate_gives_the_same_result_whatever_the_hash_seed(scheduler: str, cache: str) -> None:
    """Two runs of one trace are the same to the last bit: no result may follow the
    order of a set of names, which moves with PYTHONHASHSEED."""
    trace = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "trace-300.toml"
    outs = []
    for seed in ("1", "2", "3"):
        res = subprocess.run(
            [sys.executable, "-m", "silofs_ctl", "simulate", str(trace)]
            + ["--scheduler", scheduler, "--cache", cache, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert res.returncode == 0, res.stderr
        outs.append(res.stdout)
    assert outs[0] == outs[1] == outs[2]
