"""The S3 backend's lean request path (silofs/node/backends/s3lean.py) against moto.

Owns: list pages and GETs go out on the lean path (botocore makes no API call of its own
on the happy path), signed so that a moto that verifies SigV4 signatures accepts them;
and every answer the lean path does not handle (a 412 of a changed object, a 403, a
reset connection) is redone by botocore with exactly its error mapping, and counted in
`lean_fallbacks`; a timeout is not (the attempt ends: botocore would wait as long
again). A checksum mismatch on the lean path is the same ChecksumMismatchError
as on botocore's. The backend's behaviour itself is pinned by test_backend_conformance.py
and test_integrity.py, which run through the lean path unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from silofs.errors import (
    AccessDeniedError,
    ChecksumMismatchError,
    ObjectChangedError,
    TransientError,
)
from silofs.node.backends.base import BackendOptions
from silofs.node.backends.s3 import S3Backend
from silofs.uri import parse_uri
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.servers import S3Server, start_moto

pytestmark = pytest.mark.servers

KEYS = ["ds/plain.bin", "ds/a & b <c>.bin", "ds/日本/ü+%.bin", "ds/sub/deeper/x.bin"]
DATA = {k: random.Random(k).randbytes(3000 + i) for i, k in enumerate(KEYS)}


def _botocore_calls(backend: S3Backend) -> list[str]:
    """API calls botocore itself makes on this backend's client from now on."""
    calls: list[str] = []

    def record(event_name: str, **_kw: Any) -> None:
        calls.append(event_name.rsplit(".", 1)[-1])

    backend.client().meta.events.register("after-call.s3", record)
    return calls


def _backend(url: str, bucket: str, **opts: Any) -> S3Backend:
    return S3Backend(parse_uri(f"s3://{bucket}/ds/"), BackendOptions(endpoint_url=url, **opts))


@pytest.fixture
def bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, bucket_name: str) -> str:
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, DATA)
    return bucket_name


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    parts = urlsplit(s3_server.endpoint_url)
    with FaultProxy(upstream=(parts.hostname or "127.0.0.1", parts.port or 80), seed=3) as p:
        yield p


def test_lists_and_reads_on_the_lean_path(s3_server: S3Server, bucket: str) -> None:
    backend = _backend(s3_server.endpoint_url, bucket, page_size=2, list_workers=1)
    calls = _botocore_calls(backend)
    infos = {i.key: i for i in backend.list()}
    assert sorted(infos) == sorted(k[3:] for k in KEYS)
    for key, info in infos.items():
        data = DATA["ds/" + key]
        assert backend.get_range(info, 0, info.size) == data  # whole: checksums checked
        assert backend.get_range(info, 100, 900) == data[100:1000]
        stream = backend.open_range(info, 10, 2000)
        assert stream is not None
        assert stream.read(1000) + stream.read(990) == data[10:2000]
        stream.close()
    assert calls == []
    assert backend.counters.lean_fallbacks == 0
    # Fanned out by delimiter: the same objects, still without botocore.
    fanned = _backend(s3_server.endpoint_url, bucket, page_size=1, list_workers=4)
    fanned_calls = _botocore_calls(fanned)
    assert sorted(i.key for i in fanned.list()) == sorted(infos)
    assert fanned_calls == [] and fanned.counters.lean_fallbacks == 0


def test_a_range_stream_fills_a_buffer_from_the_connection(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """readinto takes the body's bytes straight off the connection, not through
    urllib3's read (a bytes object copied into the buffer), and stops at the range."""
    import urllib3.response

    backend = _backend(s3_server.endpoint_url, bucket, page_size=1000, list_workers=1)
    info = next(i for i in backend.list() if i.size > 2000)
    data = DATA["ds/" + info.key]
    urllib3_reads: list[int | None] = []
    read = urllib3.response.HTTPResponse.read

    def counted(self: urllib3.response.HTTPResponse, amt: int | None = None, **kw: object) -> bytes:
        urllib3_reads.append(amt)
        return read(self, amt, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", counted)
    stream = backend.open_range(info, 10, 1990)
    assert stream is not None
    buf = bytearray(1990)
    view = memoryview(buf)
    stream.readinto(view[:1000])
    stream.readinto(view[1000:])
    assert buf == data[10:2000] and stream.pos == stream.end
    with pytest.raises(ValueError):
        stream.readinto(memoryview(bytearray(1)))  # past the range
    stream.close()
    assert urllib3_reads == []
    assert backend.counters.lean_fallbacks == 0


@pytest.fixture(scope="module")
def signing_moto() -> Iterator[tuple[S3Server, dict[str, str]]]:
    """A moto that checks SigV4 signatures: three unauthenticated IAM calls make a user
    with a key and an S3 policy, then every request must be signed with that key."""
    server = start_moto("moto-s3-sigv4", {"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        iam = boto3.client(
            "iam",
            endpoint_url=server.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.put_user_policy(
            UserName="reader",
            PolicyName="s3",
            PolicyDocument='{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
            '"Action": "s3:*", "Resource": "*"}]}',
        )
        env = {
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        yield S3Server(endpoint_url=server.endpoint_url, env=env), env
    finally:
        server.stop()


def test_signatures_are_accepted_by_a_verifying_store_and_wrong_keys_are_denied(
    signing_moto: tuple[S3Server, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    bucket_name: str,
) -> None:
    server, env = signing_moto
    server.apply_env(monkeypatch)
    server.create(bucket_name, DATA)
    backend = _backend(server.endpoint_url, bucket_name, page_size=3)
    calls = _botocore_calls(backend)
    infos = list(backend.list())
    assert len(infos) == len(KEYS)
    for info in infos:
        assert backend.get_range(info, 0, info.size) == DATA["ds/" + info.key]
    assert calls == [] and backend.counters.lean_fallbacks == 0

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + env["AWS_SECRET_ACCESS_KEY"])
    wrong = _backend(server.endpoint_url, bucket_name, max_attempts=1)
    wrong_calls = _botocore_calls(wrong)
    with pytest.raises(AccessDeniedError):
        list(wrong.list())
    with pytest.raises(AccessDeniedError):
        wrong.get_range(infos[0], 0, 10)
    # Each refused lean request was redone by botocore, whose error is the one raised.
    assert wrong.counters.lean_fallbacks == 2
    # (and after a fallback the lean path asks the client again where the bucket is:
    # a ListObjectsV2 botocore resolves and signs but does not send, LeanS3.resolve)
    assert wrong_calls.count("GetObject") == 1 and "ListObjectsV2" in wrong_calls


def test_a_changed_object_is_botocores_object_changed(s3_server: S3Server, bucket: str) -> None:
    backend = _backend(s3_server.endpoint_url, bucket, max_attempts=1)
    [info] = [i for i in backend.list() if i.key == "plain.bin"]
    s3_server.put(bucket, "ds/plain.bin", b"new bytes")
    with pytest.raises(ObjectChangedError):
        backend.get_range(info, 0, info.size)  # If-Match: 412, redone, mapped
    with pytest.raises(ObjectChangedError):
        backend.open_range(info, 1, 5)
    assert backend.counters.lean_fallbacks == 2


def test_a_reset_connection_is_redone_by_botocore(
    s3_server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    backend = _backend(proxy.url, bucket, max_attempts=1)
    infos = {i.key: i for i in backend.list()}
    info = infos["plain.bin"]
    reset = FaultPlan(faults=[Fault("reset_before_response", methods="GET", times=1)])
    proxy.set_plan(reset)  # the lean GET's connection is reset, botocore's is not
    assert backend.get_range(info, 0, info.size) == DATA["ds/plain.bin"]
    proxy.set_plan(reset)
    assert backend.get_range(info, 5, 50) == DATA["ds/plain.bin"][5:55]
    assert backend.counters.lean_fallbacks == 2
    assert backend.counters.retries == 0  # redone, not retried: max_attempts=1 held


def test_a_corrupted_body_fails_its_checksum_on_the_lean_path(
    s3_server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    # An object with a full-object CRC32: the whole GET carries x-amz-checksum-crc32.
    data = random.Random("crc").randbytes(5000)
    s3_server.client().put_object(
        Bucket=bucket, Key="ds/crc.bin", Body=data, ChecksumAlgorithm="CRC32"
    )
    # MD5 ETag check off: only the flexible checksum can catch it.
    backend = _backend(proxy.url, bucket, max_attempts=1, extra={"verify_etag_md5": "false"})
    [info] = [i for i in backend.list() if i.key == "crc.bin"]
    proxy.set_plan(FaultPlan(faults=[Fault("corrupt", methods="GET", path="crc")]))
    with pytest.raises(ChecksumMismatchError):
        backend.get_range(info, 0, info.size)
    assert backend.counters.checksum_errors == 1
    assert backend.counters.lean_fallbacks == 0  # a mismatch is an answer, not redone
    proxy.set_plan(FaultPlan())
    assert backend.get_range(info, 0, info.size) == data


def test_a_timed_out_request_is_not_redone_by_botocore(
    s3_server: S3Server, bucket: str, proxy: FaultProxy
) -> None:
    """A store that says nothing: the lean GET's read timeout is the attempt's end (one
    transient error, retried by retry_call), not a fallback that waits as long again
    through botocore for the same silent store."""
    backend = _backend(proxy.url, bucket, max_attempts=2, read_timeout=1.0, connect_timeout=1.0)
    infos = {i.key: i for i in backend.list()}
    info = infos["plain.bin"]
    proxy.set_plan(FaultPlan(faults=[Fault("delay", seconds=30, methods="GET")]))
    before = proxy.stats["requests"]
    with pytest.raises(TransientError):
        backend.get_range(info, 0, info.size)
    assert proxy.stats["requests"] - before == 2  # one GET per attempt
    assert backend.counters.lean_fallbacks == 0
    proxy.set_plan(FaultPlan())
    assert backend.get_range(info, 0, info.size) == DATA["ds/plain.bin"]
