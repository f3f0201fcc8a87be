"""PrefetchSampler: a sampler wrapper that tells silofs each epoch's reading order.

Owns turning a sampler's order (indices) into file paths and sending them to the node
daemon before and while the epoch is read (silofs/hints.py), so the daemon fetches
misses ahead of the DataLoader's workers (node/prefetch.py). Works with any iterable
of indices (a torch Sampler, a BatchSampler, a plain list or range) and never imports
torch: a DataLoader takes any iterable with a length as its sampler. Never changes the
order, never reads files, and never fails an epoch because a hint could not be sent
(a hint is advice: one warning per epoch, then the epoch runs without).

    from silofs.torch import PrefetchSampler
    sampler = PrefetchSampler(RandomSampler(ds), [p for p, _ in ds.samples], "/mnt/imagenet")
    loader = DataLoader(ds, sampler=sampler, num_workers=4)

The order is sent in pieces (`piece` paths, 16,384 by default): the first when the
epoch's iteration starts, the next whenever fewer than half a piece of the sent paths
are left to yield, from a thread of the sampler's own (the training loop never waits on
the daemon). The daemon's memory per hint stays small.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from silofs.hints import Hinter, HintError

log = logging.getLogger(__name__)

PIECE = 16_384


class PrefetchSampler:
    """Wraps `sampler` (any iterable of dataset indices, or of lists of them); `paths`
    maps an index to its file (a sequence, or a callable), absolute or relative to
    `mountpoint`. `background` (default) sends from one thread of its own, so a slow or
    frozen daemon never holds up the training loop; `flush()` waits for what is queued."""

    def __init__(
        self,
        sampler: Iterable[Any],
        paths: Sequence[str | os.PathLike[str]] | Callable[[int], str | os.PathLike[str]],
        mountpoint: str,
        *,
        window: int | str | None = None,
        socket: str | None = None,
        piece: int = PIECE,
        background: bool = True,
        hinter: Hinter | None = None,
    ) -> None:
        if piece < 2:
            raise ValueError("piece must be at least 2 paths")
        self.sampler = sampler
        self._path = paths if callable(paths) else paths.__getitem__
        self.hinter = hinter or Hinter(mountpoint, socket=socket, window=window, timeout=10)
        self.piece = piece
        self.background = background
        self.queued = 0  # paths of the current epoch handed to the sender
        self.sent = 0  # of those, accepted by the daemon
        self.failed: str | None = None  # why hints stopped this epoch
        self._epoch = 0
        self._sender: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # set_epoch (DistributedSampler) and anything else the wrapped sampler offers.
        if name in ("sampler", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_sender"] = None  # a thread pool does not pickle; a copy makes its own
        return state

    def __iter__(self) -> Iterator[Any]:
        order = list(self.sampler)  # the epoch's order: what a hint is about
        flat: list[int] = []
        ends: list[int] = []  # per item of `order`, the end of its indices in `flat`
        for item in order:
            if isinstance(item, list | tuple):
                flat.extend(int(i) for i in item)
            else:
                flat.append(int(item))
            ends.append(len(flat))
        self._epoch += 1  # pieces of an earlier epoch still queued are not sent
        self.queued, self.sent, self.failed = 0, 0, None
        self._queue(flat, first=True)
        for item, end in zip(order, ends, strict=True):
            # The next piece once less than half a piece of the queued order is left.
            if (
                self.failed is None
                and self.queued < len(flat)
                and self.queued - end < self.piece // 2
            ):
                self._queue(flat, first=False)
            yield item

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the pieces queued so far were sent (or given up)."""
        if self._sender is not None:
            self._sender.submit(lambda: None).result(timeout)

    def _queue(self, flat: list[int], *, first: bool) -> None:
        """Hand the next piece of the order to the sender (the first one replaces the
        last epoch's hint)."""
        part = flat[self.queued : self.queued + self.piece]
        self.queued += len(part)
        try:
            paths = [self._path(i) for i in part]
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            self._give_up(f"no path for an index of the order: {exc!r}")
            return
        if not self.background:
            self._send(paths, first, self._epoch)
            return
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="silofs-hints")
        self._sender.submit(self._send, paths, first, self._epoch)

    def _send(self, paths: list[str | os.PathLike[str]], first: bool, epoch: int) -> None:
        if epoch != self._epoch or self.failed is not None:
            return  # a newer epoch began, or this one gave up
        try:
            self.hinter.send(paths, append=not first)
        except (HintError, OSError, ValueError) as exc:
            if epoch == self._epoch:
                self._give_up(str(exc))
            return
        if epoch == self._epoch:
            self.sent += len(paths)

    def _give_up(self, why: str) -> None:
        self.failed = why
        log.warning("silofs: no prefetch hints this epoch: %s", why)


__all__ = ["PrefetchSampler"]
