"""Names from others printed safely: records.shown escapes every character a terminal
could act on (and nothing else), silofs-ctl's status renders every string through it,
the log formatters too, and a mount's fsname option is ASCII whatever the URI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from silofs_ctl.node_cmds import render_status

from silofs.logsetup import JsonFormatter, TextFormatter
from silofs.mount.process import fsname
from silofs.records import shown, shown_all

HOSTILE = "a\x1b[2J\x07\r\nb\t\x9b31m\x7f\u202e\u200b\udc80c"


def test_shown_escapes_every_unprintable_character_and_keeps_the_rest() -> None:
    for code in [*range(0x20), *range(0x7F, 0xA0), 0x202E, 0x2028, 0xFEFF, 0xDC80]:
        out = shown(f"x{chr(code)}y")
        assert out.isprintable() and out.startswith("x\\") and out.endswith("y"), hex(code)
    kept = "s3://bucket/données/日本語 train-1 'q' \"d\" \\"
    assert shown(kept) == kept
    assert shown(HOSTILE) == "a\\x1b[2J\\x07\\r\\nb\\t\\x9b31m\\x7f\\u202e\\u200b\\udc80c"
    assert shown_all({HOSTILE: [HOSTILE, 1, None]}) == {shown(HOSTILE): [shown(HOSTILE), 1, None]}


def test_status_rows_stay_rows_whatever_the_names() -> None:
    node = {"cached_bytes": 0, "cache_size": 1 << 30, "cache_dir": HOSTILE,
            "writer": {"error": HOSTILE}}  # fmt: skip
    ds = {"name": HOSTILE, "uri": HOSTILE, "size": 1, "objects": 1, "cached_bytes": 0,
          "cache_allocation": None, "hit_ratio": 0.0, "state": "error",
          "error": HOSTILE}  # fmt: skip
    mount = {"job": HOSTILE, "mountpoint": HOSTILE, "bytes_read": 0, "hit_ratio": 0.0,
             "remote_bytes": 0}  # fmt: skip
    clean = render_status({"node": node, "datasets": [], "jobs": [], "mounts": []})
    text = render_status({"node": node, "datasets": [ds], "jobs": [], "mounts": [mount]})
    assert all(line.isprintable() for line in text.splitlines())
    assert len(text.splitlines()) == len(clean.splitlines()) + 3  # a dataset row, its
    # error line and a mount row: no name starts a line of its own


def test_log_lines_escape_the_message_not_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "opened %s", (HOSTILE,), None)
        rec.exc_info = (type(exc), exc, exc.__traceback__)
    text = TextFormatter("%(message)s").format(rec)
    first, *rest = text.split("\n")
    assert first == f"opened {shown(HOSTILE)}" and rest and "ValueError: boom" in rest[-1]
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["message"] == f"opened {shown(HOSTILE)}"


def test_the_fsname_option_is_ascii_for_any_uri() -> None:
    name = fsname("file:///data/données,a\x9b\u202e/")
    assert name.isascii() and name.isprintable() and "," not in name
    assert name == "file:///data/donn%C3%A9es_a%C2%9B%E2%80%AE/"
    assert fsname("s3://bucket/a b/") == "s3://bucket/a b/"  # printable ASCII as it was


def test_the_controllers_log_lines_are_escaped_too() -> None:
    """silofs-ctl's own logging (the controller logs names the nodes and Slurm send)."""
    code = (
        "import logging\n"
        "from silofs_ctl.cli import main\n"
        "main.callback(verbose=0)\n"
        f"logging.getLogger('silofs_ctl.controller').warning('node said %s', {HOSTILE!r})\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    (line,) = res.stderr.splitlines()
    assert line.endswith(f"WARNING silofs_ctl.controller: node said {shown(HOSTILE)}"), line


def test_silofs_one_line_errors_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """`silofs`'s error line may quote another user's mountpoint (a daemon still in use)."""
    from silofs.cli import fail

    with pytest.raises(SystemExit):
        fail(f"1 mount(s) still use the daemon (e.g. {HOSTILE})")
    err = capsys.readouterr().err
    assert err == f"silofs: error: 1 mount(s) still use the daemon (e.g. {shown(HOSTILE)})\n"


def test_silofs_informational_lines_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """`silofs`'s other lines name the user's URI and mountpoint, and end-job's (on
    stdout) other users' mountpoints: escaped as the error lines are; a progress line's
    own carriage return is kept."""
    from silofs.cli import say

    say(f"silofs: unmounted {HOSTILE}")
    say(f"listing {HOSTILE}", back=True, nl=False)
    say(f"unmounted {HOSTILE}", err=False)
    out, err = capsys.readouterr()
    assert err == f"silofs: unmounted {shown(HOSTILE)}\n\rlisting {shown(HOSTILE)}"
    assert out == f"unmounted {shown(HOSTILE)}\n"
