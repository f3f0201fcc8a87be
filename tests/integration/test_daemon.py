"""The daemon as systemd runs it: Type=notify readiness, and the documented config."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import stat
import subprocess
from pathlib import Path

from silofs.config import NodeSettings, load_node_settings
from silofs.control.client import ControlError
from tests.support.node import silofs_cmd
from tests.support.poll import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_daemon_tells_systemd_it_is_ready_and_stopping(tmp_path: Path) -> None:
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sd:
        sd.bind(str(notify))
        sd.settimeout(30)
        proc = subprocess.Popen(
            silofs_cmd(
                "daemon",
                "--socket",
                str(tmp_path / "ctl.sock"),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--cache-size",
                "16M",
            ),
            env={**os.environ, "NOTIFY_SOCKET": str(notify)},
            stderr=subprocess.PIPE,
        )
        try:
            assert sd.recv(256) == b"READY=1"
            assert (tmp_path / "ctl.sock").exists()  # ready means the socket answers
            proc.terminate()
            assert sd.recv(256) == b"STOPPING=1"
            wait_for(lambda: proc.poll() is not None, what="the daemon to exit")
            assert proc.returncode == 0
        finally:
            proc.kill()
            proc.wait()


def test_configs_silofs_toml_documents_every_setting_and_loads() -> None:
    path = REPO / "configs" / "silofs.toml"
    text = path.read_text()
    for f in dataclasses.fields(NodeSettings):
        assert re.search(rf"^#? ?{f.name} = ", text, re.M), f"{f.name} is not documented"
    settings = load_node_settings(str(path))
    assert settings.chunk_size == NodeSettings().chunk_size
    assert settings.max_attempts == NodeSettings().max_attempts


def test_the_socket_group_may_read_the_cache_and_others_may_not(tmp_path: Path) -> None:
    import grp
    import stat

    group = grp.getgrgid(0).gr_name
    cfg = tmp_path / "silofs.toml"
    cfg.write_text(f'[daemon]\nsocket_group = "{group}"\n')
    sock, cache = tmp_path / "ctl.sock", tmp_path / "cache"
    proc = subprocess.Popen(
        silofs_cmd(
            "daemon",
            "--config",
            str(cfg),
            "--socket",
            str(sock),
            "--cache-dir",
            str(cache),
            "--cache-size",
            "16M",
        )
    )
    try:
        wait_for(sock.exists, what="the socket")
        modes = {p: stat.S_IMODE(os.stat(cache / p).st_mode) for p in ("data.mdb", "lock.mdb")}
        assert modes == {"data.mdb": 0o640, "lock.mdb": 0o660}
        assert stat.S_IMODE(os.stat(cache).st_mode) == 0o750
        assert os.stat(cache / "lock.mdb").st_gid == 0
    finally:
        proc.terminate()
        proc.wait(15)


def test_a_removed_control_socket_is_made_again_by_the_running_daemon(
    make_node, tmp_path: Path
) -> None:
    """The socket file unlinked under a running daemon (systemd-tmpfiles ageing /tmp,
    logind removing $XDG_RUNTIME_DIR, `rm -rf /run/silofs`): before, no client could
    reach the daemon again and `silofs mount` started a second daemon at the path while
    the first went on serving its mounts. Now the daemon listens there again within
    seconds (one WARNING line); a file put in its place is left alone until removed."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(os.urandom(1 << 20))
    node = make_node(socket=str(tmp_path / "run" / "silofs" / "ctl.sock"))
    first = node.mount(str(data), tmp_path / "mnt1")
    assert (first / "a.bin").read_bytes() == (data / "a.bin").read_bytes()

    shutil.rmtree(tmp_path / "run" / "silofs")  # the directory with it
    wait_for(lambda: _answers(node), what="the daemon to listen on its socket again")
    assert stat.S_IMODE(os.stat(node.socket).st_mode) == 0o666
    second = node.mount(str(data), tmp_path / "mnt2", "--no-start-daemon")
    assert (second / "a.bin").read_bytes() == (data / "a.bin").read_bytes()
    mountpoints = {m["mountpoint"] for m in node.status()["mounts"]}
    assert mountpoints == {str(first), str(second)}  # one daemon holds both
    log_text = (node.logs / "daemon.log").read_text()
    assert log_text.count("was removed; listening on it again") == 1

    # Something else at the path: not ours to remove, said once; gone, we listen again.
    os.unlink(node.socket)
    Path(node.socket).write_text("not a socket")
    wait_for(
        lambda: "was replaced by another file" in (node.logs / "daemon.log").read_text(),
        what="the daemon to say its socket was replaced",
    )
    assert not _answers(node)
    os.unlink(node.socket)
    wait_for(lambda: _answers(node), what="the daemon to listen on its socket again")
    assert (first / "a.bin").read_bytes() == (data / "a.bin").read_bytes()


def _answers(node) -> bool:
    try:
        node.status()
        return True
    except ControlError:
        return False
