"""A dataset listed with content ids of a form its backend no longer makes is listed
again when the daemon opens it (node/datasets.py `_prepare_dataset`), once: Azure's ids
gained the blob's scope (backends/azurelist.py blob_scope), and a listing of the older
form would keep caching bytes under ids another blob can claim. In-process, a local
directory standing in for the store whose form changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from silofs.node.backends.local import LocalBackend
from silofs.node.daemon import Daemon
from tests.unit.inprocess import ready, running, settings


def _open(tmp_path: Path, bucket: Path) -> dict:
    d = Daemon(settings(tmp_path))
    try:

        async def main() -> dict:
            async with running(d):
                ds = await ready(d, f"file://{bucket}/")
                assert ds.state == "ready", ds.error
                return d.store.dataset_record(ds.id)

        return trio.run(main)
    finally:
        d.store.close()
        os.close(d.lock_fd)


def test_a_listing_of_an_older_content_id_form_is_listed_again_once(
    tmp_path: Path, bucket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _open(tmp_path, bucket)
    assert first["content_ids"] == 1
    assert _open(tmp_path, bucket)["gen"] == first["gen"]  # the same form: kept
    monkeypatch.setattr(LocalBackend, "content_ids", 2, raising=False)
    again = _open(tmp_path, bucket)
    assert again["gen"] == first["gen"] + 1 and again["content_ids"] == 2
    assert not again["refreshed"]  # not a user's refresh: it starts no refresh window
    assert _open(tmp_path, bucket)["gen"] == again["gen"]
