"""mount/shared.py: the tables several serving processes of one mount share.

Owns: a file handle names its slot's inode, generation, version and opener from any
process (forked here, as the serving processes are); a slot reused after RELEASE gives a new
handle and the old one names nothing; each process allocates in its own part, then in
the overflow part, one process at a time; the
reported counters are the sum of the processes' rows; a readdir position is shared; the
versions table (an inode per version's numbers, mount/fs.py _retire) is one table for
every process, changed under its lock, its sequence number moved on by each change.
"""

from __future__ import annotations

import os

import pytest

from silofs.mount.shared import (
    DIR_SLOTS,
    FILE_SLOTS,
    FRESH,
    RETIRED,
    VERSION_ROWS,
    SharedTables,
    TableFull,
    VersionsFull,
    version_hash,
)
from silofs.records import MountCounters


def test_a_handle_is_self_describing_across_a_fork() -> None:
    t = SharedTables(2)
    fh = t.open_file(123, 7, version_hash("v1", "c1"), opener=4242)
    pid = os.fork()
    if pid == 0:  # another serving process: reads the slot, frees it (its RELEASE)
        slot = t.get(fh)
        # The opener's pid too: a waiting read served here watches that process.
        ok = slot is not None and (slot.inode, slot.gen, slot.value, slot.opener) == (
            123,
            7,
            version_hash("v1", "c1"),
            4242,
        )
        t.free(fh)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.get(fh) is None  # freed by the other process
    again = t.open_file(456, 8, 1)
    assert again != fh and t.get(fh) is None  # a reused slot is a new handle
    assert t.get(again).inode == 456


def test_each_process_allocates_in_its_own_part_then_in_the_overflow() -> None:
    """Its own part full (the kernel gave it more OPENs than the others), a process
    takes slots of the overflow part, every process's: the table holds FILE_SLOTS files
    and DIR_SLOTS directories however they were spread. It was TableFull (ENFILE) with
    the other parts free."""
    a, per = SharedTables(2), FILE_SLOTS // 2
    b = SharedTables.__new__(SharedTables)
    b.__dict__.update(a.__dict__)
    b._cursor = {}
    b.index = 1
    mine = {a.open_file(1, 1, 1) for _ in range(per)}
    spilled = {a.open_file(1, 1, 1) for _ in range(FILE_SLOTS)}  # the overflow, whole
    assert len(mine | spilled) == per + FILE_SLOTS
    with pytest.raises(TableFull):
        a.open_file(1, 1, 1)
    theirs = b.open_file(2, 1, 1)  # the other process's part is untouched
    assert theirs not in mine | spilled and b.get(theirs).inode == 2
    with pytest.raises(TableFull):  # and the overflow is full for it too
        for _ in range(per):
            b.open_file(2, 1, 1)
    assert a.other_versions_open(1, 2) and not a.other_versions_open(1, 1)
    a.free(next(iter(spilled)))
    again = b.open_file(3, 1, 1)  # a freed overflow slot serves any process
    assert b.get(again).inode == 3 and a.get(again).inode == 3
    dirs = [a.open_dir(7, 1) for _ in range(DIR_SLOTS)]  # past its part of DIR_SLOTS
    a.set_position(dirs[-1], 5, b"k")
    assert (b.get(dirs[-1]).value, b.get(dirs[-1]).key) == (5, b"k")


def test_the_overflow_is_taken_by_one_process_at_a_time(tmp_path) -> None:
    """Two processes filling the overflow part at once never take one slot twice (two
    handles in one slot would read one file's bytes for another's)."""
    t, per = SharedTables(2), FILE_SLOTS // 2
    for _ in range(per):
        t.open_file(1, 1, 1)  # process 0's part full
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # process 1: its part full too, then half the overflow
        code = 1
        try:
            os.close(ready_r)
            t.index = 1
            t._cursor = {}
            for _ in range(per):
                t.open_file(2, 1, 1)
            os.write(ready_w, b"go")  # both fill the overflow from here, at once
            got = [t.open_file(2, 1, 2) for _ in range(FILE_SLOTS // 2)]
            (tmp_path / "child").write_text("\n".join(map(str, got)))
            code = 0
        finally:
            os._exit(code)
    # Only the child holds the write end: if it fails before "go", the read ends (b"")
    # and the test fails, where it waited for ever.
    os.close(ready_w)
    try:
        go = os.read(ready_r, 2)
    finally:
        os.close(ready_r)
    if go != b"go":
        os.waitpid(pid, 0)
    assert go == b"go", "the child failed before filling the overflow"
    got = [t.open_file(1, 1, 3) for _ in range(FILE_SLOTS // 2)]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    theirs = [int(x) for x in (tmp_path / "child").read_text().split()]
    slots = {fh & ((1 << 20) - 1) for fh in got + theirs}
    assert len(slots) == FILE_SLOTS  # every overflow slot once
    assert all(t.get(fh) is not None and t.get(fh).value == 2 for fh in theirs)
    assert all(t.get(fh) is not None and t.get(fh).value == 3 for fh in got)


def test_directory_positions_and_counters_are_shared() -> None:
    t = SharedTables(3)
    fh = t.open_dir(1, 4)
    t.set_position(fh, 17, b"key-bytes")
    slot = t.get(fh)
    assert (slot.value, slot.key) == (17, b"key-bytes")
    for i, n in enumerate((10, 20, 30)):
        t.index = i
        t.publish(MountCounters(bytes_read=n, hits=1))
    assert t.total() == MountCounters(bytes_read=60, hits=3)
    t.index = 1
    assert t.own_counters() == MountCounters(bytes_read=20, hits=1)


def test_the_versions_table_is_one_for_every_process() -> None:
    """A number made or counted in one process is read in another (forked, as the
    serving processes are), under the lock; each change moves the sequence number on;
    the handles open under a number are found by it, in any process."""
    t = SharedTables(2)
    fh = t.open_file(10, 3, 111, kino=1 << 62)  # a handle through a path's fresh number
    t.open_file(10, 2, 222)  # one of the old version, through the listing inode
    seq, gen = t.versions_stamp()
    pid = os.fork()
    if pid == 0:  # another serving process switches, makes the numbers, counts a lookup
        t.lock_versions()
        try:
            t.note_gen(3)
            t.write_versions({1 << 62: (FRESH, 10, 0), 10: (RETIRED, 10, 0)}, (1 << 62) + 1, 3)
            t.add_lookups(t.read_versions().rows[1 << 62], 1 << 62, 2)
        finally:
            t.unlock_versions()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.versions_stamp() == (seq + 1, 3)
    t.lock_versions()
    try:
        rows = t.read_versions()
    finally:
        t.unlock_versions()
    assert rows.numbers == {1 << 62: (FRESH, 10, 2), 10: (RETIRED, 10, 0)}
    assert rows.next == (1 << 62) + 1
    assert t.open_versions() == {1 << 62: {111}, 10: {222}}
    assert [f for f, _ in t.files_of(1 << 62)] == [fh] and t.get(fh).kino == 1 << 62
    assert t.other_versions_open(10, 111) and not t.other_versions_open(1 << 62, 111)
    with pytest.raises(VersionsFull):
        t.write_versions({n: (RETIRED, n, 0) for n in range(VERSION_ROWS + 1)}, 0, 3)
    assert t.versions_stamp() == (seq + 1, 3)  # unchanged


def test_the_generations_of_open_files_in_every_process() -> None:
    """Another serving process reads a handle's entry from the generation it was opened
    in (fs.py _adopt): the mount reports these, and the daemon keeps them."""
    t = SharedTables(2)
    other = SharedTables.__new__(SharedTables)
    other.__dict__.update(t.__dict__)
    other._cursor = {}
    other.index = 1
    assert t.open_generations() == set()
    a = t.open_file(1, 3, 1)
    other.open_file(1, 5, 2)
    t.open_dir(2, 1)  # a directory handle reads the listing it is in: not counted
    # A file whose fields hold the state's byte (1) at no slot's start are not slots.
    t.open_file(0x0101, 0x0101, 0x0101, opener=1)
    assert t.open_generations() == {3, 5, 0x0101}
    t.free(a)
    assert other.open_generations() == {5, 0x0101}
