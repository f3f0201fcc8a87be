"""Retry policy: base.retry_call, and each SDK backend leaving retries to it.

Owns two things: retry_call's contract (what is retried, how often, how long it waits),
and proof that the S3, Azure and GCS backends turn throttling/5xx into TransientError,
retry them through retry_call only (one request per attempt: the SDKs' own retries are
off) and never retry what cannot succeed (403). The stores here are an in-process fake
HTTP server answering from a script; no emulator, no sleeps longer than microseconds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from silofs.errors import (
    AccessDeniedError,
    BackendError,
    NotFoundError,
    ObjectChangedError,
    TransientError,
    UnreachableError,
)
from silofs.node.backends import BackendOptions, base, open_backend
from silofs.records import ObjectInfo
from silofs.uri import parse_uri
from tests.support.clock import patch_time
from tests.support.servers import clean_env, service_account_key

# ---------------------------------------------------------------------------------------
# retry_call


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record retry_call's backoff delays instead of sleeping."""
    delays: list[float] = []
    patch_time(monkeypatch, base, sleep=delays.append)
    return delays


def test_recording_retry_call_s_sleeps_leaves_other_threads_sleeps_alone(
    sleeps: list[float],
) -> None:
    """The backoff is recorded through base's own `time`: patching the time module
    itself (base.time.sleep) made every thread's time.sleep a no-op that recorded its
    delay, the fake store's server and any pool thread of the test process included."""
    import time

    other = threading.Thread(target=time.sleep, args=(0.001,))
    other.start()
    other.join()
    base.retry_call(_flaky([TransientError("x")])[1], OPTS, "t")
    assert len(sleeps) == 1  # retry_call's backoff only


def _flaky(errors: list[Exception], result: str = "ok") -> tuple[list[int], object]:
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if errors:
            raise errors.pop(0)
        return result

    return calls, fn


OPTS = BackendOptions(max_attempts=4, backoff_base=0.2, backoff_max=10.0)


def test_success_needs_one_call(sleeps: list[float]) -> None:
    calls, fn = _flaky([])
    assert base.retry_call(fn, OPTS, "t") == "ok"
    assert calls == [1] and sleeps == []


@pytest.mark.parametrize("error", [TransientError("503"), UnreachableError("refused")])
def test_retryable_errors_are_retried_until_success(
    sleeps: list[float], error: BackendError
) -> None:
    calls, fn = _flaky([error, error])
    assert base.retry_call(fn, OPTS, "t") == "ok"
    assert calls == [3]
    assert len(sleeps) == 2
    # Full jitter under a doubling cap: attempt n waits in [0, base * 2**n].
    assert 0 <= sleeps[0] <= 0.4 and 0 <= sleeps[1] <= 0.8


def test_gives_up_after_max_attempts_with_the_last_error(sleeps: list[float]) -> None:
    errors: list[Exception] = [TransientError(f"busy {i}") for i in range(10)]
    calls, fn = _flaky(errors)
    with pytest.raises(TransientError, match="busy 3"):
        base.retry_call(fn, OPTS, "t")
    assert calls == [4]
    assert len(sleeps) == 3


def test_backoff_is_capped(sleeps: list[float]) -> None:
    opts = BackendOptions(max_attempts=12, backoff_base=1.0, backoff_max=0.5)
    calls, fn = _flaky([TransientError("x") for _ in range(11)])
    assert base.retry_call(fn, opts, "t") == "ok"
    assert len(sleeps) == 11 and max(sleeps) <= 0.5


@pytest.mark.parametrize(
    "error",
    [
        NotFoundError("no bucket"),
        AccessDeniedError("denied"),
        ObjectChangedError("changed"),
        BackendError("refused"),
    ],
)
def test_permanent_errors_are_not_retried(sleeps: list[float], error: BackendError) -> None:
    calls, fn = _flaky([error])
    with pytest.raises(type(error)):
        base.retry_call(fn, OPTS, "t")
    assert calls == [1] and sleeps == []


def test_non_backend_errors_propagate_untouched(sleeps: list[float]) -> None:
    calls, fn = _flaky([ValueError("a bug")])
    with pytest.raises(ValueError):
        base.retry_call(fn, OPTS, "t")
    assert calls == [1] and sleeps == []


def test_max_attempts_one_means_no_retry(sleeps: list[float]) -> None:
    calls, fn = _flaky([TransientError("x")])
    with pytest.raises(TransientError):
        base.retry_call(fn, BackendOptions(max_attempts=1), "t")
    assert calls == [1] and sleeps == []


def test_a_store_s_retries_are_one_warning_a_window_then_one_naming_those_left_to_debug(
    sleeps: list[float], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    patch_time(monkeypatch, base, monotonic=lambda: now[0])
    notes = base.RetryLog()
    caplog.set_level(logging.DEBUG, logger=base.log.name)

    def fail_then_succeed() -> None:
        calls, fn = _flaky([TransientError("503 SlowDown"), TransientError("503 SlowDown")])
        assert base.retry_call(fn, OPTS, "read s3://b/k", None, notes) == "ok"

    for _ in range(3):  # 6 retries inside one window: one WARNING, 5 DEBUG lines
        fail_then_succeed()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "retry 1/3" in warnings[0].getMessage()
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 5
    now[0] += base.RETRY_LOG_SECONDS
    fail_then_succeed()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "5 more retries of this store since the last such line" in warnings[1].getMessage()
    assert len(sleeps) == 8  # every retry still waits its backoff


@pytest.mark.parametrize("changed", [True, False])
def test_a_denial_is_tried_again_once_only_when_the_credentials_changed(
    sleeps: list[float], changed: bool
) -> None:
    renewals = [0]

    def renew() -> bool:
        renewals[0] += 1
        return changed

    calls, fn = _flaky([AccessDeniedError("old key"), AccessDeniedError("new key refused")])
    with pytest.raises(AccessDeniedError, match="new key refused" if changed else "old key"):
        base.retry_call(fn, OPTS, "t", None, None, renew)
    # At once (no backoff), and never a second renewal for one call.
    assert calls == [2 if changed else 1] and renewals == [1] and sleeps == []


# ---------------------------------------------------------------------------------------
# A scripted fake store


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeStore:
    """Serves `script` in order (one reply per request); records what was asked."""

    script: list[Reply]
    seen: list[str] = field(default_factory=list)
    url: str = ""

    def next_reply(self, method: str, path: str) -> Reply:
        self.seen.append(f"{method} {path}")
        if not self.script:
            return Reply(599, b"fake store: script exhausted")
        return self.script.pop(0)


def _handler(fake: FakeStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            reply = fake.next_reply(self.command, self.path)
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)

        do_GET = do_HEAD = do_PUT = do_POST = _reply  # noqa: N815 - http.server's naming

        def log_message(self, *_args: object) -> None:
            pass

    return Handler


@pytest.fixture
def fake_store() -> Iterator[FakeStore]:
    fake = FakeStore(script=[])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    # A short poll interval keeps shutdown() (which waits for one poll) fast.
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


# ---------------------------------------------------------------------------------------
# Per-store scripts: a listing of one object p/a.txt = b"abc", a ranged GET, and errors

DATA = b"abc"
XML_DECL = '<?xml version="1.0" encoding="utf-8"?>'
LAST_MODIFIED = "Mon, 01 Jan 2024 00:00:00 GMT"


def s3_list_ok() -> Reply:
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        "<Name>bkt</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
        "<IsTruncated>false</IsTruncated><Contents><Key>p/a.txt</Key>"
        "<LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>&quot;e1&quot;</ETag>"
        "<Size>3</Size><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"
    )
    return Reply(200, xml.encode(), {"Content-Type": "application/xml"})


def s3_get_ok() -> Reply:
    headers = {"ETag": '"e1"', "Content-Range": "bytes 0-2/3", "Last-Modified": LAST_MODIFIED}
    return Reply(206, DATA, headers)


def s3_error(status: int, code: str) -> Reply:
    xml = f"{XML_DECL}<Error><Code>{code}</Code><Message>m</Message></Error>"
    return Reply(status, xml.encode(), {"Content-Type": "application/xml"})


def az_list_ok() -> Reply:
    xml = (
        '<?xml version="1.0" encoding="utf-8"?>'
        '<EnumerationResults ServiceEndpoint="http://127.0.0.1/acct/" ContainerName="cont">'
        "<Prefix>p/</Prefix><Blobs><Blob><Name>p/a.txt</Name><Properties>"
        f"<Last-Modified>{LAST_MODIFIED}</Last-Modified><Etag>0x8D1</Etag>"
        "<Content-Length>3</Content-Length><BlobType>BlockBlob</BlobType>"
        "</Properties><Metadata /></Blob></Blobs><NextMarker /></EnumerationResults>"
    )
    return Reply(200, xml.encode(), {"Content-Type": "application/xml"})


def az_get_ok() -> Reply:
    headers = {
        "ETag": "0x8D1",
        "Content-Range": "bytes 0-2/3",
        "Last-Modified": LAST_MODIFIED,
        "x-ms-blob-type": "BlockBlob",
        "Content-Type": "application/octet-stream",
    }
    return Reply(206, DATA, headers)


def az_error(status: int, code: str) -> Reply:
    xml = f"{XML_DECL}<Error><Code>{code}</Code><Message>m</Message></Error>"
    return Reply(status, xml.encode(), {"x-ms-error-code": code, "Content-Type": "application/xml"})


def gcs_list_ok() -> Reply:
    body = {
        "kind": "storage#objects",
        "items": [
            {
                "kind": "storage#object",
                "name": "p/a.txt",
                "bucket": "bkt",
                "size": "3",
                "generation": "7",
                "md5Hash": "kAFQmDzST7DWlj99KOF/cg==",
                "updated": "2024-01-01T00:00:00.000Z",
            }
        ],
    }
    return Reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"})


def gcs_get_ok() -> Reply:
    headers = {"Content-Range": "bytes 0-2/3", "x-goog-generation": "7"}
    return Reply(206, DATA, headers)


def gcs_error(status: int, reason: str) -> Reply:
    body = {"error": {"code": status, "message": reason, "errors": [{"reason": reason}]}}
    return Reply(status, json.dumps(body).encode(), {"Content-Type": "application/json"})


@dataclass(frozen=True)
class Kind:
    uri: str
    list_ok: object
    get_ok: object
    error: object
    transient: tuple[tuple[int, str], ...]  # (status, code) pairs the store sends when busy
    denied: tuple[int, str]


KINDS = {
    "s3": Kind(
        "s3://bkt/p/",
        s3_list_ok,
        s3_get_ok,
        s3_error,
        ((503, "SlowDown"), (500, "InternalError"), (503, "ServiceUnavailable")),
        (403, "AccessDenied"),
    ),
    "azure": Kind(
        "az://acct/cont/p/",
        az_list_ok,
        az_get_ok,
        az_error,
        ((503, "ServerBusy"), (500, "InternalError"), (429, "TooManyRequests")),
        (403, "AuthenticationFailed"),
    ),
    "gcs": Kind(
        "gs://bkt/p/",
        gcs_list_ok,
        gcs_get_ok,
        gcs_error,
        ((429, "rateLimitExceeded"), (503, "backendError"), (500, "internalError")),
        (403, "forbidden"),
    ),
}


def _backend(kind: str, fake: FakeStore, monkeypatch: pytest.MonkeyPatch, attempts: int):  # noqa: ANN202
    clean_env(monkeypatch)
    extra: dict[str, str] = {}
    if kind == "s3":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    elif kind == "azure":
        extra["sas_token"] = "sv=2024-01-01&sig=fake"
    else:
        extra["anonymous"] = "true"
    opts = BackendOptions(
        endpoint_url=fake.url, max_attempts=attempts, backoff_base=0.001, extra=extra
    )
    return open_backend(parse_uri(KINDS[kind].uri), opts)


@pytest.mark.parametrize("kind", list(KINDS))
def test_throttling_and_5xx_on_list_are_retried_one_request_per_attempt(
    kind: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = KINDS[kind]
    fake_store.script = [k.error(*t) for t in k.transient] + [k.list_ok()]
    backend = _backend(kind, fake_store, monkeypatch, attempts=len(k.transient) + 1)
    infos = list(backend.list())
    assert [(i.key, i.size) for i in infos] == [("a.txt", 3)]
    assert len(fake_store.seen) == len(k.transient) + 1, fake_store.seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_throttled_range_get_is_retried(
    kind: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = KINDS[kind]
    fake_store.script = [k.list_ok(), k.error(*k.transient[0]), k.get_ok()]
    backend = _backend(kind, fake_store, monkeypatch, attempts=3)
    (info,) = list(backend.list())
    assert backend.get_range(info, 0, 3) == DATA
    assert len(fake_store.seen) == 3, fake_store.seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_sdk_does_not_retry_behind_retry_call(
    kind: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = KINDS[kind]
    fake_store.script = [k.error(*k.transient[0]) for _ in range(10)]
    backend = _backend(kind, fake_store, monkeypatch, attempts=2)
    with pytest.raises(TransientError):
        list(backend.list())
    assert len(fake_store.seen) == 2, fake_store.seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_access_denied_is_not_retried(
    kind: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = KINDS[kind]
    fake_store.script = [k.error(*k.denied) for _ in range(5)]
    backend = _backend(kind, fake_store, monkeypatch, attempts=5)
    with pytest.raises(AccessDeniedError):
        list(backend.list())
    # Not retried. S3's lean path (s3lean.py) hands an error answer other than 429/5xx to
    # botocore, which asks once more and maps what it gets: one redo, counted.
    redo = 1 if kind == "s3" else 0
    assert len(fake_store.seen) == 1 + redo, fake_store.seen
    assert getattr(backend.counters, "lean_fallbacks", 0) == redo


@pytest.mark.parametrize("kind", list(KINDS))
def test_precondition_failed_on_get_is_object_changed(
    kind: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = KINDS[kind]
    changed = {"s3": (412, "PreconditionFailed"), "azure": (412, "ConditionNotMet")}
    status, code = changed.get(kind, (404, "notFound"))  # GCS: generation gone
    fake_store.script = [k.list_ok()] + [k.error(status, code) for _ in range(3)]
    backend = _backend(kind, fake_store, monkeypatch, attempts=3)
    info: ObjectInfo = next(iter(backend.list()))
    with pytest.raises(ObjectChangedError):
        backend.get_range(info, 0, 3)
    redo = 1 if kind == "s3" else 0  # S3's lean path: botocore redoes the 412 (above)
    assert len(fake_store.seen) == 2 + redo, fake_store.seen


def test_a_short_body_is_retried_then_served_whole() -> None:
    from silofs.node.backends.base import RetryingBackend

    class Flaky(RetryingBackend):
        uri = "test://b/"
        opts = BackendOptions(max_attempts=3, backoff_base=0.0)
        calls = 0

        def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
            self.calls += 1
            n = end - start
            return b"x" * (n // 2 if self.calls == 1 else n)

    b = Flaky()
    info = ObjectInfo("k", 100, 0.0, "v", "c")
    assert b.get_range(info, 10, 50) == b"x" * 50
    assert b.calls == 2
    assert b.get_range(info, 90, 50) == b"x" * 10  # clamped to the listed size


def test_a_gcs_token_refresh_the_token_endpoint_may_yet_grant_is_retried(
    fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token endpoint failing in a way google-auth calls retryable (a 5xx, a 429,
    after its own tries) is a TransientError, retried: it was an AccessDeniedError, one
    EIO per read while the metadata server or the token endpoint hiccuped. A refresh the
    endpoint refuses (invalid_grant: a revoked key) stays a denial, not retried."""
    import google.auth.credentials
    import google.auth.exceptions as gax

    from silofs.node.backends import gcs

    class Flaky(google.auth.credentials.Credentials):
        def __init__(self, failures: list[Exception]) -> None:
            super().__init__()
            self.failures = failures

        def refresh(self, request: object) -> None:
            if self.failures:
                raise self.failures.pop(0)
            self.token = "a token"

    busy = gax.RefreshError("503 from the token endpoint", retryable=True)
    refused = gax.RefreshError("invalid_grant: the key was revoked")
    for failures, outcome in (([busy], None), ([refused], AccessDeniedError)):
        fake_store.script = [KINDS["gcs"].list_ok()]
        creds = Flaky(list(failures))
        monkeypatch.setattr(gcs, "resolve_credentials", lambda _o, c=creds: (c, None, "a test"))
        backend = _backend("gcs", fake_store, monkeypatch, attempts=3)
        if outcome is None:
            assert [i.key for i in backend.list()] == ["a.txt"]
        else:
            with pytest.raises(outcome, match="invalid_grant"):
                list(backend.list())


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("header", ["3", "Sun, 06 Nov 2094 08:49:37 GMT"])
def test_a_busy_answer_s_retry_after_is_waited_for_up_to_backoff_max(
    kind: str, header: str, fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503/429 with Retry-After (MinIO sends one with SlowDown, Azure and GCS front
    ends may) is retried no sooner than it says, up to backoff_max (10 s: a date decades
    away, or MinIO's 120 s, would hold a read for minutes): the jitter alone (here under
    2 ms) asked again at once, and a throttling store saw every attempt of a read inside
    the time it had asked for, then the read failed."""
    delays: list[float] = []
    patch_time(monkeypatch, base, sleep=delays.append)
    k = KINDS[kind]
    busy = k.error(*k.transient[0])
    busy.headers["Retry-After"] = header
    fake_store.script = [busy, k.list_ok()]
    backend = _backend(kind, fake_store, monkeypatch, attempts=2)
    assert [(i.key, i.size) for i in backend.list()] == [("a.txt", 3)]
    assert delays == [3.0 if header == "3" else 10.0]


def test_a_rewritten_gcs_key_file_is_read_again_when_its_old_key_is_refused(
    fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The daemon's service-account key file (key_file, GOOGLE_APPLICATION_CREDENTIALS,
    or the gcloud ADC file) is rewritten with a new key and the old one deleted: the
    token endpoint refuses the old one (invalid_grant), and the next request is made
    with the new file's. Before, the key read when the client was made was used until
    the daemon restarted, every miss and listing a denial."""

    clean_env(monkeypatch)
    monkeypatch.setattr(base, "RENEW_SECONDS", 0.0)
    key = tmp_path / "key.json"
    service_account_key(key, "old", f"{fake_store.url}/token")
    refused = Reply(400, json.dumps({"error": "invalid_grant"}).encode())
    refused.headers["Content-Type"] = "application/json"
    granted = Reply(200, json.dumps({"access_token": "t", "expires_in": 3600}).encode())
    granted.headers["Content-Type"] = "application/json"
    opts = BackendOptions(
        endpoint_url=fake_store.url,
        max_attempts=2,
        backoff_base=0.001,
        extra={"key_file": str(key)},
    )
    backend = open_backend(parse_uri(KINDS["gcs"].uri), opts)
    fake_store.script = [refused, refused]
    with pytest.raises(AccessDeniedError, match="invalid_grant"):  # the file is as it was
        list(backend.list())
    service_account_key(key, "new", f"{fake_store.url}/token")
    fake_store.script = [refused, granted, KINDS["gcs"].list_ok()]
    assert [i.key for i in backend.list()] == ["a.txt"]
    assert [s.split("?")[0] for s in fake_store.seen[-3:]] == [
        "POST /token",
        "POST /token",
        "GET /storage/v1/b/bkt/o",
    ]


def test_requests_refused_together_all_sign_with_renewed_s3_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A listing's 32 workers, or 16 fetches, are refused at once after a key rotation:
    the first to ask renews the client, and every other asking within RENEW_SECONDS is
    told to try again too (with the new client), not only the first: the others' pages
    and reads failed, and with them the listing."""
    clean_env(monkeypatch)
    creds = tmp_path / "credentials"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")

    def key(name: str) -> None:
        creds.write_text(f"[default]\naws_access_key_id = {name}\naws_secret_access_key = s\n")

    key("AKIAOLD")
    opts = BackendOptions(endpoint_url="http://127.0.0.1:9")
    unchanged, rotated = (open_backend(parse_uri("s3://bkt/p/"), opts) for _ in range(2))
    unchanged.client()
    rotated.client()
    assert unchanged._renew() is False  # the file as the client read it: a real denial
    key("AKIANEW")
    assert [rotated._renew() for _ in range(3)] == [True, True, True]
    assert rotated.client()._request_signer._credentials.access_key == "AKIANEW"


def test_one_renewal_gate_looks_once_a_while_and_retries_those_refused_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RetryingBackend._renew, the gate S3 and GCS share around their own look: one look
    per RENEW_SECONDS per dataset; a look finding them changed drops the client, and
    every denial within RENEWED_SECONDS after is tried again without a look; a client
    whose credentials cannot go stale (FIXED) is never looked at."""
    from silofs.node.backends.base import RENEW_SECONDS, RENEWED_SECONDS, RetryingBackend

    now = [1000.0]
    patch_time(monkeypatch, base, monotonic=lambda: now[0])

    class Rotating(RetryingBackend):
        uri = "test://b/"
        opts = BackendOptions()

        def __init__(self, held: object) -> None:
            self._lock = threading.Lock()
            self._client = object()
            self.held, self.looks, self.changed = held, 0, False

        def _credentials_held(self) -> object:
            return self.held

        def _credentials_changed(self, held: object) -> str | None:
            self.looks += 1
            return "changed" if self.changed else None

    b = Rotating(held=object())
    assert [b._renew(), b._renew()] == [False, False] and b.looks == 1  # one look a while
    now[0] += RENEW_SECONDS
    b.changed = True
    assert b._renew() is True and b._client is None and b.looks == 2
    b._client = object()  # the next request made a new one
    now[0] += RENEWED_SECONDS / 2
    assert b._renew() is True and b.looks == 2  # refused with the old: again, no look
    assert b._client is not None  # the new client kept
    now[0] += RENEWED_SECONDS
    b.changed = False
    assert b._renew() is False and b.looks == 3
    fixed = Rotating(held=base.FIXED)
    fixed.changed = True
    assert fixed._renew() is False and fixed.looks == 0


def test_a_hung_store_s_read_is_not_retried_past_read_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each try of a store that never answers ends at read_timeout (30 s) and was
    retried max_attempts (5) times: an uncached read was EIO after ~150 s. No retry
    begins read_deadline (60 s) after the read's first try: two tries, ~60 s. A listing
    page is not bounded by it (a listing runs in the background)."""
    from silofs.node.backends.base import RetryingBackend

    now = [1000.0]
    patch_time(
        monkeypatch, base, monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
    )

    class Hung(RetryingBackend):
        uri = "test://b/"
        opts = BackendOptions()  # read_timeout 30, max_attempts 5, read_deadline 60
        tries = 0

        def _get_once(self, info: ObjectInfo, start: int, end: int) -> bytes:
            self.tries += 1
            now[0] += self.opts.read_timeout
            raise TransientError("Read timeout on endpoint URL")

        def _list_page(self, token: str | None) -> tuple[list[object], str | None]:
            return self._get_once(INFO_K, 0, 1), None  # type: ignore[return-value]

    b = Hung()
    t0 = now[0]
    with pytest.raises(TransientError, match="Read timeout"):
        b.get_range(INFO_K, 0, 1)
    assert b.tries == 2
    assert now[0] - t0 < b.opts.read_deadline + b.opts.read_timeout
    b.tries = 0
    with pytest.raises(TransientError):
        list(b._list_flat())
    assert b.tries == b.opts.max_attempts


INFO_K = ObjectInfo("k", 100, 0.0, "v", "c")


def test_a_rewritten_azure_sas_token_file_is_read_again_when_its_token_is_refused(
    fake_store: FakeStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A SAS token in a file (sas_token_file) that a tool rewrites before the old token
    expires: the store refuses the old one (403 AuthenticationFailed), the file is read
    again and the request redone with the new token. A SAS in the environment or the
    config stays what it was until the daemon restarts (nothing to look at)."""
    clean_env(monkeypatch)
    monkeypatch.setattr(base, "RENEW_SECONDS", 0.0)  # a look at every denial
    monkeypatch.setattr(base, "RENEWED_SECONDS", 0.0)  # no retry without one
    sas = tmp_path / "sas"
    sas.write_text("?sv=2024-01-01&sig=old\n")
    opts = BackendOptions(
        endpoint_url=fake_store.url, max_attempts=2, backoff_base=0.001,
        extra={"sas_token_file": str(sas)},
    )  # fmt: skip
    backend = open_backend(parse_uri(KINDS["azure"].uri), opts)
    refused = az_error(403, "AuthenticationFailed")
    fake_store.script = [refused]
    with pytest.raises(AccessDeniedError):  # the file is as it was: a real denial
        list(backend.list())
    sas.write_text("sv=2024-01-01&sig=new\n")
    fake_store.script = [refused, KINDS["azure"].list_ok()]
    assert [i.key for i in backend.list()] == ["a.txt"]
    assert ["sig=new" in s for s in fake_store.seen[-3:]] == [False, False, True]
    sas.write_text("")
    fake_store.script = [refused]
    with pytest.raises(AccessDeniedError, match="is empty"):  # said, not a traceback
        list(backend.list())
