"""[cluster] in silofs.toml (silofs/config.py): what a good section gives, and one
clear line for each mistake."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from silofs.config import MemberSpec, load_node_settings, parse_cluster
from silofs.errors import UsageError

CONTROL = """
[control]
tcp_listen = "127.0.0.1:7470"
tls_cert = "/etc/silofs/pki/n0.pem"
tls_key = "/etc/silofs/pki/n0.key"
tls_client_ca = "/etc/silofs/pki/ca.pem"
"""

GOOD = """
[cluster]
name = "train-a"
address = "tls://GPU01:7470"
members = ["tls://gpu01:7470", "tls://gpu02:7470", { address = "tls://gpu03:7470", weight = 2.0 }]
peer_timeout_seconds = 1.5
peer_backoff_seconds = 0.5
peer_serve_rate = "200MB/s"
keep_peer_copies = true
"""


def load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "silofs.toml"
    path.write_text(text)
    return load_node_settings(str(path))


def test_a_good_section(tmp_path: Path) -> None:
    s = load(tmp_path, CONTROL + GOOD)
    c = s.cluster  # type: ignore[attr-defined]
    assert c.name == "train-a"
    assert c.address == "tls://gpu01:7470"  # canonical: the host lower-cased
    assert c.members == (
        MemberSpec("tls://gpu01:7470"),
        MemberSpec("tls://gpu02:7470"),
        MemberSpec("tls://gpu03:7470", 2.0),
    )
    assert (c.peer_timeout_seconds, c.peer_backoff_seconds) == (1.5, 0.5)
    assert c.peer_serve_rate == 200_000_000 and c.keep_peer_copies
    assert c.peer_floor_rate == 1 << 20  # the default
    # The file's list is as new as the file: a list pushed later wins, an edit after it
    # wins at the next start.
    assert c.version == os.stat(tmp_path / "silofs.toml").st_mtime_ns // 1000


def test_no_section_no_cluster(tmp_path: Path) -> None:
    assert load(tmp_path, CONTROL).cluster is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('members = ["tls://a:1"]', "'name' is missing"),
        ('name = "c"', "'members' is missing"),
        ('name = "c"\nmembers = []', "non-empty list"),
        ('name = "has space"\nmembers = ["tls://a:1"]', "without spaces"),
        # It travels in a header: a member could not send one ask.
        ('name = "\u96c6\u7fa4"\nmembers = ["tls://a:1"]', "ASCII"),
        ('name = "caf\u00e9"\nmembers = ["tls://a:1"]', "ASCII"),
        ('name = "c"\nmembers = ["a:1"]', "tls://HOST:PORT"),
        ('name = "c"\nmembers = ["tls://a:99999"]', "bad node address"),
        ('name = "c"\nmembers = ["tls://a b:1"]', "bad node address"),  # not a host name
        ('name = "c"\nmembers = ["tls://user@a:1"]', "bad node address"),
        ('name = "c"\nmembers = ["tls://a..b:1"]', "bad node address"),
        ('name = "c"\nmembers = ["tls://[a.b]:1"]', "bad node address"),  # brackets: IPv6
        ('name = "c"\nmembers = ["tls://[10.0.0.1]:1"]', "bad node address"),
        # tcp_listen's "every interface" copied into the list: each node itself.
        ('name = "c"\nmembers = ["tls://0.0.0.0:7470"]', "every interface"),
        ('name = "c"\nmembers = ["tls://[::]:7470"]', "every interface"),
        ('name = "c"\nmembers = ["tls://a:1", "tls://A:1"]', "listed twice"),
        # One address, two spellings; a dotted number the resolver reads its own way
        # (010.0.0.1 is 8.0.0.1 to inet_aton, 127.1 is 127.0.0.1).
        ('name = "c"\nmembers = ["tls://[::1]:1", "tls://[0:0::1]:1"]', "listed twice"),
        # An IPv6 address without brackets: fd00::1:2 is one address (port 7470) to
        # whoever wrote it, [fd00::1] port 2 when its last group is taken as the port.
        ('name = "c"\nmembers = ["tls://fd00::1:2"]', "in brackets"),
        ('name = "c"\nmembers = ["tls://::1"]', "in brackets"),
        ('name = "c"\nmembers = ["tls://[::1]:1"]\naddress = "tls://::1:1"', "in brackets"),
        ('name = "c"\nmembers = ["tls://010.0.0.1:1"]', "bad node address"),
        ('name = "c"\nmembers = ["tls://127.1:1"]', "bad node address"),
        ('name = "c"\nmembers = [{ address = "tls://a:1", weight = 0 }]', "weight"),
        ('name = "c"\nmembers = [{ address = "tls://a:1", weight = true }]', "weight"),
        ('name = "c"\nmembers = [{ addr = "tls://a:1" }]', "member table"),
        ('name = "c"\nmembers = ["tls://a:1"]\naddress = "tls://b:1"', "not one of the members"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_timeout_seconds = 0', "above 0"),
        # A read waits on a silent member at most this: a few seconds, never minutes.
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_timeout_seconds = 600', "at most 30"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_floor_rate = "1B/s"', "at least 64KiB/s"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_serve_rate = 0', "above 0"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_floor_rate = "fast"', "peer_floor_rate"),
        # As every rate people type: 100000000 was 100 MB/s here, 100 Mbit/s to a JuiceFS
        # user, 100 KiB/s to an rclone one.
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_serve_rate = 100000000', "needs a unit"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_serve_rate = 1e8', "needs a unit"),
        ('name = "c"\nmembers = ["tls://a:1"]\npeer_floor_rate = "1048576"', "needs a unit"),
        ('name = "c"\nmembers = ["tls://a:1"]\nkeep_peer_copies = "yes"', "true or false"),
        ('name = "c"\nmembers = ["tls://a:1"]\nport = 1', "unknown key 'port'"),
    ],
)
def test_mistakes_are_one_line_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        load(tmp_path, CONTROL + "[cluster]\n" + body + "\n")
    text = str(err.value)
    assert message in text and "[cluster]" in text and "\n" not in text


def test_a_cluster_needs_the_mutual_tls_listener(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"\[cluster\] needs tcp_listen, tls_cert"):
        load(tmp_path, GOOD)


def test_a_pushed_list_is_parsed_by_the_same_rules() -> None:
    c = parse_cluster({"name": "c", "members": ["tls://[FD00::1]:7470"]}, version=5)
    # ...but its JSON may carry a rate as plain bytes/s, as every control API body may.
    pushed = parse_cluster({"name": "c", "members": ["tls://a:1"], "peer_serve_rate": 10**8})
    assert pushed.peer_serve_rate == 10**8
    assert c.members == (MemberSpec("tls://[fd00::1]:7470"),) and c.version == 5
    with pytest.raises(UsageError, match="unknown key"):
        parse_cluster({"name": "c", "members": ["tls://a:1"], "versoin": 2})
