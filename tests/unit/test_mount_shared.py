"""mount/shared.py: the tables several serving processes of one mount share.

Owns: a file handle names its slot's inode, generation, version and opener from any
process (forked here, as the serving processes are); a slot reused after RELEASE gives a new
handle and the old one names nothing; each process allocates only in its own part; the
reported counters are the sum of the processes' rows; a readdir position is shared.
"""

from __future__ import annotations

import os

from silofs.mount.shared import FILE_SLOTS, SharedTables, TableFull, version_hash
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


def test_each_process_allocates_in_its_own_part_until_it_is_full() -> None:
    a, per = SharedTables(2), FILE_SLOTS // 2
    b = SharedTables.__new__(SharedTables)
    b.__dict__.update(a.__dict__)
    b._cursor = {}
    b.index = 1
    mine = {a.open_file(1, 1, 1) for _ in range(per)}
    try:
        a.open_file(1, 1, 1)
        raise AssertionError("the part should be full")
    except TableFull:
        pass
    theirs = b.open_file(2, 1, 1)  # the other process's part is untouched
    assert theirs not in mine and b.get(theirs).inode == 2
    assert a.other_versions_open(1, 2) and not a.other_versions_open(1, 1)


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
