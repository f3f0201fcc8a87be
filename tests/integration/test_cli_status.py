"""Status that explains itself: where bytes came from, the page-cache note, dataset
errors, `silofs-ctl forget`, and df on a mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.support.fixtures import needs_fuse
from tests.support.node import Node, drop_file_cache
from tests.support.poll import wait_for

pytestmark = [needs_fuse, pytest.mark.fuse]


def ctl(node: Node, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silofs_ctl", *args, "--socket", node.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env=node.env,
    )


def read_all(mp: Path, names: list[str]) -> int:
    total = 0
    for name in names:
        with open(mp / name, "rb") as f:
            while chunk := f.read(256 << 10):
                total += len(chunk)
        drop_file_cache(mp / name)
    return total


def test_served_bytes_df_and_the_note(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    local_store.apply_env(monkeypatch)
    objects = {"big.bin": os.urandom(3 << 20), "small.bin": os.urandom(100_000)}
    size = sum(map(len, objects.values()))
    local_store.create(bucket_name, objects)
    node: Node = make_node()
    uri = local_store.uri(bucket_name)
    mp = node.mount(uri, tmp_path / "mnt", "--job", "train")
    st = os.statvfs(mp)
    assert st.f_blocks * st.f_frsize >= size and st.f_bfree == st.f_blocks  # nothing cached

    assert read_all(mp, list(objects)) == size
    m = node.settle(str(mp), size)
    served = m["served_bytes"]
    assert sum(served.values()) == m["bytes_read"] == size
    # The first pass came from the store: each object's first kernel request waited for a
    # GET. The 3 MiB object's later requests were served without one: from the chunk the
    # mount had just fetched (its buffer) or, once the writer had admitted that chunk
    # (a loaded host lets it win the race against the reader's next request), from the
    # cache. Which of the two is timing; that none is a store byte is not.
    assert 0 < served["store"] < size
    assert served["buffer"] + served["cache"] == size - served["store"] > 0

    wait_for(lambda: node.status()["datasets"][0]["cached_bytes"] == size, what="admission")
    read_all(mp, list(objects))
    m = node.settle(str(mp), 2 * size)
    # Second pass: all from the cache, nothing new from the store or the buffer. The
    # kernel may ask for a few pages twice, so the cache figure is at least the dataset.
    assert m["served_bytes"]["store"] == served["store"]
    assert m["served_bytes"]["buffer"] == served["buffer"]
    assert size <= m["served_bytes"]["cache"] - served["cache"] < size + (1 << 20)
    assert sum(m["served_bytes"].values()) == m["bytes_read"]
    st = os.statvfs(mp)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert size <= used < size + 2 * 4096 and st.f_bfree < st.f_blocks  # df: cached = used

    res = ctl(node, "status")
    assert res.returncode == 0, res.stderr
    assert "from cache" in res.stdout and "from store" in res.stdout
    assert "kernel page cache" in res.stdout
    assert "started by manual" in res.stdout


def test_dataset_errors_show_and_forget_removes_rows(
    make_node, local_store, bucket_name, tmp_path: Path, monkeypatch
) -> None:
    local_store.apply_env(monkeypatch)
    local_store.create(bucket_name, {"a.txt": b"1"})
    node: Node = make_node()
    node.expect_errors(r"empty-dir/ has no objects")
    uri = local_store.uri(bucket_name)
    broken = str(tmp_path / "empty-dir")
    os.mkdir(broken)
    mp0 = tmp_path / "m0"
    mp0.mkdir()
    node.mountpoints.append(str(mp0))
    assert node.run("mount", broken, str(mp0)).returncode != 0
    res = ctl(node, "status")
    assert "empty-dir: error: " in res.stdout and "has no objects" in res.stdout, res.stdout
    res = ctl(node, "forget", f"file://{broken}/")
    assert res.returncode == 0 and res.stdout.strip() == f"forgot dataset file://{broken}/"
    assert all(d["uri"] != f"file://{broken}/" for d in node.status()["datasets"])

    # A mistyped job allocation is refused; one forced through, then forgotten.
    assert ctl(node, "allocate-io", "trian", "10MB/s").returncode == 1
    assert ctl(node, "allocate-io", "trian", "10MB/s", "--create").returncode == 0
    assert "trian" in node.request("GET", "/v1/allocations")["io"]
    res = ctl(node, "forget", "trian")
    assert res.returncode == 0 and res.stdout.strip() == "forgot job trian", res
    assert "trian" not in node.request("GET", "/v1/allocations")["io"]
    assert all(j["name"] != "trian" for j in node.status()["jobs"])

    # Not while mounted; a dataset allocation goes with its row.
    node.request("PUT", f"/v1/datasets/{quote(uri, safe='')}/cache", {"bytes": "1M"})
    mp = node.mount(uri, tmp_path / "mnt", "--job", "train")
    res = ctl(node, "forget", "train")
    assert res.returncode != 0 and f"{mp} still uses it" in res.stderr
    assert node.run("unmount", str(mp)).returncode == 0
    assert ctl(node, "forget", uri).returncode == 0
    assert uri not in node.request("GET", "/v1/allocations")["cache"]
    res = ctl(node, "forget", "no-such-thing")
    assert res.returncode != 0 and "no dataset or job named 'no-such-thing'" in res.stderr


def _unprintable(text: str) -> set[str]:
    """The characters of `text` a terminal could act on, but the lines' own newlines."""
    return {c for line in text.split("\n") for c in line if not c.isprintable()}


def test_names_with_control_characters_print_as_escapes(make_node, tmp_path: Path) -> None:
    """A dataset directory whose name holds a C1 CSI (U+009B, which a UTF-8 xterm takes
    as ESC [) and a bidi override, mounted at a mountpoint whose name holds ESC, BEL and
    a newline (anyone may name a directory so): `silofs-ctl status` prints each as its
    escape, on the row it belongs to, and the daemon's log holds none of them raw."""
    data = tmp_path / "data\x9b2J\u202eevil"
    data.mkdir()
    (data / "a.bin").write_bytes(b"x" * 1000)
    node: Node = make_node()
    mp = node.mount(str(data), tmp_path / "mnt\x1b]0;owned\x07\nfake row", "--job", "train")
    assert (mp / "a.bin").read_bytes() == b"x" * 1000
    res = ctl(node, "status")
    assert res.returncode == 0, res.stderr
    assert _unprintable(res.stdout) == set(), res.stdout
    assert "\\x9b2J\\u202eevil" in res.stdout and "mnt\\x1b]0;owned\\x07\\nfake row" in res.stdout
    mounts = res.stdout.split("mounts:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(mounts) == 2 and mounts[1].startswith("train "), mounts  # header and one row
    res = ctl(node, "allocate-cache", f"file://{data}/", "1M")
    assert res.returncode == 0 and _unprintable(res.stdout) == set(), res
    assert "\\u202e" in res.stdout
    # A JSON answer keeps the names exact (json.dumps writes them as \u escapes).
    got = json.loads(ctl(node, "status", "--json").stdout)
    assert got["mounts"][0]["mountpoint"] == str(mp)
    log = "".join(p.read_text(errors="replace") for p in node.logs.iterdir())
    assert "\u202e" not in log and "\x1b" not in log and "\x9b" not in log
    assert "\\u202e" in log  # the dataset was logged (opened, listed), escaped
    node.unmount(mp)


def test_an_allocation_for_a_dataset_not_opened_shows_and_forget_drops_it(make_node) -> None:
    """`allocate-cache --create` (or a controller's push) for a dataset no mount opened
    yet is kept and counts in the cache's sum: status shows it (a refused allocation
    named a total no row added up to), and `forget URI` drops it (it answered "no
    dataset", so only `allocate-cache URI none` undid a mistyped URI)."""
    node: Node = make_node()
    cache = node.status()["node"]["cache_size"]
    assert ctl(node, "allocate-cache", "s3://nob/typo", "1M").returncode == 1
    res = ctl(node, "allocate-cache", "s3://nob/typo", "1M", "--create")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "s3://nob/typo/: cache allocation 1.0MiB",
        "  not opened on this node yet: kept for it, and counted in the cache's sum now "
        "(status lists it; `silofs-ctl forget` drops it)",
    ]
    # admission too: an unknown URI is refused (it was kept, for a dataset that may
    # never come), unless --create; then the URI is known, as an allocation makes it.
    res = ctl(node, "admission", "s3://nob/later", "lru")
    assert res.returncode == 1 and "no dataset 's3://nob/later' on this node" in res.stderr
    assert "--create" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert node.request("GET", "/v1/allocations")["admission"] == {}
    res = ctl(node, "admission", "s3://nob/later", "uniform", "--create")
    assert res.returncode == 0 and res.stdout.splitlines() == [
        "s3://nob/later/: admission uniform",
        "  not opened on this node yet: kept for it (status lists it; `silofs-ctl forget` "
        "drops it)",
    ], res
    assert ctl(node, "admission", "s3://nob/later", "lru").returncode == 0
    res = ctl(node, "admission", "s3://nob/latr", "lru")
    assert res.returncode == 1 and "did you mean s3://nob/later/?" in res.stderr, res.stderr
    assert ctl(node, "allocate-cache", "s3://nob/big", str(cache), "--create").returncode == 1

    waiting = node.status()["waiting_allocations"]
    assert waiting == {
        "cache": {"s3://nob/typo/": 1 << 20},
        "admission": {"s3://nob/later/": "lru"},
    }
    text = ctl(node, "status").stdout
    assert "s3://nob/typo/: not opened on this node; kept for it: cache allocation 1.0MiB" in text
    assert "s3://nob/later/: not opened on this node; kept for it: admission lru" in text
    as_json = json.loads(ctl(node, "status", "--json").stdout)
    assert as_json["waiting_allocations"] == waiting

    res = ctl(node, "forget", "s3://nob/typo")
    assert res.returncode == 0 and res.stdout.strip() == "forgot dataset s3://nob/typo/", res
    assert ctl(node, "forget", "s3://nob/later").returncode == 0
    assert node.request("GET", "/v1/allocations")["cache"] == {}
    assert node.status()["waiting_allocations"] == {"cache": {}, "admission": {}}
    # The whole cache is free for one dataset again; a second forget finds nothing.
    assert ctl(node, "allocate-cache", "s3://nob/big", str(cache), "--create").returncode == 0
    res = ctl(node, "forget", "s3://nob/typo")
    assert res.returncode == 1 and "no dataset 's3://nob/typo'" in res.stderr


def test_an_endpoint_with_credentials_is_refused_and_never_shown(
    make_node, tmp_path: Path, monkeypatch
) -> None:
    """`silofs mount --endpoint-url http://KEY:SECRET@host` (or AWS_ENDPOINT_URL so) was
    taken: the store's error repeated the URL in the dataset's status (every local user
    reads it), every retry's log line and the mount's error. Now the CLI and the daemon
    (a client's open request) refuse it in one line that does not repeat it."""
    from silofs.control.client import ControlError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    node: Node = make_node()
    secret = "http://AKIAKEY:SUPERSECRET@127.0.0.1:1"
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = node.run("mount", "s3://bkt/x", str(mp), "--endpoint-url", secret)
    assert res.returncode == 2 and "holds no credentials" in res.stderr, res.stderr
    assert "SUPERSECRET" not in res.stderr + res.stdout
    with pytest.raises(ControlError) as exc:
        node.request("POST", "/v1/datasets", {"uri": "s3://bkt/y", "endpoint_url": secret})
    assert exc.value.status == 400 and "SUPERSECRET" not in str(exc.value)
    assert "SUPERSECRET" not in json.dumps(node.status())
    assert all("SUPERSECRET" not in p.read_text() for p in node.logs.iterdir())
