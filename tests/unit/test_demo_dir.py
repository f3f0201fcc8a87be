"""`silofs demo`'s directory: one per user by default, and never another user's.

A first user's (or root's) demo left /var/tmp/silofs-demo behind, which the next user
could not write: their demo failed on the cache dir. A name in /var/tmp can also be made
by anyone before the user runs the demo: it must be the user's own directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from silofs.demo import default_dir, ownership_error


def test_the_default_directory_is_the_users_own() -> None:
    a = default_dir()
    assert a.parent == Path("/var/tmp") and a.name.startswith("silofs-demo-")
    assert a.name != "silofs-demo-"


def test_a_directory_of_another_user_or_a_symlink_is_refused(tmp_path: Path) -> None:
    mine, theirs, link = tmp_path / "mine", tmp_path / "theirs", tmp_path / "link"
    mine.mkdir()
    theirs.mkdir()
    link.symlink_to(mine)
    me = os.stat(mine).st_uid
    assert ownership_error(tmp_path / "absent", me + 1) is None  # made by the demo
    assert ownership_error(mine, me) is None
    assert ownership_error(mine, me + 1) == f"{mine} belongs to another user"
    assert ownership_error(link, me) == f"{link} is not a directory"
    assert ownership_error(theirs, 0) is None  # root may use any directory
