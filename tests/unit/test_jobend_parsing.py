"""What silofs/jobend.py reads before it unmounts or signals anything: a mount's owner
from its mountinfo line, a process's parent and start time from /proc/PID/stat whatever
its name, and which processes say they serve a mount. (Ending real mounts:
tests/integration/test_end_job.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from silofs.jobend import mount_process_claims, proc_stat, proc_uids
from silofs.mountinfo import parse_line


def test_a_fuse_mounts_owner_is_its_user_id_and_other_mounts_have_none() -> None:
    fuse = parse_line(
        rb"45 27 0:41 / /mnt/silofs/42/my\040data ro,nosuid,nodev - fuse.silofs "
        rb"silofs:file:///d/ ro,user_id=1007,group_id=1011,default_permissions"
    )
    assert fuse is not None and fuse.owner == 1007
    assert fuse.mountpoint == "/mnt/silofs/42/my data" and fuse.device == "0:41"
    ext4 = parse_line(b"22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw,user_id=5")
    assert ext4 is not None and ext4.owner is None  # not FUSE: user_id means nothing
    odd = parse_line(b"45 27 0:41 / /m rw - fuse.x x ro,user_id=abc")
    assert odd is not None and odd.owner is None


def test_proc_stat_reads_past_a_name_with_parentheses_and_spaces() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c",
         "open('/proc/self/comm','w').write('a) b ) c'); import time; time.sleep(30)"],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{child.pid}/comm").read().strip() != "a) b ) c":
            assert time.monotonic() < deadline, "the child did not rename itself"
            time.sleep(0.01)
        got = proc_stat(child.pid)
        assert got is not None
        state, ppid, started = got
        assert state in ("S", "R") and ppid == os.getpid() and started > 0
        assert proc_uids(child.pid) == {os.getuid()}
    finally:
        child.kill()
        child.wait()
    assert proc_stat(child.pid) is None and proc_uids(child.pid) is None


def test_only_mount_process_command_lines_with_a_mountpoint_are_claims() -> None:
    settings = json.dumps({"mountpoint": "/mnt/silofs/42/ds", "job": "slurm-42"})
    script = "import time; time.sleep(30)"
    claimants = [
        # as _mount_background starts one
        [sys.executable, "-c", script, "mount-process", "--ready-fd", "4", settings],
        # "mount-process" as the last word, or settings without a mountpoint: no claim
        [sys.executable, "-c", script, json.dumps({"mountpoint": "/x"}), "mount-process"],
        [sys.executable, "-c", script, "mount-process", json.dumps({"job": "slurm-42"})],
        [sys.executable, "-c", script, "mount-process", "not json"],
    ]
    procs = [subprocess.Popen(argv) for argv in claimants]
    try:
        claims = dict(mount_process_claims())
        assert claims.get(procs[0].pid) == "/mnt/silofs/42/ds"
        assert not {p.pid for p in procs[1:]} & claims.keys()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_mounts_id_group_and_whether_it_is_silofs() -> None:
    """What `silofs end-dead-mounts` picks its mounts by: the uid and gid to probe as,
    the id the probe and the detach check the path still leads to, silofs or not."""
    line = (
        rb"96 27 0:41 / /o/1 ro shared:3 - fuse.silofs silofs:file:///d/ ro,user_id=7,group_id=11"
    )
    entry = parse_line(line)
    assert entry is not None
    assert (entry.mount_id, entry.owner, entry.group, entry.is_silofs) == (96, 7, 11, True)
    bare = parse_line(b"97 27 0:42 / /o/2 ro - fuse silofs:x ro,user_id=7,group_id=11")
    assert bare is not None and bare.is_silofs  # a fuse type without the subtype
    sshfs = parse_line(b"98 27 0:43 / /o/3 ro - fuse.sshfs h:/ ro,user_id=7,group_id=11")
    assert sshfs is not None and not sshfs.is_silofs
    ext4 = parse_line(b"22 1 8:1 / / rw - ext4 silofs:x rw,group_id=5")
    assert ext4 is not None and ext4.group is None and not ext4.is_silofs
