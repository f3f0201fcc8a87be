"""`silofs mount` against a running daemon it did not start: the note on credentials says
which variables differ and that the user's are the ones not used (a user without any
was told its absent variables were "in your environment")."""

from __future__ import annotations

import pytest

from silofs.cli import DaemonWish, _check_daemon_fits
from silofs.config import credential_fingerprint


def test_note_says_whose_credentials_are_unused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    daemon_env = credential_fingerprint({"AWS_ACCESS_KEY_ID": "AKIA-DAEMON"})
    node = {
        "cache_dir": "/var/cache/silofs",
        "cache_size": 1 << 30,
        "credentials_env": daemon_env,
        "started_by": "service",
        "started_by_uid": 0,
    }
    _check_daemon_fits(DaemonWish("/run/silofs/control.sock"), node)
    err = capsys.readouterr().err
    assert "differ from your environment's in AWS_ACCESS_KEY_ID" in err, err
    assert "yours are not used" in err
    assert err.count("\n") == 1
