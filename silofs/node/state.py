"""The node's state records: datasets, jobs and mounts as the daemon tracks them.

Owns the shape of per-dataset, per-job and per-mount state and the job's rate window.
Plain data with small derived figures; never does I/O and never changes allocations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from silofs.node.backends import Backend
from silofs.node.fetch import FetchCounters
from silofs.node.limiter import TokenBucket
from silofs.records import MountCounters
from silofs.uri import DatasetURI


@dataclass
class DatasetState:
    id: int
    uri: DatasetURI
    name: str
    backend: Backend
    state: str = "checking"  # checking | listing | ready | error
    error: str = ""
    listed: int = 0
    list_started: float = 0.0  # monotonic; with `listed`, the listing rate in status
    building_gen: int | None = None  # the listing generation being written, while listing
    record: dict = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)  # per-dataset store options
    endpoint_url: str | None = None  # the endpoint it was opened with (None: the default)
    reads: MountCounters = field(default_factory=MountCounters)
    fetch: FetchCounters = field(default_factory=FetchCounters)
    prepare_errors: int = 0  # checks and listings that failed (after their retries)
    # Cached chunks of versions the listing no longer names, after the last refresh:
    # the first eviction victims (WritableStore.mark_stale).
    stale_chunks: int = 0


@dataclass
class PrefetchCounters:
    """Prefetch by hint (node/prefetch.py), per hint and per job."""

    bytes: int = 0  # fetched from the store ahead of the reader
    chunks: int = 0
    hit_chunks: int = 0  # prefetched chunks the reader passed without asking the daemon
    missed_chunks: int = 0  # prefetched chunks the reader still missed (late, not admitted)


RATE_WINDOW = 5.0  # seconds over which per-job throughput is reported


@dataclass
class JobState:
    name: str
    limiter: TokenBucket
    reads: MountCounters = field(default_factory=MountCounters)
    fetch: FetchCounters = field(default_factory=FetchCounters)
    epoch: int = 0  # the highest of its per-dataset epochs
    # Per dataset: bytes the job read through its mounts, and the epoch that makes. An
    # epoch is one dataset's worth of bytes read, as the simulator and the controller
    # count it, whatever files were read (a subset, or one shard in many opens).
    dataset_bytes: dict[int, int] = field(default_factory=dict)
    epochs: dict[int, int] = field(default_factory=dict)
    # Cached bytes per dataset when the job's current epoch began: only those chunks can
    # serve hits in this epoch ("SiloD: A Co-design of Caching and Scheduling for Deep
    # Learning Clusters", EuroSys '23, §6 "Delayed effectiveness").
    epoch_cached: dict[int, int] = field(default_factory=dict)
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)
    prefetch: PrefetchCounters = field(default_factory=PrefetchCounters)

    def sample(self, now: float) -> None:
        self.samples.append((now, self.reads.bytes_read, self.fetch.remote_bytes))
        while len(self.samples) > 2 and self.samples[1][0] < now - 2 * RATE_WINDOW:
            self.samples.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(bytes read/s, remote bytes/s) over the last RATE_WINDOW seconds."""
        if not self.samples:
            return 0.0, 0.0
        base = self.samples[0]
        for sample in self.samples:
            if sample[0] <= now - RATE_WINDOW:
                base = sample
        span = max(now - base[0], 1e-3)
        return (
            (self.reads.bytes_read - base[1]) / span,
            (self.fetch.remote_bytes - base[2]) / span,
        )


# How long a mount's older generation stays the one kept after a report says a newer
# one (MountState.said_gen): longer than the period its processes report in (1 s).
GEN_SETTLE_SECONDS = 2.5


@dataclass
class MountState:
    id: str
    job: str
    dsid: int
    mountpoint: str
    pid: int
    uid: int
    chunk_size: int
    reported: MountCounters = field(default_factory=MountCounters)
    # Registered again after a daemon restart: its first report is its counts since it
    # started, most of them counted by the daemon before (Daemon.report).
    rejoined: bool = False
    fetch: FetchCounters = field(default_factory=FetchCounters)
    # The listing generation the mount said (in its last report) it serves, and when
    # (monotonic): a new listing keeps it (node/datasets.py served_generations). None:
    # not said yet (or a mount from before mounts said it).
    gen: int | None = None
    gen_seen: float = 0.0
    # With serving processes: the generations the mount's open handles were opened in
    # (another process reads a handle's entry from its own: mount/fs.py _adopt), as its
    # last report said them, and when; kept by a new listing as `gen` is.
    held: frozenset[int] = frozenset()
    held_seen: float = 0.0

    def said_gen(self, gen: int, now: float) -> None:
        """A report says the mount serves listing generation `gen`. The mount's serving
        processes (--serve-processes) each report, under one id, and move to a new
        generation each at its own look at the record: a newer generation replaces the
        one kept only once no report has said that one for GEN_SETTLE_SECONDS (each
        process reports at least once a second), so the oldest any process serves is
        the one kept."""
        if self.gen is None or gen <= self.gen or now - self.gen_seen > GEN_SETTLE_SECONDS:
            self.gen = gen
            self.gen_seen = now
