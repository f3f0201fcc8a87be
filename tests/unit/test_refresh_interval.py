"""The minimum interval between refreshes asked by users other than root or the
daemon's uid (node/datasets.py refresh_wait, Catalog.open_dataset; docs/SECURITY.md
"Limits"): refused with 429 and the seconds to wait, counted in status and /metrics,
the listing left as it was; root exempt; the window survives a daemon restart (the
listing's time is persisted with it). A real Daemon and router, called as a peer would
(tests/unit/test_routes_access.py); tests/integration/test_refresh_interval.py runs the
same rule as a real second user through the CLIs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

from silofs.config import NodeSettings, load_node_settings
from silofs.errors import UsageError
from silofs.node.daemon import Daemon
from silofs.node.datasets import refresh_wait
from silofs.node.metrics import render
from silofs.node.views import status_view
from tests.unit.test_routes_access import ALICE, BOB, ROOT, Call, _ready, run_routes


def test_the_rule() -> None:
    assert refresh_wait(None, 1000.0, 30) == 0  # never listed
    assert refresh_wait(990.0, 1000.0, 0) == 0  # no interval
    assert refresh_wait(990.0, 1000.0, 30) == pytest.approx(20)
    assert refresh_wait(970.0, 1000.0, 30) == 0  # exactly the interval: allowed
    assert refresh_wait(900.0, 1000.0, 30) == 0
    # A clock set back since the listing: a listing just now, never a longer wait.
    assert refresh_wait(5000.0, 1000.0, 30) == pytest.approx(30)


def test_the_setting(tmp_path: Path) -> None:
    assert NodeSettings().min_refresh_seconds == 30
    cfg = tmp_path / "s.toml"
    cfg.write_text("[limits]\nmin_refresh_seconds = 0\n")
    assert load_node_settings(str(cfg)).min_refresh_seconds == 0
    cfg.write_text("[limits]\nmin_refresh_seconds = 2.5\n")
    assert load_node_settings(str(cfg)).min_refresh_seconds == 2.5
    for bad in ("-1", "100000", '"30s"'):
        cfg.write_text(f"[limits]\nmin_refresh_seconds = {bad}\n")
        with pytest.raises(UsageError, match="min_refresh_seconds"):
            load_node_settings(str(cfg))


async def _refresh(call: Call, peer: object, uri: str) -> tuple[int, dict]:
    return await call(peer, "POST", "/v1/datasets", {"uri": uri, "refresh": True})


def test_a_user_refresh_right_after_a_listing_is_refused_and_counted(
    tmp_path: Path, world: Path
) -> None:
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, uri)
        # A first listing (a mount's) starts no window: files added, then a refresh, lists.
        (world / "data" / "b").write_bytes(b"b")
        s, body = await _refresh(call, ALICE, uri)
        assert s == 200, body
        ds = await _ready(call, ALICE, uri)
        gen = ds["generation"]
        assert ds["objects"] == 2
        (world / "data" / "c").write_bytes(b"c")  # a refresh would list it
        for peer in (ALICE, BOB):
            s, body = await _refresh(call, peer, uri)
            assert s == 429, body
            line = body["error"]
            assert "\n" not in line and "min_refresh_seconds" in line, line
            wait = int(re.search(r"try again in (\d+) s", line).group(1))  # type: ignore[union-attr]
            assert 1 <= wait <= 600
        view = (await call(ROOT, "GET", f"/v1/datasets/{ds['id']}"))[1]
        assert view["state"] == "ready" and view["generation"] == gen
        assert view["objects"] == 2 and view["refreshes_refused"] == 2
        text = render(status_view(d))
        canonical = view["uri"]
        assert f'silofs_dataset_refreshes_refused_total{{dataset="{canonical}"}} 2' in text
        # An open without refresh is never refused.
        s, body = await call(ALICE, "POST", "/v1/datasets", {"uri": uri})
        assert s == 200 and body["generation"] == gen
        # Root is exempt: it lists at once, and its listing restarts the users' window.
        s, body = await _refresh(call, ROOT, uri)
        assert s == 200, body
        view = await _ready(call, ROOT, uri)
        assert view["generation"] == gen + 1 and view["objects"] == 3
        assert (await _refresh(call, ALICE, uri))[0] == 429
        assert d.catalog.refreshes_refused[ds["id"]] == 3

    run_routes(tmp_path, test, min_refresh_seconds=600)


def test_a_user_refresh_after_the_interval_lists(tmp_path: Path, world: Path) -> None:
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")

    async def test(d: Daemon, call: Call) -> None:
        await _ready(call, ALICE, uri)
        assert (await _refresh(call, ALICE, uri))[0] == 200
        ds = await _ready(call, ALICE, uri)
        s, body = await _refresh(call, ALICE, uri)
        assert s == 429, body
        # Polled with a deadline: accepted once the interval has passed, not before.
        with trio.fail_after(10):
            while (s := (await _refresh(call, ALICE, uri))[0]) == 429:
                await trio.sleep(0.05)
        assert s == 200
        view = await _ready(call, ALICE, uri)
        assert view["generation"] == ds["generation"] + 1

    run_routes(tmp_path, test, min_refresh_seconds=0.5)


def test_no_interval_lets_users_refresh(tmp_path: Path, world: Path) -> None:
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")

    async def test(d: Daemon, call: Call) -> None:
        ds = await _ready(call, ALICE, uri)
        assert (await _refresh(call, ALICE, uri))[0] == 200
        view = await _ready(call, ALICE, uri)
        assert view["generation"] == ds["generation"] + 1 and view["refreshes_refused"] == 0

    run_routes(tmp_path, test, min_refresh_seconds=0)


def test_the_window_survives_a_daemon_restart(tmp_path: Path, world: Path) -> None:
    """The listing's time is the persisted record's: a restarted daemon, which holds no
    dataset yet, still refuses a user's refresh of one listed just before."""
    (world / "data").mkdir()
    (world / "data" / "a").write_bytes(b"a")
    uri = str(world / "data")
    gens: list[int] = []

    async def first(d: Daemon, call: Call) -> None:
        await _ready(call, ROOT, uri)
        assert (await _refresh(call, ROOT, uri))[0] == 200
        gens.append((await _ready(call, ROOT, uri))["generation"])

    async def second(d: Daemon, call: Call) -> None:
        assert not d.catalog.datasets
        s, body = await _refresh(call, ALICE, uri)
        assert s == 429 and "try again in" in body["error"], body
        view = await _ready(call, ALICE, uri)  # opens the persisted listing
        assert view["generation"] == gens[0] and view["refreshes_refused"] == 1

    run_routes(tmp_path, first, min_refresh_seconds=600)
    run_routes(tmp_path, second, min_refresh_seconds=600)


def test_a_mount_asks_a_refused_refresh_again_only_when_the_daemon_says() -> None:
    """A user's mount whose metadata TTL is below min_refresh_seconds asked at every
    report tick (4 a second), each refusal a WARNING line in its log: it now waits the
    seconds the daemon's 429 names (or a few, if the line says none)."""
    from silofs.mount.process import RELIST_RETRY_SECONDS, relist_wait

    line = (
        "file:///d/ was refreshed 3 s ago; refreshes by users other than root are at least "
        "30 s apart (min_refresh_seconds): try again in 27 s"
    )
    assert relist_wait(line) == 27.0
    assert relist_wait("too many requests") == RELIST_RETRY_SECONDS
