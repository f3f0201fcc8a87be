"""mount/forked.py's read token: one process at a time reads /dev/fuse.

Owns: a process that dies holding the token has it put back by the supervisor
(recover), and one that gave it back is not mistaken for a holder; a handler gives the
token back first thing (release_after_receive).
"""

from __future__ import annotations

import errno
import logging
import os
import signal

import pyfuse3
import trio

from silofs.mount import forked


def test_a_token_lost_with_its_holder_is_put_back() -> None:
    token = forked.ReadToken()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a serving process: takes the token, says so, then is killed
        trio.run(token.take)
        os.write(w, b"x")
        signal.pause()
        os._exit(0)
    assert os.read(r, 1) == b"x"
    assert token.holder() == pid and token.available() == 0
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert token.recover(pid)
    assert token.available() == 1 and token.holder() == 0
    assert not token.recover(pid)  # nothing lost now: no second token


def test_a_handler_gives_the_token_back_first() -> None:
    token = forked.ReadToken()

    class Ops(pyfuse3.Operations):
        async def getattr(self, inode: int, ctx: object) -> str:
            return "held" if token.holding else "given"

    forked.release_after_receive(Ops)
    forked._token = token
    try:

        async def main() -> str:
            await token.take()
            assert token.holding
            return await Ops().getattr(1, None)

        assert trio.run(main) == "given"
        assert token.available() == 1
    finally:
        forked._token = None


def test_an_aborted_session_wrapped_by_nurseries_is_a_disconnect_not_a_failure() -> None:
    # pyfuse3.main raises from inside its nursery and the serving process's: the
    # supervisor must still read it as the kernel ending the session (an unmount).
    aborted = ConnectionAbortedError(103, "fuse_session_receive_buf failed")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [aborted])])
    assert forked.is_disconnected(nested)
    assert forked.is_disconnected(OSError(19, "No such device"))
    assert not forked.is_disconnected(ExceptionGroup("g", [aborted, ValueError("bug")]))
    assert not forked.is_disconnected(OSError(5, "EIO"))


def test_a_reply_the_kernel_forgot_is_info_and_other_refusals_stay_errors(caplog) -> None:
    """An unmount racing a RELEASE: the answer's write gets ENOENT (nobody waits for it);
    pyfuse3's ERROR for that one is said at INFO. EIO/EINVAL stay ERRORs."""
    from silofs.mount.process import quiet_forgotten_replies

    quiet_forgotten_replies()
    quiet_forgotten_replies()  # once, however often a process mounts
    logger = logging.getLogger("pyfuse3")
    assert sum(type(f).__name__ == "ForgottenReplies" for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="pyfuse3"):
        logger.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        logger.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
        logger.error("something else: %s", os.strerror(errno.ENOENT))
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == "INFO" and "no longer waited" in levels[0][1]
    assert [lv for lv, _ in levels[1:]] == ["ERROR", "ERROR"]
