"""An exception nobody foresaw ends what raised it, never the mount.

pyfuse3 answers a request whose handler raised FUSEError with that errno; any other
exception leaves the request unanswered and ends pyfuse3.main(), which ends the mount
(every reader of it then gets ENOTCONN until it is remounted). The same goes for a task of
the mount's nursery (a read-ahead, the report loop). A bug that one request or one chunk
hits (a value the code did not expect, a library raising a type it was not known to
raise) must cost that request an EIO, not every reader of the mount their reads.

Owns `unforeseen` (one ERROR record naming what failed; the traceback with the first
record of each place it was raised, so a bug every read hits does not fill the log with
copies of one traceback) and `answer_eio`, the class decorator that makes every request
handler of a pyfuse3.Operations subclass answer EIO for such an exception. A handler
marked `catches_own` (the read path, where one more coroutine frame per request is
measurable: ~0.45 us a call) catches it itself and raises `eio`. Never catches BaseException (trio's
Cancelled, KeyboardInterrupt, SystemExit end what they end) and never retries anything.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import pyfuse3

log = logging.getLogger(__name__)

# Places (exception type, file, line) whose traceback was logged; a bound, not a cache:
# forgetting one costs one more traceback in the log.
MAX_PLACES = 256
_logged: set[tuple[str, str, int]] = set()
# What `unforeseen` has seen, for a test or a debugger: failures counted since start.
seen = 0

T = TypeVar("T")


def _place(exc: BaseException) -> tuple[str, str, int]:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__, "?", 0
    return type(exc).__name__, frames[-1].filename, frames[-1].lineno or 0


def unforeseen(what: str, exc: Exception) -> None:
    """Log an exception nobody foresaw in `what` (a request, a task): ERROR, with the
    traceback the first time its place is seen."""
    global seen
    seen += 1
    place = _place(exc)
    if place in _logged:
        log.error("%s failed: %s: %s (traceback logged before)", what, place[0], exc)
        return
    if len(_logged) >= MAX_PLACES:
        _logged.clear()
    _logged.add(place)
    log.error("%s failed: %s: %s", what, place[0], exc, exc_info=exc)


def eio(what: str, exc: Exception) -> pyfuse3.FUSEError:
    """The EIO answer to an exception nobody foresaw in request `what`, logged."""
    unforeseen(what, exc)
    return pyfuse3.FUSEError(errno.EIO)


def catches_own(fn: T) -> T:
    """Mark a handler that turns an unforeseen exception into EIO itself."""
    fn._catches_own = True  # type: ignore[attr-defined]
    return fn


def answer_eio(cls: type[T]) -> type[T]:
    """Class decorator: each request handler of a pyfuse3.Operations subclass answers EIO
    for an exception other than FUSEError (logged by `unforeseen`), instead of ending
    pyfuse3.main()."""
    for name, base in vars(pyfuse3.Operations).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(base):
            continue
        fn = getattr(cls, name)
        if getattr(fn, "_catches_own", False) or getattr(fn, "_answers_eio", False):
            continue
        setattr(cls, name, _wrap(name, fn))
    return cls


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def handler(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - this request's EIO, not the mount's end
            raise eio(f"FUSE {name}", exc) from None

    handler._answers_eio = True  # type: ignore[attr-defined]
    return handler
