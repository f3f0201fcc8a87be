"""Which waiting reads mount/waits.py ends, from what /proc says of their process.

A fake /proc (status files written by the test) and trio's MockClock: the rules of the
module's docstring, one by one, and that a read it ends raises Interrupted while an
outer cancellation stays the caller's. tests/integration/test_paused_reads.py does the
same with real processes, signals and a paused job.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
import trio.testing

from silofs.control.client import ABORT_HOOK, Aborted
from silofs.mount.waits import (
    FIRST_LOOK,
    HOLDERS_EVERY,
    LOOK_EVERY,
    Interrupted,
    ProcLook,
    Waits,
    holders,
)


def bit(*sigs: int) -> int:
    return sum(1 << (s - 1) for s in sigs)


def write_status(
    proc: Path,
    pid: int,
    tgid: int | None = None,
    state: str = "D (disk sleep)",
    threads: int = 1,
    sigpnd: int = 0,
    shdpnd: int = 0,
    blocked: int = 0,
    caught: int = 0,
) -> None:
    d = proc / str(pid)
    d.mkdir(exist_ok=True)
    (d / "status").write_text(
        f"Name:\tpython\nState:\t{state}\nTgid:\t{tgid or pid}\nPid:\t{pid}\n"
        f"Threads:\t{threads}\nSigQ:\t0/63432\nSigPnd:\t{sigpnd:016x}\n"
        f"ShdPnd:\t{shdpnd:016x}\nSigBlk:\t{blocked:016x}\nSigIgn:\t{bit(13):016x}\n"
        f"SigCgt:\t{caught:016x}\n"
    )


MOUNTPOINT = "/mnt/silofs/7/ds"


def gone(proc: Path, pid: int) -> None:
    d = proc / str(pid)
    for sub in ("fd", "fdinfo"):
        for f in (d / sub).glob("*") if (d / sub).exists() else ():
            f.unlink()
        if (d / sub).exists():
            (d / sub).rmdir()
    (d / "status").unlink()
    d.rmdir()


def hold(proc: Path, pid: int, fd: int, path: str, ino: int) -> None:
    """Process `pid` holds `path` (inode `ino`) open as descriptor `fd`."""
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True, exist_ok=True)
    (d / "fdinfo").mkdir(exist_ok=True)
    (d / "fd" / str(fd)).symlink_to(path)
    (d / "fdinfo" / str(fd)).write_text(f"pos:\t0\nflags:\t0100000\nmnt_id:\t99\nino:\t{ino}\n")


async def inline(fn, *args):  # the walk on the test's loop: the mock clock stays exact
    return fn(*args)


class Reads:
    """Reads waiting in a Waits over a fake /proc, each until the test ends it."""

    def __init__(self, proc: Path) -> None:
        self.waits = Waits(str(proc), MOUNTPOINT, inline)
        self.outcome: dict[str, str] = {}

    async def start(self, nursery: trio.Nursery, name: str, opener: int, inode: int = 0) -> None:
        """A read begins; the test goes on half a look later, so that what it writes
        next is seen at a look of its own (never at the same virtual instant)."""
        nursery.start_soon(self.read, name, opener, None, inode)
        await trio.sleep(LOOK_EVERY / 2)

    async def read(
        self, name: str, opener: int, scope: trio.CancelScope | None = None, inode: int = 0
    ) -> None:
        with scope or trio.CancelScope():
            try:
                await self.waits.wait(opener, trio.sleep_forever, inode)
            except Interrupted as exc:
                self.outcome[name] = f"EINTR: {exc}"
                return
        self.outcome.setdefault(name, "cancelled by its caller")


def run(test, proc: Path) -> None:
    async def main() -> None:
        reads = Reads(proc)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reads.waits.run)
            await test(reads, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_read_of_a_process_that_dies_while_it_waits_ends(tmp_path: Path) -> None:
    write_status(tmp_path, 100)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK + 2 * LOOK_EVERY)
        assert not reads.outcome and len(reads.waits) == 1  # alive: it waits on
        gone(tmp_path, 100)
        await trio.sleep(LOOK_EVERY + 0.01)
        assert reads.outcome == {"r": "EINTR: process 100 is gone"}
        assert len(reads.waits) == 0 and reads.waits.interrupted == 1

    run(test, tmp_path)


def test_a_zombie_is_gone_unless_its_other_threads_run(tmp_path: Path) -> None:
    write_status(tmp_path, 100)
    write_status(tmp_path, 200, threads=3)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "dead", 100)
        await reads.start(nursery, "leader-exited", 200)
        await trio.sleep(FIRST_LOOK + LOOK_EVERY)
        write_status(tmp_path, 100, state="Z (zombie)")
        write_status(tmp_path, 200, state="Z (zombie)", threads=3)  # pthread_exit of main
        await trio.sleep(LOOK_EVERY + 0.01)
        assert reads.outcome == {"dead": "EINTR: process 100 is gone"}

    run(test, tmp_path)


def test_a_process_gone_before_the_first_look_is_not_the_reader(tmp_path: Path) -> None:
    # Its descriptor, inherited by another process, reads on: never EINTR for that.
    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK + 10 * LOOK_EVERY)
        assert not reads.outcome and len(reads.waits) == 1

    run(test, tmp_path)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_sigkill_pending_ends_the_read_at_the_next_look(tmp_path: Path, where: str) -> None:
    write_status(tmp_path, 100)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK + LOOK_EVERY)
        pending = {"sigpnd": bit(9)} if where == "thread" else {"shdpnd": bit(9)}
        write_status(tmp_path, 100, **pending)  # type: ignore[arg-type]
        await trio.sleep(LOOK_EVERY + 0.01)
        assert reads.outcome == {"r": "EINTR: process 100 is being killed"}

    run(test, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_a_caught_stop_signal_ends_the_read_when_seen_twice(tmp_path: Path, sig: int) -> None:
    write_status(tmp_path, 100)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK + LOOK_EVERY)
        # Pending once (on its way to a running thread): nothing.
        write_status(tmp_path, 100, shdpnd=bit(sig), caught=bit(sig))
        await trio.sleep(LOOK_EVERY)
        write_status(tmp_path, 100, caught=bit(sig))
        await trio.sleep(2 * LOOK_EVERY)
        assert not reads.outcome
        # Pending at two looks in a row: the reader waits in the kernel with it.
        write_status(tmp_path, 100, shdpnd=bit(sig), caught=bit(sig))
        await trio.sleep(2 * LOOK_EVERY + 0.01)
        name = signal.Signals(sig).name
        assert reads.outcome == {"r": f"EINTR: process 100 has {name} pending"}

    run(test, tmp_path)


@pytest.mark.parametrize(
    "status",
    [
        {"shdpnd": bit(2), "caught": bit(2), "blocked": bit(2)},  # blocked (signalfd)
        {"shdpnd": bit(17), "caught": bit(17)},  # SIGCHLD: not a stop
        {"shdpnd": bit(14), "caught": bit(14)},  # SIGALRM, a timer
        {"sigpnd": bit(10), "caught": bit(10)},  # SIGUSR1 (a scheduler's warning)
    ],
    ids=["blocked", "SIGCHLD", "SIGALRM", "SIGUSR1"],
)
def test_other_pending_signals_never_end_a_read(tmp_path: Path, status: dict) -> None:
    write_status(tmp_path, 100)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK)
        write_status(tmp_path, 100, **status)
        await trio.sleep(20 * LOOK_EVERY)
        assert not reads.outcome

    run(test, tmp_path)


def test_the_opening_thread_may_end_while_its_process_reads_on(tmp_path: Path) -> None:
    write_status(tmp_path, 100, threads=2)
    write_status(tmp_path, 101, tgid=100, threads=2)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 101)  # opened by thread 101 of process 100
        await trio.sleep(FIRST_LOOK + LOOK_EVERY)
        gone(tmp_path, 101)  # a pool thread that opened the file and ended
        await trio.sleep(4 * LOOK_EVERY)
        assert not reads.outcome  # process 100 lives: its other threads read on
        write_status(tmp_path, 100, shdpnd=bit(9))
        await trio.sleep(LOOK_EVERY + 0.01)
        assert reads.outcome == {"r": "EINTR: process 100 is being killed"}

    run(test, tmp_path)


def test_an_outer_cancel_stays_the_callers_and_no_pid_is_never_watched(tmp_path: Path) -> None:
    write_status(tmp_path, 100)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        mine = trio.CancelScope()
        nursery.start_soon(reads.read, "r", 100, mine)
        await reads.start(nursery, "no pid", 0)  # a handle with no opener: as before
        await trio.testing.wait_all_tasks_blocked()
        assert len(reads.waits) == 1  # the one without a pid costs nothing
        mine.cancel()  # e.g. the mount's SIGTERM: not an EINTR of ours
        await trio.testing.wait_all_tasks_blocked()
        assert reads.outcome == {"r": "cancelled by its caller"}
        assert len(reads.waits) == 0 and reads.waits.interrupted == 0

    run(test, tmp_path)


def test_a_read_that_returns_costs_no_look(tmp_path: Path) -> None:
    # The watcher parks with no reads waiting, and wakes for the next one.
    async def main() -> None:
        waits = Waits(str(tmp_path))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waits.run)
            for _ in range(3):
                assert await waits.wait(os.getpid(), lambda: trio.sleep(0.01)) is None
                await trio.sleep(5)
            assert len(waits) == 0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_procfs_of_this_process_parses() -> None:
    seen = ProcLook.read("/proc", os.getpid())
    assert seen is not None and seen.tgid == os.getpid() and not seen.gone
    assert ProcLook.read("/proc", 0) is None


def test_a_dying_openers_file_held_by_another_process_reads_on(tmp_path: Path) -> None:
    """A parent opened the file and handed it to a child (stdin=f): the parent's death
    is not the child's, whose read goes on; once no other process holds the file, the
    read ends (within HOLDERS_EVERY)."""
    write_status(tmp_path, 100, state="S (sleeping)")
    write_status(tmp_path, 200)
    hold(tmp_path, 100, 3, f"{MOUNTPOINT}/train/a.bin", 42)
    hold(tmp_path, 200, 0, f"{MOUNTPOINT}/train/a.bin", 42)  # the child's stdin
    hold(tmp_path, 300 - 1, 5, "/other/mount/train/a.bin", 42)  # elsewhere: not a holder
    write_status(tmp_path, 299)

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "child", 100, inode=42)
        await reads.start(nursery, "killed", 100, inode=43)  # a file nobody else holds
        await trio.sleep(FIRST_LOOK + LOOK_EVERY)
        write_status(tmp_path, 100, shdpnd=bit(9))  # the parent is being killed
        await trio.sleep(2 * LOOK_EVERY + 0.01)  # a look, the walk, the next look
        assert reads.outcome == {"killed": "EINTR: process 100 is being killed"}
        gone(tmp_path, 100)
        await trio.sleep(2 * HOLDERS_EVERY)
        assert list(reads.outcome) == ["killed"]  # the child still holds it: reads on
        # Pid 100 reused by another process, one told to stop: nothing to the child.
        write_status(tmp_path, 100, shdpnd=bit(9, 2), caught=bit(2))
        await trio.sleep(2 * HOLDERS_EVERY)
        assert list(reads.outcome) == ["killed"]
        gone(tmp_path, 200)  # the child goes too: nobody holds the file
        await trio.sleep(HOLDERS_EVERY + 2 * LOOK_EVERY)
        assert reads.outcome["child"] == "EINTR: process 100 is gone"

    run(test, tmp_path)


def test_a_stopped_opener_with_a_caught_signal_pending_is_not_the_reader(tmp_path: Path) -> None:
    """Stopped (SIGSTOP, Ctrl-Z, a debugger), a process keeps a caught SIGINT pending
    till it goes on; a reader waiting on us would be in D. Its child reads on."""
    write_status(tmp_path, 100, state="S (sleeping)")

    async def test(reads: Reads, nursery: trio.Nursery) -> None:
        await reads.start(nursery, "r", 100)
        await trio.sleep(FIRST_LOOK)
        for state in ("T (stopped)", "t (tracing stop)"):
            write_status(tmp_path, 100, state=state, shdpnd=bit(2), caught=bit(2))
            await trio.sleep(10 * LOOK_EVERY)
            assert not reads.outcome
        write_status(tmp_path, 100, shdpnd=bit(2), caught=bit(2))  # D: waiting on us
        await trio.sleep(2 * LOOK_EVERY + 0.01)
        assert reads.outcome == {"r": "EINTR: process 100 has SIGINT pending"}

    run(test, tmp_path)


def test_holders_of_files_under_a_mount(tmp_path: Path) -> None:
    hold(tmp_path, 10, 3, f"{MOUNTPOINT}/a", 5)
    hold(tmp_path, 10, 4, f"{MOUNTPOINT}/b (deleted)", 6)
    hold(tmp_path, 11, 0, f"{MOUNTPOINT}/a", 5)
    hold(tmp_path, 12, 0, f"{MOUNTPOINT}x/a", 5)  # another mount whose path begins alike
    hold(tmp_path, 12, 1, "pipe:[1234]", 5)
    (tmp_path / "13").mkdir()  # a process whose fds this one may not read
    (tmp_path / "self").mkdir()
    assert holders(str(tmp_path), MOUNTPOINT) == {5: {10, 11}, 6: {10}}
    assert holders(str(tmp_path / "nothing"), MOUNTPOINT) == {}


def test_holders_of_this_process_are_found(tmp_path: Path) -> None:
    # Real /proc: this process holds a file under tmp_path (as if it were the mount).
    with open(tmp_path / "f", "wb") as f:
        found = holders("/proc", str(tmp_path))
        assert found.get(os.fstat(f.fileno()).st_ino) == {os.getpid()}


def test_a_watched_read_is_ended_by_aborting_the_request_it_waits_on(tmp_path: Path) -> None:
    """Waits.watch, a leading miss's wait without a cancel scope: the read's request
    (here a stand-in for the client's, control/client.py) is handed to the read through
    ABORT_HOOK while it waits, and the watcher's verdict aborts it: Interrupted. One
    found dying while it waits on nothing abortable is aborted when it next asks."""
    write_status(tmp_path, 100)
    write_status(tmp_path, 200)
    outcome: dict[str, str] = {}

    async def request(wait_first: trio.Event | None = None) -> None:
        if wait_first is not None:
            await wait_first.wait()  # e.g. for a free connection slot: nothing to abort
        aborted = trio.Event()
        hook = ABORT_HOOK.get()
        assert hook is not None
        hook(aborted.set)
        try:
            await aborted.wait()
        finally:
            hook(None)
        raise Aborted("ended by its caller")

    async def read(waits: Waits, name: str, opener: int, call) -> None:
        try:
            await waits.watch(opener, call)
        except Interrupted as exc:
            outcome[name] = f"EINTR: {exc}"

    async def main() -> None:
        waits = Waits(str(tmp_path), MOUNTPOINT, inline)
        slot = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waits.run)
            nursery.start_soon(read, waits, "asking", 100, request)
            nursery.start_soon(read, waits, "queued", 200, lambda: request(slot))
            await trio.sleep(FIRST_LOOK + LOOK_EVERY / 2)
            assert not outcome and len(waits) == 2
            gone(tmp_path, 100)
            gone(tmp_path, 200)
            await trio.sleep(LOOK_EVERY)
            assert outcome == {"asking": "EINTR: process 100 is gone"}
            slot.set()  # the queued read asks now: aborted at once
            await trio.sleep(0.01)
            assert outcome["queued"] == "EINTR: process 200 is gone"
            assert len(waits) == 0 and waits.interrupted == 2
            assert ABORT_HOOK.get() is None  # the hook is the read's only
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_abort_not_of_a_watched_read_is_not_taken_for_one(tmp_path: Path) -> None:
    write_status(tmp_path, 100)

    async def call() -> None:
        raise Aborted("another caller's")

    async def main() -> None:
        waits = Waits(str(tmp_path), MOUNTPOINT, inline)
        with pytest.raises(Aborted):
            await waits.watch(100, call)
        assert waits.interrupted == 0 and len(waits) == 0

    trio.run(main)
