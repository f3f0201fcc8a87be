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
are left to yield. The daemon's memory per hint stays small, and so does the pause at
the start of an epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from silofs.hints import Hinter, HintError

log = logging.getLogger(__name__)

PIECE = 16_384


class PrefetchSampler:
    """Wraps `sampler` (any iterable of dataset indices, or of lists of them); `paths`
    maps an index to its file (a sequence, or a callable), absolute or relative to
    `mountpoint`."""

    def __init__(
        self,
        sampler: Iterable[Any],
        paths: Sequence[str] | Callable[[int], str],
        mountpoint: str,
        *,
        window: int | str | None = None,
        socket: str | None = None,
        piece: int = PIECE,
        hinter: Hinter | None = None,
    ) -> None:
        if piece < 2:
            raise ValueError("piece must be at least 2 paths")
        self.sampler = sampler
        self._path = paths if callable(paths) else paths.__getitem__
        self.hinter = hinter or Hinter(mountpoint, socket=socket, window=window)
        self.piece = piece
        self.hinted = 0  # paths sent in the current epoch
        self.failed: str | None = None  # why hints stopped this epoch

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # set_epoch (DistributedSampler) and anything else the wrapped sampler offers.
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

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
        self.hinted, self.failed = 0, None
        self._send(flat, first=True)
        for item, end in zip(order, ends, strict=True):
            if (
                self.failed is None
                and self.hinted < len(flat)
                and self.hinted - end < self.piece // 2
            ):
                self._send(flat, first=False)
            yield item

    def _send(self, flat: list[int], *, first: bool) -> None:
        """Send the next piece of the order (the first one replaces the last epoch's)."""
        part = flat[self.hinted : self.hinted + self.piece]
        try:
            self.hinter.send([self._path(i) for i in part], append=not first)
        except (HintError, OSError, ValueError, IndexError, KeyError) as exc:
            self.failed = str(exc)
            log.warning("silofs: no prefetch hints this epoch: %s", exc)
            return
        self.hinted += len(part)


__all__ = ["PrefetchSampler"]
