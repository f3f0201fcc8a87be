"""Where the S3 lean path (silofs/node/backends/s3lean.py) sends its requests: the
boto3 client's own resolution (virtual-hosted and regional on AWS, path-style for a
bucket name with dots and for custom endpoints), and the region it signs for. No
network: resolve()'s call is answered before it is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from silofs.node.backends.base import BackendOptions
from silofs.node.backends.s3 import S3Backend
from silofs.uri import parse_uri


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _lean(uri: str, **extra: str):  # noqa: ANN202 - LeanS3
    backend = S3Backend(parse_uri(uri), BackendOptions(extra=dict(extra)))
    backend.client()
    assert backend._lean is not None
    return backend._lean


@pytest.mark.parametrize(
    ("uri", "extra", "base", "region"),
    [
        ("s3://my-bucket/ds/", {"region": "eu-west-2"},
         "https://my-bucket.s3.eu-west-2.amazonaws.com", "eu-west-2"),
        ("s3://my.dotted.bucket/ds/", {"region": "eu-west-2"},
         "https://s3.eu-west-2.amazonaws.com/my.dotted.bucket", "eu-west-2"),
        ("s3://my-bucket/ds/", {"region": "us-east-1", "addressing_style": "path"},
         "https://s3.amazonaws.com/my-bucket", "us-east-1"),
    ],
)  # fmt: skip
def test_aws_endpoints_are_what_botocore_resolves(
    uri: str, extra: dict[str, str], base: str, region: str
) -> None:
    endpoint = _lean(uri, **extra).resolve()
    assert endpoint.base == base
    assert endpoint.region == region
    assert endpoint.list_url.rstrip("/") == base


def test_a_custom_endpoint_is_path_style_and_signed_for_the_client_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    lean = _lean("s3://bkt/ds/", region="ap-south-1")
    endpoint = lean.resolve()
    assert endpoint.base == "http://127.0.0.1:9000/bkt"
    assert endpoint.region == "ap-south-1"


def test_anonymous_needs_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    lean = _lean("s3://public-bucket/ds/", anonymous="true", region="us-west-2")
    endpoint = lean.resolve()
    assert endpoint.base == "https://public-bucket.s3.us-west-2.amazonaws.com"
    assert endpoint.region == "us-west-2"  # the client's: an unsigned request has no scope
    assert lean._credentials is None


def test_no_credentials_leaves_everything_to_botocore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    backend = S3Backend(parse_uri("s3://b/ds/"), BackendOptions())
    backend.client()
    assert backend._lean is None  # botocore raises NoCredentialsError -> AccessDenied


def test_lean_false_and_s3_express_are_botocore_only() -> None:
    for uri, extra in (("s3://b/ds/", {"lean": "false"}), ("s3://b--usw2-az1--x-s3/ds/", {})):
        backend = S3Backend(parse_uri(uri), BackendOptions(extra=extra))
        backend.client()
        assert backend._lean is None


def test_datasets_share_the_service_models_but_not_their_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each dataset's session used to load and parse S3's models again (~12 MB each): a
    user opening 64 cloud datasets cost the daemon ~0.8 GB. They share one loader now,
    and still resolve credentials each on their own (here: two profiles)."""
    creds = tmp_path / "credentials"
    creds.write_text(
        "[one]\naws_access_key_id = AKIDONE\naws_secret_access_key = s1\n"
        "[two]\naws_access_key_id = AKIDTWO\naws_secret_access_key = s2\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    a = S3Backend(parse_uri("s3://bucket-a/ds/"), BackendOptions(extra={"profile": "one"}))
    b = S3Backend(parse_uri("s3://bucket-b/ds/"), BackendOptions(extra={"profile": "two"}))
    ca, cb = a.client(), b.client()
    assert ca is not cb and ca._loader is cb._loader
    keys = {c._request_signer._credentials.access_key for c in (ca, cb)}
    assert keys == {"AKIDONE", "AKIDTWO"}
    # boto3 adds its data directory to a session's loader: shared, it is there once.
    paths = list(ca._loader.search_paths)
    S3Backend(parse_uri("s3://bucket-c/ds/"), BackendOptions(extra={"profile": "one"})).client()
    assert ca._loader.search_paths == paths and len(set(paths)) == len(paths)
