"""The checks a backend makes on a body before returning it, without a server.

Owns: RetryingBackend retries a body whose checksum did not match (ChecksumMismatchError)
and a short one, counting each in its StoreCounters, and never returns either; the S3 backend's
MD5-ETag check applies only where the ETag is an MD5 of the bytes. The same paths
against the real emulators are in tests/integration/test_integrity.py.
"""

from __future__ import annotations

import hashlib

import pytest

from silofs.errors import ChecksumMismatchError, TransientError
from silofs.node.backends import BackendOptions, base
from silofs.node.backends.s3 import _check_md5_etag
from silofs.records import ObjectInfo
from tests.support.clock import patch_time

DATA = b"the bytes the store holds" * 100
MD5 = hashlib.md5(DATA).hexdigest()


class Scripted(base.RetryingBackend):
    """_get_once answers from a script: bytes, or an exception to raise."""

    def __init__(self, script: list[bytes | Exception], attempts: int = 4) -> None:
        self.uri = "s3://b/p/"
        self.opts = BackendOptions(max_attempts=attempts, backoff_base=0.0)
        self.script = script
        self.calls = 0

    def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


INFO = ObjectInfo("k", len(DATA), 0.0, MD5, f"s3:{MD5}:{len(DATA)}")


def test_checksum_mismatch_is_retried_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_time(monkeypatch, base, sleep=lambda s: None)
    b = Scripted([ChecksumMismatchError("flipped"), DATA[:10], DATA])
    assert b.get_range(INFO, 0, len(DATA)) == DATA
    assert b.calls == 3
    assert (b.counters.checksum_errors, b.counters.short_reads) == (1, 1)
    assert b.counters.retries == 2


def test_a_mismatch_every_time_is_an_error_never_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    patch_time(monkeypatch, base, sleep=lambda s: None)
    b = Scripted([ChecksumMismatchError("flipped")] * 3, attempts=3)
    with pytest.raises(TransientError):
        b.get_range(INFO, 0, len(DATA))
    assert b.counters.checksum_errors == 3


def _resp(etag: str, **extra: str) -> dict:
    return {"ETag": f'"{etag}"', **extra}


def test_md5_etag_checked_on_single_part_objects() -> None:
    _check_md5_etag(_resp(MD5), DATA, "x")
    _check_md5_etag(_resp(MD5, ServerSideEncryption="AES256"), DATA, "x")
    with pytest.raises(ChecksumMismatchError):
        _check_md5_etag(_resp(MD5), DATA[:-1] + b"!", "x")
    with pytest.raises(ChecksumMismatchError):
        _check_md5_etag(_resp(MD5.upper()), DATA[:-1] + b"!", "x")


@pytest.mark.parametrize(
    "resp",
    [
        _resp(MD5[:-2] + "-3"),  # multipart: not an MD5 of the bytes
        _resp("0" * 31 + "-"),
        _resp(MD5, ServerSideEncryption="aws:kms"),
        _resp(MD5, ServerSideEncryption="aws:kms:dsse"),
        _resp(MD5, SSECustomerAlgorithm="AES256"),
        _resp(""),
    ],
)
def test_md5_etag_not_checked_where_it_is_not_an_md5(resp: dict) -> None:
    _check_md5_etag(resp, b"other bytes entirely", "x")
