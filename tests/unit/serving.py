"""Helpers the control-socket unit tests share: a trio server in a thread of its own.

Owns running one `serve_*` task (control/server.py: it calls task_status.started() once
listening) on its own trio loop in a thread, so a test can talk to it with the blocking
ControlClient or raw sockets, and stopping it at the end with any error it died of
raised in the test. Never decides what is served (the caller's router) and never
sleeps to synchronise (tests/support/poll.py's wait_for polls with a deadline).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

DEADLINE = 10.0


@contextmanager
def serving(serve: Callable[..., Awaitable[Any]]) -> Iterator[None]:
    """`serve` started in a trio nursery on a thread; cancelled on exit. An error it
    raised while starting (e.g. AddressInUseError) or while serving is raised here."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            state["token"] = trio.lowlevel.current_trio_token()
            state["nursery"] = nursery
            try:
                await nursery.start(serve)
            except BaseException as exc:
                state["start_error"] = exc
                raise
            finally:
                started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            state["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(DEADLINE), "server did not start"
    if "start_error" in state:
        thread.join(DEADLINE)
        raise state["start_error"]
    try:
        yield
        assert thread.is_alive(), f"server died: {state.get('error')!r}"
    finally:
        trio.from_thread.run_sync(state["nursery"].cancel_scope.cancel, trio_token=state["token"])
        thread.join(DEADLINE)
        assert not thread.is_alive()
    if "error" in state:
        raise state["error"]
