"""The kernel's table of mounts (/proc/self/mountinfo), parsed once, correctly.

Owns reading mountinfo lines into records: the mountpoint with the kernel's octal
escapes (\\040 space, \\011 tab, \\012 newline, \\134 backslash) undone on bytes and
decoded as the filesystem encoding, so /mnt/données stays /mnt/données; and the one
line that tells a user the FUSE device refuses it (fuse_device_refusal), shared by the
CLI (before it starts a daemon) and the mount process. Never stats a mountpoint: the
process serving a FUSE mount would deadlock on its own.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

_ESCAPE = re.compile(rb"\\([0-7]{3})")
FUSE_DEVICE = "/dev/fuse"  # what libfuse opens (a test points it at a stand-in)


@dataclass(frozen=True)
class MountEntry:
    device: str  # "major:minor", the bdi name under /sys/class/bdi
    mountpoint: str
    fstype: str  # e.g. "fuse.silofs"
    source: str  # e.g. "silofs:s3://bucket/prefix/"
    options: str = ""  # the superblock's, e.g. "ro,user_id=1000,group_id=1000"
    mount_id: int = 0  # unique while mounted; /proc/PID/fdinfo's mnt_id of a file in it

    @property
    def owner(self) -> int | None:
        """The uid that made a FUSE mount (its user_id option); None for other kinds."""
        return self._fuse_option("user_id")

    @property
    def group(self) -> int | None:
        """The gid a FUSE mount was made with (group_id): with `owner`, who the kernel
        lets use a mount made without allow_other; None for other kinds."""
        return self._fuse_option("group_id")

    @property
    def is_silofs(self) -> bool:
        return self.fstype.startswith("fuse") and (
            self.fstype == "fuse.silofs" or self.source.startswith("silofs:")
        )

    def _fuse_option(self, name: str) -> int | None:
        if not self.fstype.startswith("fuse"):
            return None
        for option in self.options.split(","):
            key, _, value = option.partition("=")
            if key == name and value.isdigit():
                return int(value)
        return None


def unescape(field: bytes) -> str:
    """A mountinfo path field as the path it names."""
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def parse_line(line: bytes) -> MountEntry | None:
    fields = line.split()
    try:
        sep = fields.index(b"-", 6)
        return MountEntry(
            device=fields[2].decode(),
            mountpoint=unescape(fields[4]),
            fstype=fields[sep + 1].decode(),
            source=unescape(fields[sep + 2]),
            options=fields[sep + 3].decode() if len(fields) > sep + 3 else "",
            mount_id=int(fields[0]),
        )
    except (ValueError, IndexError):
        return None


def mounts(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    """Every mount in this mount namespace, oldest first."""
    with open(path, "rb") as f:
        return [e for line in f if (e := parse_line(line)) is not None]


def silofs_mounts() -> dict[str, MountEntry]:
    """Mountpoint -> entry of the silofs FUSE mounts in this namespace."""
    return {e.mountpoint: e for e in mounts() if e.is_silofs}


def is_mounted(path: str) -> bool:
    return any(e.mountpoint == path for e in mounts())


def fuse_device_refusal(mountpoint: str) -> str | None:
    """Why this user cannot mount at `mountpoint` because of the FUSE device, in one line
    that says what to do; None when it may open it. libfuse opens the device itself
    before it would ask fusermount3 (setuid) to mount: a device only root may open (some
    hosts make it 0600) stops every other user."""
    device = FUSE_DEVICE
    if os.access(device, os.R_OK | os.W_OK):
        return None
    try:
        st = os.stat(device)
    except OSError as exc:
        return f"cannot mount at {mountpoint}: {device}: {exc.strerror} (modprobe fuse)"
    return (
        f"cannot mount at {mountpoint}: {device} is mode "
        f"{stat.filemode(st.st_mode)}, which this user may not open: an administrator "
        f"can make it 0666 (Debian's default; fusermount3 still decides who may mount "
        "where), or mount as root"
    )
