"""Supervision of the daemon's background tasks: one place that decides what a failure means.

Owns running a task so that an unexpected exception never reaches the daemon's nursery
(trio would cancel every other task and the daemon would exit 1): the failure is logged
once, as one ERROR line naming the task, the exception and where it was raised (the full
traceback goes to DEBUG; a loop failing the same way again without progress between is
a DEBUG line, with an ERROR summary every 10 minutes), then either reported to the
caller (`on_failure`: a dataset or a request marked failed) or the task is restarted
after a backoff (long-lived loops: the writer, its sync loop, the enforcer, the mount
reaper). Never swallows cancellation
(trio.Cancelled is a BaseException and passes through) and never retries a one-shot task.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Awaitable, Callable

import trio

from silofs.errors import first_leaf
from silofs.units import count

log = logging.getLogger(__name__)

RESTART_MIN = 1.0  # seconds before the first restart of a failed loop
RESTART_MAX = 60.0  # the backoff doubles up to this while the loop keeps failing
HEALTHY_AFTER = 60.0  # a loop that ran this long before failing restarts at RESTART_MIN
REPEAT_SUMMARY = 600.0  # a failure that keeps recurring: one ERROR line this often


def describe(exc: BaseException, *, where: bool = True) -> str:
    """One line: type, message and (for the log) the innermost frame that raised it; of
    an ExceptionGroup (a task's nursery reports its failed task inside one), its first
    exception's (the whole group goes to the DEBUG traceback)."""
    exc = first_leaf(exc)
    text = str(exc).splitlines()[0] if str(exc) else ""
    line = f"{type(exc).__name__}{': ' + text if text else ''}"
    tb = traceback.extract_tb(exc.__traceback__)
    if where and tb:
        line += f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})"
    return line


async def run_once(
    what: str,
    fn: Callable[..., Awaitable[object]],
    *args: object,
    on_failure: Callable[[str], None] | None = None,
) -> None:
    """Run a one-shot task; an unexpected exception is logged once and handed to
    `on_failure` (one line), never raised."""
    try:
        await fn(*args)
    except Exception as exc:
        log.error("%s failed: %s", what, describe(exc))
        log.debug("%s failed", what, exc_info=True)
        if on_failure is not None:
            on_failure(describe(exc, where=False))


async def run_forever(
    what: str,
    fn: Callable[..., Awaitable[object]],
    *args: object,
    progress: Callable[[], object] | None = None,
) -> None:
    """Run a loop that should never return; restart it (with backoff) when it fails.

    A loop that returns is done (no restart). A failure is one ERROR line; the same
    failure again, with no progress between (`progress()` unchanged: the writer's count
    of committed batches; without it, a run shorter than HEALTHY_AFTER), is a DEBUG
    line, and one ERROR line every REPEAT_SUMMARY seconds says how often it recurred:
    a disk that stays full is an ERROR line when it fills and one every 10 minutes,
    not one per restart (~60 an hour at the backoff's ceiling)."""
    delay = RESTART_MIN
    last: str | None = None  # the failure of the last ERROR line, while it recurs
    said_at = 0.0  # when that line was logged
    since = 0  # times it recurred since
    mark = progress() if progress is not None else None
    while True:
        started = trio.current_time()
        try:
            await fn(*args)
            return
        except Exception as exc:
            now = trio.current_time()
            healthy = now - started > HEALTHY_AFTER
            if healthy:
                delay = RESTART_MIN
            moved = healthy if progress is None else progress() != mark
            mark = progress() if progress is not None else None
            text = describe(exc)
            if text != last or moved:
                log.error("%s failed: %s; restarting it in %.0fs", what, text, delay)
                last, said_at, since = text, now, 0
            else:
                since += 1
                if now - said_at >= REPEAT_SUMMARY:
                    minutes = (now - said_at) / 60
                    log.error("%s still fails, %s in %.0f min: %s; restarting it in %.0fs",
                              what, count(since, "more time"), minutes, text, delay)  # fmt: skip
                    said_at, since = now, 0
                else:
                    log.debug("%s failed again: %s; restarting it in %.0fs", what, text, delay)
            log.debug("%s failed", what, exc_info=True)
        await trio.sleep(delay)
        delay = min(delay * 2, RESTART_MAX)


__all__ = ["describe", "run_forever", "run_once"]
