"""Per-mount store flags users bring from mountpoint-s3 and the AWS CLI: --profile,
--no-sign-request, --requester-pays, --region; --read-only accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from silofs.node.backends.base import BackendOptions
from silofs.node.backends.s3 import S3Backend
from silofs.uri import parse_uri
from tests.support.fixtures import needs_fuse
from tests.support.node import Node, mounted

from .test_bad_input import assert_one_line_error


@pytest.mark.servers
def test_requester_pays_sends_the_header_on_every_read(s3_server, monkeypatch, bucket_name):
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, {"a/x.bin": b"0123456789" * 100})
    backend = S3Backend(
        parse_uri(f"s3://{bucket_name}/a/"),
        BackendOptions(endpoint_url=s3_server.endpoint_url, extra={"requester_pays": "true"}),
    )
    seen: list[tuple[str, str | None]] = []

    def record(request, **_kwargs) -> None:  # noqa: ANN001 - botocore's AWSPreparedRequest
        seen.append((request.method, request.headers.get("x-amz-request-payer")))

    backend.client().meta.events.register("before-send.s3", record)
    [obj] = list(backend.list())
    assert backend.get_range(obj, 10, 20) == (b"0123456789" * 3)[:20]
    assert len(seen) == 2 and all(payer == b"requester" for _, payer in seen), seen


@needs_fuse
@pytest.mark.fuse
@pytest.mark.servers
def test_profile_and_no_sign_request_are_per_mount(
    make_node, s3_server, monkeypatch, bucket_name, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    s3_server.create(bucket_name, {"k.txt": b"public bytes"})
    # The daemon has no credentials of its own, only a profile in a credentials file.
    creds = tmp_path / "credentials"
    creds.write_text("[other]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    node: Node = make_node()
    node.expect_errors(r"no usable AWS credentials")
    uri = f"s3://{bucket_name}/"
    ep = ("--endpoint-url", s3_server.endpoint_url)

    mp = tmp_path / "m0"
    mp.mkdir()
    node.mountpoints.append(str(mp))
    res = node.run("mount", uri, str(mp), *ep)
    assert_one_line_error(res, "credentials")
    assert not mounted(mp)

    # --profile opens the dataset with that profile (the dataset was not in use).
    mp1 = node.mount(uri, tmp_path / "m1", *ep, "--profile", "other", "--read-only")
    assert (mp1 / "k.txt").read_bytes() == b"public bytes"
    assert node.run("unmount", str(mp1)).returncode == 0

    # Anonymous: unsigned requests, no credentials needed at all.
    mp2 = node.mount(uri, tmp_path / "m2", *ep, "--no-sign-request")
    assert (mp2 / "k.txt").read_bytes() == b"public bytes"
    # While mounted, other store options for the same dataset would be ignored: refused.
    mp3 = tmp_path / "m3"
    mp3.mkdir()
    node.mountpoints.append(str(mp3))
    res = node.run("mount", uri, str(mp3), *ep, "--profile", "other")
    assert_one_line_error(res, "would be ignored")


def test_store_flags_are_checked_against_the_store(tmp_path: Path) -> None:
    from .test_cli_usage import run

    res = run("mount", "gs://b/p", str(tmp_path), "--region", "eu-west-1")
    assert_one_line_error(res, "--region is for s3://")
    res = run("mount", "s3://b/", str(tmp_path), "--no-sign-request", "--profile", "x")
    assert_one_line_error(res, "drop --profile")
    res = run("mount", "s3://b/", str(tmp_path), "--azure-identity")
    assert_one_line_error(res, "--azure-identity is for az://")
