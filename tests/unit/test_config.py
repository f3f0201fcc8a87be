"""Node settings from a TOML file and flags (silofs/config.py).

Owns the config grammar's edges: the documented example loads, unknown or misplaced
sections and keys are UsageErrors that name them, sizes are parsed with the size
grammar, values of the wrong type or out of range are one-line UsageErrors naming the
key (never a TypeError later in the daemon), and flags win over the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from silofs.config import MountSettings, NodeSettings, load_node_settings
from silofs.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "silofs.toml"
    p.write_text(text)
    return str(p)


def load(tmp_path: Path, text: str, **overrides: object) -> NodeSettings:
    return load_node_settings(write(tmp_path, text), **overrides)


def usage_error(tmp_path: Path, text: str, **overrides: object) -> str:
    with pytest.raises(UsageError) as exc:
        load(tmp_path, text, **overrides)
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_no_file_gives_defaults() -> None:
    s = load_node_settings(None)
    assert s == NodeSettings()
    assert s.chunk_size == 4 << 20 and s.socket_mode == 0o666 and s.cache_size is None


def test_the_documented_example_loads() -> None:
    s = load_node_settings(str(REPO / "configs" / "silofs.toml"))
    assert s.chunk_size == 4 << 20
    assert s.writer_batch_bytes == 32 << 20
    assert s.admission_queue_bytes == 256 << 20
    assert s.socket_mode == 0o666
    assert s.max_attempts == 5


def test_sizes_are_parsed(tmp_path: Path) -> None:
    s = load(
        tmp_path,
        """
[daemon]
cache_size = "1.5GiB"
chunk_size = "1M"
writer_batch_bytes = "10MB"
admission_queue_bytes = 67108864
""",
    )
    assert s.cache_size == 3 << 29
    assert s.chunk_size == 1 << 20
    assert s.writer_batch_bytes == 10**7
    assert s.admission_queue_bytes == 64 << 20


def test_all_keys_in_their_sections(tmp_path: Path) -> None:
    s = load(
        tmp_path,
        """
[daemon]
socket = "/tmp/x.sock"
socket_mode = "0660"
socket_group = "silofs"
admin_group = "wheel"
cache_dir = "/tmp/cache"
fetch_threads = 4
writer_batch_seconds = 0.1
sync_seconds = 2
log_level = "debug"
log_file = "/tmp/log"

[backend]
endpoint_url = "http://127.0.0.1:9000"
connect_timeout = 3
read_timeout = 4.5
max_attempts = 2
read_deadline = 20
page_size = 10
backend_extra = { region = "eu-west-1", retries = 3 }
""",
    )
    assert s.socket == "/tmp/x.sock" and s.socket_mode == 0o660
    assert (s.socket_group, s.admin_group, s.cache_dir) == ("silofs", "wheel", "/tmp/cache")
    assert (s.fetch_threads, s.writer_batch_seconds, s.sync_seconds) == (4, 0.1, 2.0)
    assert isinstance(s.sync_seconds, float) and isinstance(s.connect_timeout, float)
    assert (s.log_level, s.log_file) == ("debug", "/tmp/log")
    assert s.endpoint_url == "http://127.0.0.1:9000"
    assert (s.connect_timeout, s.read_timeout, s.max_attempts, s.page_size) == (3.0, 4.5, 2, 10)
    assert s.read_deadline == 20.0
    assert s.backend_extra == {"region": "eu-west-1", "retries": "3"}


def test_unknown_section_is_named(tmp_path: Path) -> None:
    msg = usage_error(tmp_path, "[deamon]\nchunk_size = '4M'\n")
    assert "[deamon]" in msg and "silofs.toml" in msg


def test_unknown_key_is_named(tmp_path: Path) -> None:
    msg = usage_error(tmp_path, "[daemon]\ncache_sise = '4G'\n")
    assert "cache_sise" in msg and "[daemon]" in msg


def test_key_in_the_wrong_section_is_named(tmp_path: Path) -> None:
    msg = usage_error(tmp_path, "[backend]\ncache_size = '4G'\n")
    assert "cache_size" in msg and "[daemon]" in msg
    msg = usage_error(tmp_path, "[daemon]\nendpoint_url = 'http://x'\n")
    assert "endpoint_url" in msg and "[backend]" in msg


def test_key_outside_a_section_is_named(tmp_path: Path) -> None:
    msg = usage_error(tmp_path, "chunk_size = '4M'\n")
    assert "chunk_size" in msg and "[daemon]" in msg


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nchunk_size = '4 lots'\n", "chunk_size"),
        ("[daemon]\ncache_size = '-1G'\n", "cache_size"),
        ("[daemon]\ncache_size = true\n", "cache_size"),
        ("[daemon]\nfetch_threads = '16'\n", "fetch_threads"),
        ("[daemon]\nfetch_threads = 1.5\n", "fetch_threads"),
        ("[daemon]\nfetch_threads = true\n", "fetch_threads"),
        ("[daemon]\nsync_seconds = 'often'\n", "sync_seconds"),
        ("[daemon]\nlog_level = 3\n", "log_level"),
        ("[daemon]\nlog_level = 'loud'\n", "log_level"),
        ("[daemon]\nsocket = 5\n", "socket"),
        ("[daemon]\ncache_dir = ['a']\n", "cache_dir"),
        ("[backend]\nmax_attempts = '5'\n", "max_attempts"),
        ("[backend]\nbackend_extra = 'region=x'\n", "backend_extra"),
        ("[backend]\nbackend_extra = { nested = { a = 1 } }\n", "backend_extra"),
    ],
)
def test_bad_values_name_their_key(tmp_path: Path, text: str, key: str) -> None:
    assert key in usage_error(tmp_path, text)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nchunk_size = '1K'\n", "chunk_size"),
        ("[daemon]\nchunk_size = '128M'\n", "chunk_size"),
        ("[daemon]\ncache_size = '1M'\n", "cache_size"),
        ("[daemon]\nfetch_threads = 0\n", "fetch_threads"),
        ("[daemon]\nsync_seconds = 0\n", "sync_seconds"),
        ("[daemon]\nwriter_batch_seconds = -1\n", "writer_batch_seconds"),
        ("[daemon]\nadmission_queue_bytes = '1M'\n", "admission_queue_bytes"),
        ("[backend]\nmax_attempts = 0\n", "max_attempts"),
        ("[backend]\npage_size = 0\n", "page_size"),
        ("[backend]\nconnect_timeout = 0\n", "connect_timeout"),
        ("[backend]\nread_timeout = -5\n", "read_timeout"),
        ("[backend]\nread_deadline = 0\n", "read_deadline"),
        # TOML's nan and inf are floats: a sleep of nan failed the sync loop for good.
        ("[daemon]\nsync_seconds = nan\n", "sync_seconds"),
        ("[daemon]\nwriter_batch_seconds = nan\n", "writer_batch_seconds"),
        ("[daemon]\nidle_exit_seconds = inf\n", "idle_exit_seconds"),
        ("[backend]\nconnect_timeout = nan\n", "connect_timeout"),
        ("[backend]\nread_timeout = inf\n", "read_timeout"),
        ("[control]\ntls_handshakes_per_second = inf\n", "tls_handshakes_per_second"),
    ],
)
def test_out_of_range_values(tmp_path: Path, text: str, key: str) -> None:
    assert key in usage_error(tmp_path, text)


@pytest.mark.parametrize(
    ("value", "mode"),
    [('"0660"', 0o660), ('"660"', 0o660), ('"0o600"', 0o600), ("0o640", 0o640), ('"0"', 0)],
)
def test_socket_mode(tmp_path: Path, value: str, mode: int) -> None:
    assert load(tmp_path, f"[daemon]\nsocket_mode = {value}\n").socket_mode == mode


@pytest.mark.parametrize(
    "value",
    ['"0999"', '"rw-rw----"', '""', '"-660"', '"7777"', "660", "-1", "true", "6.6"],
)
def test_bad_octal_mode(tmp_path: Path, value: str) -> None:
    msg = usage_error(tmp_path, f"[daemon]\nsocket_mode = {value}\n")
    assert "socket_mode" in msg


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    s = load(
        tmp_path,
        "[daemon]\nchunk_size = '1M'\ncache_dir = '/a'\n",
        chunk_size="2M",
        cache_dir=None,
        cache_size=8 << 30,
    )
    assert s.chunk_size == 2 << 20
    assert s.cache_dir == "/a"  # None means "not given"
    assert s.cache_size == 8 << 30


def test_overrides_are_validated_too() -> None:
    with pytest.raises(UsageError, match="chunk_size"):
        load_node_settings(None, chunk_size="1K")


def test_missing_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_node_settings(str(tmp_path / "nope.toml"))
    with pytest.raises(UsageError, match="silofs.toml"):
        load(tmp_path, "[daemon\n")
    with pytest.raises(UsageError) as exc:
        load_node_settings(str(tmp_path))  # a directory
    assert str(tmp_path) in str(exc.value)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[daemon]\nlog_file = '\xe9'\n")
    with pytest.raises(UsageError, match="latin1.toml"):
        load_node_settings(str(bad))


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-1", ""])
def test_a_bad_daemon_timeout_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SILOFS_DAEMON_TIMEOUT", value)
    with pytest.raises(UsageError, match="SILOFS_DAEMON_TIMEOUT"):
        MountSettings(uri="file:///x", mountpoint="/x", job="j")
