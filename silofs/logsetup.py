"""Where the daemon's and the mount processes' logs go, and in what shape.

Owns the root logger's one handler: a file that is reopened when logrotate moves it (and
on SIGHUP), or syslog/the journal (/dev/log) for processes running in the background, or
stderr; text or one JSON object per line, each message with its control characters
escaped (records.shown); and the store SDKs' loggers held at WARNING (the Azure SDK
alone writes a 10-line INFO entry per request). Never decides what is logged, and
imports neither the daemon nor the mount side.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import stat
import sys
import threading
import time

from silofs.errors import UsageError
from silofs.records import shown

LOG_FORMATS = ("text", "json")
SDK_LOGGERS = (
    "azure",
    "botocore",
    "boto3",
    "s3transfer",
    "urllib3",
    "google",
    "google_auth_httplib2",
    "requests",
)
TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
# syslog adds its own time and host; the journal reads the ident before "[pid]: ".
SYSLOG_FORMAT = "%(ident)s[%(process)d]: %(levelname)s %(name)s: %(message)s"


def syslog_address() -> str | None:
    """The local syslog socket (journald listens on it too), if there is one.
    SILOFS_SYSLOG_SOCKET names another (tests bind their own)."""
    path = os.environ.get("SILOFS_SYSLOG_SOCKET") or "/dev/log"
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


class TextFormatter(logging.Formatter):
    """The stdlib's, with the message shown() (records.py): a name from someone else
    (a dataset URI, a mountpoint, an object key) holding ESC or a newline cannot drive
    the terminal of whoever reads the log, or forge a line of its own. A traceback
    after the message keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - stdlib name
        record.message = shown(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, pid, message (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            # json.dumps (ensure_ascii off) leaves C1 controls and bidi overrides raw
            "message": shown(record.getMessage()),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class QuietSysLogHandler(logging.handlers.SysLogHandler):
    """A SysLogHandler that, when syslog stops answering (journald restarting), says so
    once on stderr and drops records, instead of a traceback on stderr per record."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - stdlib name
        if not self.failed:
            self.failed = True
            sys.stderr.write(f"silofs: syslog at {self.address} stopped answering; dropping logs\n")


class _IdentFormatter(TextFormatter):
    def __init__(self, ident: str, inner: logging.Formatter | None) -> None:
        super().__init__(SYSLOG_FORMAT)
        self.ident = ident
        self.inner = inner  # JSON after the ident, when asked for

    def format(self, record: logging.LogRecord) -> str:
        if self.inner is not None:
            return f"{self.ident}[{record.process}]: {self.inner.format(record)}"
        record.ident = self.ident
        return super().format(record)


def setup_logging(
    level: str = "info",
    log_file: str | None = None,
    *,
    fmt: str = "text",
    syslog_ident: str | None = None,
    sdk_level: str = "warning",
) -> logging.Handler:
    """Replace the root logger's handlers with one. `syslog_ident` (a process in the
    background) sends records to syslog when there is a local syslog socket; a
    `log_file` wins over it."""
    handler: logging.Handler
    json_fmt = JsonFormatter() if fmt == "json" else None
    if log_file:
        try:
            handler = ReopeningFileHandler(log_file)
        except OSError as exc:  # a directory that does not exist, no permission
            raise UsageError(f"cannot open log_file {log_file}: {exc.strerror}") from None
        handler.setFormatter(json_fmt or TextFormatter(TEXT_FORMAT))
        _reopen_on_sighup(handler)
    elif syslog_ident and (address := syslog_address()):
        handler = QuietSysLogHandler(
            address=address, facility=logging.handlers.SysLogHandler.LOG_DAEMON
        )
        handler.setFormatter(_IdentFormatter(syslog_ident, json_fmt))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(json_fmt or TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    sdk = getattr(logging, sdk_level.upper(), logging.WARNING)
    for name in SDK_LOGGERS:
        logging.getLogger(name).setLevel(sdk)
    return handler


class ReopeningFileHandler(logging.handlers.WatchedFileHandler):
    """A WatchedFileHandler (reopens a file logrotate moved or deleted) that also
    reopens after SIGHUP (logrotate's postrotate `kill -HUP`, copytruncate setups). The
    signal only sets a flag: closing the stream inside a handler could cut a write."""

    hup = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.hup:
            self.hup = False
            if self.stream is not None:
                self.stream.close()
                self.stream = None  # type: ignore[assignment]
            self.stream = self._open()
            self._statstream()
        super().emit(record)


def _reopen_on_sighup(handler: ReopeningFileHandler) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def hup(_signum: int, _frame: object) -> None:
        handler.hup = True

    signal.signal(signal.SIGHUP, hup)


def reopen_log_files() -> list[str]:
    """Have every log file of the root logger reopened before its next record (what
    SIGHUP asks of a daemon); the paths, empty when the logs go to stderr or syslog."""
    files = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ReopeningFileHandler):
            handler.hup = True
            files.append(handler.baseFilename)
    return files


def survive_sighup() -> None:
    """SIGHUP never ends this process: it reopens the log file if there is one, and is
    otherwise ignored. Python's default for SIGHUP is to die; a daemon logging to stderr
    or syslog got it from `kill -HUP` (logrotate's postrotate, a closed terminal)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda _signum, _frame: reopen_log_files())


__all__ = [
    "reopen_log_files",
    "survive_sighup",
    "setup_logging",
    "syslog_address",
    "JsonFormatter",
    "LOG_FORMATS",
    "SDK_LOGGERS",
]
