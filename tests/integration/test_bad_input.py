"""Bad input: one line on stderr naming the problem, a non-zero exit, nothing mounted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from silofs.records import job_name_error
from tests.support.fixtures import needs_fuse
from tests.support.node import REPO, Node, mounted, pids_with, silofs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    assert res.returncode != 0, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{res.stderr}"
    assert lines[0].startswith("silofs: error: "), lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]
    return lines[0]


@pytest.fixture
def node(make_node, local_store, monkeypatch) -> Node:
    local_store.apply_env(monkeypatch)
    return make_node()


def try_mount(
    node: Node, uri: str, mp: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    mp.mkdir(parents=True, exist_ok=True)
    node.mountpoints.append(str(mp))
    res = node.run("mount", uri, str(mp), "--socket", node.socket, *args, env=env)
    assert not mounted(mp)
    return res


def test_missing_local_directory(node: Node, tmp_path: Path) -> None:
    node.expect_errors(r"dataset file://.*/nope/: directory .* does not exist")
    res = try_mount(node, str(tmp_path / "nope"), tmp_path / "mnt")
    assert_one_line_error(res, "does not exist")


def test_unknown_scheme_and_bad_uri(node: Node, tmp_path: Path) -> None:
    assert_one_line_error(try_mount(node, "ftp://host/x", tmp_path / "m1"), "unknown uri scheme")
    assert_one_line_error(try_mount(node, "s3:///prefix", tmp_path / "m2"), "bucket")
    # Credentials in the URI: refused, and the secret is in no message nor in status
    # (every local user reads it).
    for uri in ("s3://AKIA:s3cr3t@bucket/", "az://s3cr3t@account/container/"):
        line = assert_one_line_error(try_mount(node, uri, tmp_path / "m3"), "no credentials")
        assert "s3cr3t" not in line
    assert "s3cr3t" not in json.dumps(node.status())


def test_missing_and_busy_mountpoint(node: Node, local_store, bucket_name, tmp_path: Path) -> None:
    local_store.create(bucket_name, {"a": b"1"})
    uri = local_store.uri(bucket_name)
    res = node.run("mount", uri, str(tmp_path / "absent"), "--socket", node.socket)
    assert_one_line_error(res, "does not exist")
    mp = node.mount(uri, tmp_path / "mnt")
    res = node.run("mount", uri, str(mp), "--socket", node.socket)
    assert_one_line_error(res, "busy")
    assert mounted(mp)


def test_s3_missing_bucket_bad_credentials_unreachable(
    make_node, s3_server, s3_auth_server, monkeypatch, bucket_name, closed_port, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, {"k": b"v"})
    node = make_node()
    node.expect_errors(r"ERROR silofs.node.datasets: dataset ")  # each bad input, once
    res = try_mount(
        node,
        f"s3://{bucket_name}-missing/",
        tmp_path / "m1",
        "--endpoint-url",
        s3_server.endpoint_url,
    )
    assert_one_line_error(res, "does not exist")
    res = try_mount(
        node,
        f"s3://{bucket_name}/no-such-prefix/",
        tmp_path / "m2",
        "--endpoint-url",
        s3_server.endpoint_url,
    )
    assert_one_line_error(res, "no-such-prefix")
    res = try_mount(
        node,
        f"s3://{bucket_name}/",
        tmp_path / "m3",
        "--endpoint-url",
        f"http://127.0.0.1:{closed_port}",
    )
    assert_one_line_error(res, f"127.0.0.1:{closed_port}")
    # A second daemon with wrong keys in its environment, against an auth-checking server.
    bad = make_node(
        env={"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong"},
        name="bad",
    )
    bad.expect_errors(r"ERROR silofs.node.datasets: dataset .*denied")
    res = try_mount(
        bad, f"s3://{bucket_name}/", tmp_path / "m4", "--endpoint-url", s3_auth_server.endpoint_url
    )
    assert_one_line_error(res, "credentials")


def test_cache_dir_not_writable_and_cache_too_large(make_node, tmp_path: Path) -> None:
    node = make_node(start=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = subprocess.run(
        silofs_cmd("daemon", "--socket", node.socket, "--cache-dir", str(blocker / "cache")),
        capture_output=True,
        text=True,
    )
    assert_one_line_error(res, "cache dir")
    res = subprocess.run(
        silofs_cmd(
            "daemon",
            "--socket",
            node.socket,
            "--cache-dir",
            node.cache_dir,
            "--cache-size",
            "1000T",
        ),
        capture_output=True,
        text=True,
    )
    assert_one_line_error(res, "larger than the space")
    assert not os.path.exists(node.socket)


def test_a_cache_dir_on_a_full_disk_is_one_line(make_node, tmp_path: Path) -> None:
    """Not one free block under the cache dir: the daemon's lock file could not take
    its pid (a traceback at start), and with the default cache size LMDB then made its
    lock.mdb through a map the disk could not back (SIGBUS: "Fatal Python error: Bus
    error"). Now one line, with the default size and with one given."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs for the cache dir")
    node = make_node(start=False)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], check=True)
    try:
        with open(disk / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError:
                pass  # full
        for size in ([], ["--cache-size", "8M"]):
            args = ["daemon", "--socket", node.socket, "--cache-dir", str(disk / "cache")]
            res = subprocess.run(silofs_cmd(*args, *size), capture_output=True, text=True)
            assert_one_line_error(res, "no room for a cache")
            assert not os.path.exists(node.socket)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_mount_reports_a_daemon_that_cannot_start(
    make_node, local_store, bucket_name, tmp_path: Path
) -> None:
    node = make_node(start=False)
    local_store.create(bucket_name, {"a": b"1"})
    res = try_mount(
        node,
        local_store.uri(bucket_name),
        tmp_path / "mnt",
        "--cache-dir",
        node.cache_dir,
        "--cache-size",
        "1000T",
    )
    assert_one_line_error(res, "larger than the space")


def test_second_daemon_on_the_same_socket(node: Node) -> None:
    res = subprocess.run(
        silofs_cmd("daemon", "--socket", node.socket, "--cache-dir", node.cache_dir + "2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_line_error(res, "already listening")
    assert node.status()["node"]["pid"] == node.proc.pid  # the first one is unharmed


def test_a_socket_path_too_long_for_unix_sockets(local_store, bucket_name, tmp_path: Path) -> None:
    """A --socket past sun_path's 107 bytes: the daemon, a mount (which would start one)
    and silofs-ctl each say so in one line, and nothing is started or mounted."""
    local_store.create(bucket_name, {"a": b"1"})
    long_dir = tmp_path / ("d" * 120)
    sock = str(long_dir / "control.sock")
    mp = tmp_path / "mnt"
    mp.mkdir()
    for args in (
        ("daemon", "--socket", sock, "--cache-dir", str(tmp_path / "c")),
        (
            "mount",
            local_store.uri(bucket_name),
            str(mp),
            "--socket",
            sock,
            "--cache-dir",
            str(tmp_path / "c"),
        ),
    ):
        res = subprocess.run(silofs_cmd(*args), capture_output=True, text=True, timeout=60)
        assert_one_line_error(res, "socket path", "at most 107")
    assert not mounted(mp)
    assert not pids_with(sock)  # no daemon left running on it
    res = subprocess.run(
        [sys.executable, "-m", "silofs_ctl", "status", "--socket", sock],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0 and res.stderr.count("\n") == 1, res.stderr
    assert "at most 107" in res.stderr


def test_a_mount_on_a_frozen_daemon_says_so_and_starts_no_other(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    local_store.create(bucket_name, {"a.bin": b"x" * 1000})
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        res = try_mount(node, local_store.uri(bucket_name), tmp_path / "mnt")
        stop = node.run("daemon", "stop", "--socket", node.socket)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    assert_one_line_error(res, node.socket, "did not answer")
    assert_one_line_error(stop, node.socket, "did not answer")  # not "no daemon answers"
    assert "--started-by auto" not in (node.logs / "daemon.log").read_text()
    assert node.status()["node"]["pid"] == node.proc.pid  # still the one daemon
    assert node.mount(local_store.uri(bucket_name), tmp_path / "mnt")  # once it answers


def test_no_start_daemon_and_the_slurm_prolog_with_the_daemon_down_start_none(
    make_node, local_store, bucket_name, tmp_path: Path
) -> None:
    """The prolog mounts with --no-start-daemon: with the node daemon down it fails the
    job on the node (exit 1) and starts no ad-hoc daemon (without the node's config) on
    the socket the node's daemon will want back."""
    node = make_node(start=False)
    local_store.create(bucket_name, {"a.bin": b"x" * 1000})
    res = try_mount(node, local_store.uri(bucket_name), tmp_path / "m0", "--no-start-daemon")
    assert_one_line_error(res, "cannot reach", "--no-start-daemon")
    assert not os.path.exists(node.socket) and not pids_with(node.socket)
    site = tmp_path / "site"
    (site / "bin").mkdir(parents=True)
    for name, module in (("silofs", "silofs"), ("silofs-ctl", "silofs_ctl")):
        tool = site / "bin" / name
        tool.write_text(f'#!/bin/sh\nexec {sys.executable} -m {module} "$@"\n')
        tool.chmod(0o755)
    for name in ("scancel", "scontrol"):  # what the prolog asks of Slurm: nothing here
        (site / "bin" / name).write_text(f"#!/bin/sh\necho {name} >> {site}/slurm-calls\n")
        (site / "bin" / name).chmod(0o755)
    (site / "mnt").mkdir()
    (site / "slurm.env").write_text(
        f"SILOFS={site}/bin/silofs\nSILOFS_CTL={site}/bin/silofs-ctl\n"
        f"SILOFS_MOUNT_ROOT={site}/mnt\nSILOFS_SLURM_LOG={site}/log\n"
        f"SILOFS_SOCKET={node.socket}\nSILOFS_MOUNT_AS=root\n"
    )
    env = {
        "PATH": f"{site}/bin:{os.environ['PATH']}",
        "PYTHONPATH": node.env["PYTHONPATH"],
        "SILOFS_LOG_DIR": str(node.logs),
        "SILOFS_SLURM_ENV": str(site / "slurm.env"),
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_COMMENT": f"silofs={local_store.uri(bucket_name)}",
    }
    res = subprocess.run(
        [str(REPO / "configs" / "slurm" / "prolog.sh")],
        env=env, cwd="/", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, (res.stdout, res.stderr)  # the node's failure: drained
    assert "cannot reach" in (site / "log").read_text()
    assert not os.path.exists(node.socket) and not pids_with(node.socket)
    assert not (site / "mnt" / "41").exists()
    calls = (site / "slurm-calls").read_text().split()  # `scontrol show job` only
    assert "scancel" not in calls  # no job cancelled for the node's fault


def test_mount_starts_a_default_daemon(make_node, local_store, bucket_name, tmp_path: Path) -> None:
    node = make_node(start=False)
    local_store.create(bucket_name, {"d/a.txt": b"hello"})
    mp = node.mount(
        local_store.uri(bucket_name),
        tmp_path / "mnt",
        "--cache-dir",
        node.cache_dir,
        "--cache-size",
        "32M",
    )
    assert (mp / "d/a.txt").read_bytes() == b"hello"
    assert node.status()["node"]["cache_size"] == 32 << 20


def test_azure_missing_container_and_expired_sas(
    make_node, azurite_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    import datetime as dt

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from tests.support.servers import AZURITE_ACCOUNT, AZURITE_KEY

    azurite_server.apply_env(monkeypatch)
    azurite_server.create(bucket_name, {"k": b"v"})
    node = make_node(env={"AZURE_STORAGE_CONNECTION_STRING": azurite_server.connection_string})
    node.expect_errors(r"ERROR silofs.node.datasets: dataset ")  # each bad input, once
    res = try_mount(node, f"az://{AZURITE_ACCOUNT}", tmp_path / "m0")
    assert_one_line_error(res, "container")
    res = try_mount(node, f"az://{AZURITE_ACCOUNT}/{bucket_name}-missing/", tmp_path / "m1")
    assert_one_line_error(res, f"{bucket_name}-missing")

    expired = generate_container_sas(
        AZURITE_ACCOUNT,
        bucket_name,
        account_key=AZURITE_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1),
    )
    bad = make_node(env={"AZURE_STORAGE_SAS_TOKEN": expired}, name="sas")
    bad.expect_errors(r"ERROR silofs.node.datasets: dataset .*denied")
    res = try_mount(
        bad,
        f"az://{AZURITE_ACCOUNT}/{bucket_name}/",
        tmp_path / "m2",
        "--endpoint-url",
        azurite_server.endpoint_url,
    )
    assert_one_line_error(res, "denied", "SAS")


def test_gcs_key_file_that_is_not_json(
    make_node, gcs_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    gcs_server.apply_env(monkeypatch)
    gcs_server.create(bucket_name, {"k": b"v"})
    key_file = tmp_path / "key.json"
    key_file.write_text("this is not json")
    node = make_node(env={"GOOGLE_APPLICATION_CREDENTIALS": str(key_file)})
    node.expect_errors(r"ERROR silofs.node.datasets: dataset ")  # each bad input, once
    res = try_mount(
        node, f"gs://{bucket_name}/", tmp_path / "m", "--endpoint-url", gcs_server.endpoint_url
    )
    assert_one_line_error(res, str(key_file))


def test_a_log_file_that_cannot_be_opened_is_one_line(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    """A log file in a directory that does not exist: the daemon said so in a traceback,
    and `silofs mount` pointed at the very file it could not write."""
    bad = str(tmp_path / "no-such-dir" / "x.log")
    res = subprocess.run(
        silofs_cmd("daemon", "--socket", str(tmp_path / "other.sock"), "--log-file", bad,
                   "--cache-dir", str(tmp_path / "other-cache")),
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert_one_line_error(res, "log_file", bad)
    local_store.create(bucket_name, {"k": b"v"})
    res = try_mount(node, local_store.uri(bucket_name), tmp_path / "m", "--log-file", bad)
    assert_one_line_error(res, "--log-file", bad)
    # And in the configuration file: the same line, naming the setting.
    config = tmp_path / "silofs.toml"
    config.write_text(f'[daemon]\nlog_file = "{bad}"\n')
    res = subprocess.run(
        silofs_cmd("daemon", "--socket", str(tmp_path / "third.sock"), "--config", str(config),
                   "--cache-dir", str(tmp_path / "third-cache")),
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert_one_line_error(res, "log_file", bad)


def test_a_busy_metrics_port_is_one_line(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        res = subprocess.run(
            silofs_cmd("daemon", "--socket", str(tmp_path / "m.sock"), "--cache-dir",
                       str(tmp_path / "cache"), "--metrics-address", f"127.0.0.1:{port}"),
            capture_output=True,
            text=True,
        )  # fmt: skip
    finally:
        busy.close()
    assert_one_line_error(res, "metrics_address", f"127.0.0.1:{port}", "in use")
    assert not (tmp_path / "m.sock").exists()


def test_a_mountpoint_that_is_not_empty_or_holds_a_mount(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    """Mounting over a directory with files in it works, as FUSE 3 and mount(8) allow,
    and says that they are hidden; unmounting a mount with another mount inside it names
    that mount as what holds it (it used to blame open files)."""
    local_store.create(bucket_name, {"sub/x": b"x", "y": b"y"})
    uri = local_store.uri(bucket_name)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("mine")
    node.mountpoints.append(str(full))
    res = node.run("mount", uri, str(full), "--socket", node.socket)
    assert res.returncode == 0, res.stderr
    assert f"mountpoint {full} is not empty" in res.stderr and "'keep'" in res.stderr
    assert (full / "y").read_bytes() == b"y" and not (full / "keep").exists()
    inner = node.mount(uri, full / "sub")  # inside the first mount
    assert (inner / "y").read_bytes() == b"y"
    res = node.run("unmount", str(full), "--socket", node.socket)
    line = assert_one_line_error(res, "busy")
    assert f"{inner} is mounted inside it" in line and "files are open" not in line
    assert mounted(full) and mounted(inner)
    for mp in (inner, full):
        res = node.run("unmount", str(mp), "--socket", node.socket)
        assert res.returncode == 0, res.stderr
    assert (full / "keep").read_text() == "mine"


def test_two_mounts_at_one_mountpoint_at_once_make_one_mount(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    """Two `silofs mount` of one dataset at one mountpoint started together (a prolog
    run twice, fstab and a hand): both passed the checks and stacked two mounts, each
    saying "mounted". The second now waits for the first and finds it busy."""
    local_store.create(bucket_name, {"a": b"1"})
    uri = local_store.uri(bucket_name)
    mp = tmp_path / "mnt"
    mp.mkdir()
    node.mountpoints.append(str(mp))
    args = silofs_cmd("mount", uri, str(mp), "--socket", node.socket)
    procs = [
        subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=node.env,
            cwd=node.root,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], results
    loser = results[[p.returncode for p in procs].index(2)][1]
    assert loser.strip().splitlines()[-1].startswith("silofs: error: mountpoint"), loser
    assert "busy" in loser
    stacked = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
               if f" {mp} " in line]  # fmt: skip
    assert len(stacked) == 1, stacked
    assert (mp / "a").read_bytes() == b"1"


def test_a_local_directory_with_a_percent_in_its_name_mounts_itself(
    node: Node, tmp_path: Path
) -> None:
    """The CLI sent the canonical URI file:///.../%41/ and the daemon decoded it again:
    the mount served the sibling directory A, without a word."""
    (tmp_path / "%41").mkdir()
    (tmp_path / "%41" / "mine").write_bytes(b"percent")
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "other").write_bytes(b"not mine")
    mp = node.mount(str(tmp_path / "%41"), tmp_path / "mnt")
    assert sorted(os.listdir(mp)) == ["mine"]
    assert (mp / "mine").read_bytes() == b"percent"
    (row,) = node.status()["datasets"]
    assert row["uri"] == f"file://{tmp_path}/%2541/"


def test_a_job_name_of_255_bytes_mounts(node: Node, local_store, bucket_name, tmp_path) -> None:
    """Job names may be 255 bytes; "mount-JOB.log" of one is 265, past NAME_MAX: the
    mount failed with "cannot write logs ...: File name too long; set SILOFS_LOG_DIR"."""
    local_store.create(bucket_name, {"a": b"1"})
    job = "j" + "é" * 127  # 255 bytes of UTF-8
    assert len(job.encode()) == 255
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "mnt", "--job", job)
    assert (mp / "a").read_bytes() == b"1"
    assert [j["name"] for j in node.status()["jobs"]] == [job]


def test_a_mountpoint_of_any_utf8_name_mounts_under_a_default_job(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    """Without --job, the job is named after the mountpoint: its name with only
    whitespace and '/' replaced kept '\\', '"', DEL and format characters, and 85
    three-byte characters made a job name of 262 bytes, so `silofs mount` at such a
    directory failed with "a job name is 1-255 bytes ...", a job nobody had named."""
    local_store.create(bucket_name, {"a": b"1"})
    names = ["back\\slash", 'quote"d', "del\x7f", "nbsp\u00a0x", "zw\u200bx", "\u65e5" * 85]
    jobs = []
    for i, name in enumerate(names):
        mp = node.mount(local_store.uri(bucket_name), tmp_path / str(i) / name)
        assert (mp / "a").read_bytes() == b"1"
        # This mount's row, by its mountpoint: the one before was unmounted, but its row
        # goes when its goodbye reaches the daemon (cut after 2 s on a busy host) or at
        # the daemon's next reap (every 2 s), not necessarily before this status.
        (m,) = [m for m in node.status()["mounts"] if m["mountpoint"] == str(mp)]
        assert job_name_error(m["job"]) is None, m["job"]
        jobs.append(m["job"])
        node.unmount(mp)
    assert len(set(jobs)) == len(names), jobs


def test_a_mode_that_is_no_permission_bits_is_refused(
    node: Node, local_store, bucket_name, tmp_path: Path
) -> None:
    """--file-mode -1 mounted, and every lookup then failed (EIO, a traceback per name
    in the mount's log: "can't convert negative value to mode_t"); 17777 set a bit of
    the file type, and every file was EIO too. Modes are 0 to 7777."""
    local_store.create(bucket_name, {"a": b"1"})
    for i, flags in enumerate(
        (["--file-mode", "-1"], ["--file-mode", "17777"], ["--dir-mode", "100555"])
    ):
        res = try_mount(node, local_store.uri(bucket_name), tmp_path / f"m{i}", *flags)
        assert_one_line_error(res, flags[0], "0 to 7777")
    mp = node.mount(local_store.uri(bucket_name), tmp_path / "ok", "--file-mode", "7777")
    assert os.stat(mp / "a").st_mode == 0o107777 and (mp / "a").read_bytes() == b"1"


def test_a_dataset_or_mountpoint_not_utf8_is_one_line(node: Node, tmp_path: Path) -> None:
    """Both failed with the daemon's "request body holds text that is not UTF-8 (a lone
    surrogate?)", which names neither."""
    raw = os.fsencode(tmp_path)
    source, mountpoint = raw + b"/data\xff", raw + b"/mnt\xff"
    os.mkdir(source)
    os.mkdir(mountpoint)
    (tmp_path / "data").mkdir()
    (tmp_path / "mnt2").mkdir()
    res = node.run("mount", os.fsdecode(source), str(tmp_path / "mnt2"), "--socket", node.socket)
    line = assert_one_line_error(res, "is not UTF-8 text: silofs names datasets in UTF-8")
    assert f"'{tmp_path}/data\\xff'" in line
    res = node.run(
        "mount", str(tmp_path / "data"), os.fsdecode(mountpoint), "--socket", node.socket
    )
    assert_one_line_error(res, f"mountpoint {tmp_path}/mnt\\xff is not UTF-8 text")
    assert node.status()["mounts"] == []
