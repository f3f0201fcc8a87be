"""Dataset URI parsing and backend choice: canonical names, and clear UsageErrors.

Owns the edge cases of silofs.backends.parse_uri/open_backend. Never starts a server and
never lets a backend touch the network (construction must do no I/O).
"""

from __future__ import annotations

import os
import socket

import pytest

from silofs.errors import UsageError
from silofs.node.backends import BackendOptions, open_backend
from silofs.uri import MAX_URI_BYTES, DatasetURI, parse_uri, store_endpoint


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/some/prefix", DatasetURI("s3", "bucket", "some/prefix/")),
        ("s3://bucket", DatasetURI("s3", "bucket", "")),
        ("s3://bucket/", DatasetURI("s3", "bucket", "")),
        ("S3://bucket/p", DatasetURI("s3", "bucket", "p/")),
        ("s3://bucket/my%20data/", DatasetURI("s3", "bucket", "my data/")),
        ("gs://bkt/a/b/", DatasetURI("gs", "bkt", "a/b/")),
        ("az://acct/container/p", DatasetURI("az", "container", "p/", account="acct")),
        ("az://acct/container", DatasetURI("az", "container", "", account="acct")),
        (
            "https://acct.blob.core.windows.net/container/p/q",
            DatasetURI("az", "container", "p/q/", account="acct"),
        ),
        (
            "https://ACCT.blob.core.chinacloudapi.cn/container",
            DatasetURI("az", "container", "", account="acct"),
        ),
        ("file:///srv/data/", DatasetURI("file", "/srv/data", "")),
        ("file://localhost/srv/data", DatasetURI("file", "/srv/data", "")),
    ],
)
def test_parse(uri: str, expected: DatasetURI) -> None:
    assert parse_uri(uri) == expected


def test_bare_path_is_an_absolute_local_directory(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    parsed = parse_uri("data/set")
    assert parsed.scheme == "file"
    assert parsed.bucket == os.path.join(str(tmp_path), "data", "set")


@pytest.mark.parametrize(
    "variants",
    [
        ["s3://b/p", "s3://b/p/", "s3://b//p//", "S3://b/p"],
        ["gs://b", "gs://b/", "gs://b//"],
        ["az://acct/c/p", "az://acct/c/p/", "https://acct.blob.core.windows.net/c/p/"],
        ["file:///srv/d", "file:///srv/d/", "file:///srv//d/."],
    ],
)
def test_canonical_name_ignores_slash_spelling(variants: list[str]) -> None:
    names = {parse_uri(v).canonical for v in variants}
    assert len(names) == 1, names
    assert names.pop().endswith("/")


def test_canonical_forms() -> None:
    assert parse_uri("s3://b/p").canonical == "s3://b/p/"
    assert parse_uri("gs://b").canonical == "gs://b/"
    assert parse_uri("az://acct/c/p").canonical == "az://acct/c/p/"
    assert parse_uri("file:///srv/d").canonical == "file:///srv/d/"


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("", ["empty"]),
        ("s3://", ["bucket", "s3://BUCKET/PREFIX"]),
        ("s3:///prefix-only", ["bucket"]),
        ("gs://", ["bucket", "gs://BUCKET/PREFIX"]),
        ("az://acct", ["container", "az://ACCOUNT/CONTAINER/PREFIX"]),
        ("az://acct/", ["container"]),
        ("az:///container/p", ["account"]),
        ("https://acct.blob.core.windows.net/", ["container"]),
        ("https://acct.blob.core.windows.net", ["container"]),
        ("ftp://host/x", ["unknown URI scheme 'ftp'", "s3://bucket/prefix", "gs://"]),
        ("https://example.com/data", ["unknown URI scheme 'https'"]),
        ("hdfs://namenode/data", ["unknown URI scheme 'hdfs'"]),
        ("file://otherhost/srv", ["file:///absolute/path"]),
        # Control characters, raw or percent-encoded (urlsplit drops a raw newline
        # silently; a decoded one would write a line of its own into the logs).
        ("file:///data/da%00ta", ["control character"]),
        ("/data/x\x00y", ["control character"]),
        ("s3://b/train%0a2026-01-01 ERROR forged", ["control character"]),
        ("s3://b/train\nforged", ["control character"]),
        ("gs://b\r/x", ["control character"]),
        ("az://acct/c/p%7f", ["control character"]),
        # Credentials before the bucket or account: refused, never repeated.
        ("s3://AKIA:secret@bucket/", ["holds no credentials"]),
        ("gs://user@bucket/p", ["holds no credentials"]),
        ("az://key@acct/c/", ["holds no credentials"]),
        ("https://u:secret@acct.blob.core.windows.net/c/", ["holds no credentials"]),
    ],
)
def test_bad_uris_are_usage_errors_that_say_what_is_wrong(uri: str, words: list[str]) -> None:
    with pytest.raises(UsageError) as err:
        parse_uri(uri)
    message = str(err.value)
    assert "\n" not in message and "secret" not in message
    for word in words:
        assert word in message, (word, message)


def _no_network(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("backend construction must not open connections")


@pytest.mark.parametrize(
    ("uri", "cls_name", "extra"),
    [
        ("file:///srv/none", "LocalBackend", {}),
        ("s3://bucket/p", "S3Backend", {}),
        ("az://acct/container/p", "AzureBackend", {"sas_token": "sv=2024&sig=x"}),
        ("az://acct/container/p", "AzureBackend", {}),  # missing creds: raised on use
        ("gs://bucket/p", "GCSBackend", {}),  # missing creds: raised on use
    ],
)
def test_open_backend_picks_the_store_without_io(
    uri: str, cls_name: str, extra: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_CONNECTION_STRING"):
        monkeypatch.delenv(name, raising=False)
    backend = open_backend(parse_uri(uri), BackendOptions(extra=extra))
    assert type(backend).__name__ == cls_name
    assert backend.uri == parse_uri(uri).canonical
    backend.close()


def test_open_backend_rejects_an_unknown_scheme() -> None:
    with pytest.raises(UsageError, match="no backend"):
        open_backend(DatasetURI("ftp", "b", ""), BackendOptions())


def test_sovereign_cloud_url_keeps_its_endpoint_suffix(monkeypatch) -> None:
    from silofs.node.backends.azure import resolve_auth
    from silofs.node.backends.base import BackendOptions

    monkeypatch.delenv("AZURE_STORAGE_BLOB_ENDPOINT", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_KEY", "a2V5")
    uri = parse_uri("https://acct.blob.core.chinacloudapi.cn/data/train")
    assert uri.canonical == "az://acct/data/train/"
    auth = resolve_auth(uri, BackendOptions())
    assert auth.account_url == "https://acct.blob.core.chinacloudapi.cn"


def test_a_uri_longer_than_an_lmdb_key_holds_is_refused_in_one_line() -> None:
    """A dataset's canonical URI keys LMDB rows (511 bytes at most): a 600-byte S3 prefix
    or local path failed the mount with "internal error: BadValsizeError"."""
    ok = "s3://b/" + "p" * (MAX_URI_BYTES - len("s3://b/") - 1)
    assert len(parse_uri(ok).canonical) == MAX_URI_BYTES
    for uri in ("s3://b/" + "p" * 600, "/data/" + "d" * 600, "az://acct/c/" + "日" * 200):
        with pytest.raises(
            UsageError, match=f"bytes: silofs names a dataset in at most {MAX_URI_BYTES}"
        ):
            parse_uri(uri)


def test_aws_endpoint_url_is_the_default_endpoint_of_s3_datasets_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rule for the CLI, the S3 backend and the cluster's shareable(): a given
    endpoint wins; AWS_ENDPOINT_URL names an S3 endpoint, never gs:// or az://'s."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    s3, gs = parse_uri("s3://b/p/"), parse_uri("gs://b/p/")
    assert store_endpoint(s3, None) == "http://127.0.0.1:9000"
    assert store_endpoint(s3, "http://minio:9000") == "http://minio:9000"
    assert store_endpoint(gs, None) is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")
    assert store_endpoint(s3, None) is None


@pytest.mark.parametrize(
    ("uri", "canonical"),
    [
        ("s3://b/data#1/x", "s3://b/data#1/x/"),
        ("gs://b/a?b/c", "gs://b/a?b/c/"),
        ("az://acct/cont/p#q?r", "az://acct/cont/p#q?r/"),
        ("file:///tmp/a#b", "file:///tmp/a#b/"),
    ],
)
def test_hash_and_question_mark_are_key_characters_not_url_parts(uri: str, canonical: str) -> None:
    assert parse_uri(uri).canonical == canonical


def test_an_azure_url_with_a_sas_token_is_refused_without_repeating_it() -> None:
    with pytest.raises(UsageError) as exc:
        parse_uri("https://acct.blob.core.windows.net/c/p?sv=2024&sig=SECRET")
    assert "SECRET" not in str(exc.value) and "AZURE_STORAGE_SAS_TOKEN" in str(exc.value)


@pytest.mark.parametrize(
    ("uri", "scheme", "where", "canonical"),
    [
        ("/data/%41", "file", "/data/%41", "file:///data/%2541/"),
        ("file:///data/100%25", "file", "/data/100%", "file:///data/100%25/"),
        ("s3://b/x%2541", "s3", "x%41/", "s3://b/x%2541/"),
        ("gs://b/50%25/off", "gs", "50%/off/", "gs://b/50%25/off/"),
        ("az://acct/c/p%2525", "az", "p%25/", "az://acct/c/p%2525/"),
    ],
)
def test_a_percent_in_a_name_survives_the_daemons_parse_of_the_canonical_uri(
    uri: str, scheme: str, where: str, canonical: str
) -> None:
    """The CLI sends the canonical URI and the daemon parses it again: a "%" written as
    is in the canonical was decoded a second time, and /data/%41 mounted /data/A."""
    parsed = parse_uri(uri)
    assert parsed.scheme == scheme
    assert (parsed.bucket if scheme == "file" else parsed.prefix) == where
    assert parsed.canonical == canonical
    assert parse_uri(parsed.canonical) == parsed


def test_a_dataset_name_that_is_not_utf8_is_one_line() -> None:
    """A directory named with a byte that is not UTF-8 reaches Python surrogate-escaped:
    `silofs mount` and `warm` failed with the daemon's "request body holds text that is
    not UTF-8 (a lone surrogate?)", and silofs-ctl's allocate-cache, refresh, forget
    and admission with a UnicodeEncodeError traceback (quoting it for the URL)."""
    from click.testing import CliRunner
    from silofs_ctl.cli import main

    with pytest.raises(UsageError) as info:
        parse_uri("/data/bad\udcff")
    assert str(info.value) == (
        "dataset URI '/data/bad\\xff' is not UTF-8 text: silofs names datasets in UTF-8 "
        "(rename the directory, or link to it from a UTF-8 name)"
    )
    with pytest.raises(UsageError, match="not UTF-8 text"):
        parse_uri("s3://bucket/p\udcff/")
    for args in (
        ["allocate-cache", "/data/bad\udcff", "1GB"],
        ["refresh", "/data/bad\udcff"],
        ["forget", "s3://b/\udcff"],
        ["admission", "/data/bad\udcff", "lru"],
    ):
        res = CliRunner().invoke(main, [*args, "--socket", "/nonexistent/silofs.sock"])
        assert res.exit_code == 2, (args, res.output)  # a usage error
        (line,) = res.output.strip().splitlines()
        assert line.startswith("silofs-ctl: error: DATASET '") and line.endswith(
            "' is not UTF-8 text: silofs names datasets in UTF-8"
        ), line


@pytest.mark.parametrize("command", ["allocate-cache", "refresh", "forget", "admission"])
def test_an_empty_dataset_name_is_one_line(command: str) -> None:
    """`refresh ''` asked GET /v1/datasets/ and answered "no such endpoint"."""
    from click.testing import CliRunner
    from silofs_ctl.cli import main

    extra = {"allocate-cache": ["1GB"], "admission": ["lru"]}.get(command, [])
    res = CliRunner().invoke(main, [command, "", *extra, "--socket", "/nonexistent/s.sock"])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        "silofs-ctl: error: DATASET is empty: give a dataset's URI, local path or short name"
    ]


SECRET_ENDPOINTS = [
    "http://AKIAKEY:SUPERSECRET@127.0.0.1:9000",
    "https://SUPERSECRET@minio.example",
    "https://acct.blob.core.windows.net/?sv=2024&sig=SUPERSECRET",
]


@pytest.mark.parametrize("endpoint", SECRET_ENDPOINTS)
def test_an_endpoint_holding_credentials_is_refused_without_repeating_it(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """An endpoint is repeated in the store's errors: the dataset's status (every local
    user reads it), the daemon's log, the clients' error lines. One with USER:SECRET@
    (or a SAS query) put the secret in all of them; it is refused wherever it comes
    from (a flag or [backend] endpoint_url, AWS_ENDPOINT_URL, the open request's
    endpoint_url, AZURE_STORAGE_BLOB_ENDPOINT, STORAGE_EMULATOR_HOST), the message
    naming where and not the URL."""
    from silofs.config import load_node_settings

    def refused(call, where: str) -> None:
        with pytest.raises(UsageError) as exc:
            call()
        assert "SUPERSECRET" not in str(exc.value) and where in str(exc.value)
        assert "holds no credentials" in str(exc.value)

    s3 = parse_uri("s3://bucket/p/")
    refused(lambda: store_endpoint(s3, endpoint), "endpoint URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    refused(lambda: store_endpoint(s3, None), "AWS_ENDPOINT_URL")
    refused(lambda: open_backend(s3, BackendOptions()), "AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    refused(lambda: open_backend(s3, BackendOptions(endpoint_url=endpoint)), "endpoint URL")
    refused(
        lambda: load_node_settings(None, cache_dir=str(tmp_path), endpoint_url=endpoint),
        "endpoint_url",
    )
    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", endpoint)
    monkeypatch.setenv("AZURE_STORAGE_KEY", "a2V5")
    refused(lambda: open_backend(parse_uri("az://acct/c/p"), BackendOptions()), "Azure")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    refused(lambda: open_backend(parse_uri("gs://b/p"), BackendOptions()), "GCS")


def test_a_plain_endpoint_is_kept() -> None:
    s3 = parse_uri("s3://bucket/p/")
    for url in ("http://127.0.0.1:9000", "https://s3.example/path", "http://[::1]:9000/"):
        assert store_endpoint(s3, url) == url
