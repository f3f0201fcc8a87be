"""The S3 listing's own page parser (silofs/node/backends/s3.py _ListPage) against
botocore's: the same objects, prefixes and continuation for the pages S3 sends, and
pages it does not expect left to botocore. Real stores are in test_backend_conformance.py."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote
from xml.sax.saxutils import escape

import botocore.session
from botocore.parsers import create_parser

from silofs.node.backends.s3 import _EMPTY_PAGE, _PAGE_KEY, _ListPage, _parse_list_page

KEYS = [
    "ds/plain.txt",
    "ds/with space.txt",
    "ds/ünïcödé/日本語 ファイル.bin",
    "ds/plus+and%percent=equals&amp<lt>.bin",
    "ds/tab\tand\x7fdel",
]


def _page(keys: list[str], prefixes: list[str], url: bool, token: str | None) -> bytes:
    q = (lambda k: quote(k, safe="/")) if url else escape
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
        "<Name>b</Name><Prefix>ds/</Prefix><MaxKeys>1000</MaxKeys>",
        f"<KeyCount>{len(keys)}</KeyCount>",
        f"<IsTruncated>{'true' if token else 'false'}</IsTruncated>",
        "<EncodingType>url</EncodingType>" if url else "",
    ]
    for i, k in enumerate(keys):
        parts.append(
            f"<Contents><Key>{q(k)}</Key><LastModified>2024-02-0{i + 1}T10:20:3{i}.123Z"
            f'</LastModified><ETag>"{i:032x}"</ETag><Size>{i * 1000}</Size>'
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )
    for p in prefixes:
        parts.append(f"<CommonPrefixes><Prefix>{q(p)}</Prefix></CommonPrefixes>")
    if token:
        parts.append(f"<NextContinuationToken>{escape(token)}</NextContinuationToken>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


def _botocore(body: bytes, url: bool) -> _ListPage:
    model = botocore.session.get_session().get_service_model("s3")
    shape = model.operation_model("ListObjectsV2").output_shape
    parsed = create_parser("rest-xml").parse(
        {"status_code": 200, "headers": {}, "body": body}, shape
    )
    if url:  # what botocore's after-call handler does for the encoding it asked for
        from urllib.parse import unquote

        for o in parsed.get("Contents", []):
            o["Key"] = unquote(o["Key"])
        for p in parsed.get("CommonPrefixes", []):
            p["Prefix"] = unquote(p["Prefix"])
    return _ListPage.from_parsed(parsed)


def test_pages_parse_as_botocore_parses_them() -> None:
    for url in (True, False):
        for token in (None, "k:ds/x&y"):
            body = _page(KEYS, ["ds/a b/", "ds/ü&/"], url, token)
            ours = _ListPage.from_xml(body)
            assert ours == _botocore(body, url)
            assert [i[0] for i in ours.items] == KEYS
            assert ours.prefixes == ["ds/a b/", "ds/ü&/"]
            assert ours.truncated == bool(token) and ours.token == token
            first = datetime(2024, 2, 1, 10, 20, 30, 123000, tzinfo=UTC)
            assert ours.items[0][3] == first.timestamp()
            assert ours.items[1][1:3] == (1000, f"{1:032x}")


def test_the_hook_hands_botocore_an_empty_page_and_keeps_the_result() -> None:
    body = _page(KEYS, [], True, None)
    response = {"status_code": 200, "headers": {}, "body": body}
    custom: dict = {}
    _parse_list_page(response_dict=response, customized_response_dict=custom)
    assert response["body"] == _EMPTY_PAGE
    assert [i[0] for i in custom[_PAGE_KEY].items] == KEYS


def test_errors_and_unexpected_pages_are_left_to_botocore() -> None:
    error = b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>"
    odd = b"<ListBucketResult xmlns='http://s3.amazonaws.com/doc/2006-03-01/'><Contents>"
    bad_size = _page(KEYS[:1], [], False, None).replace(b"<Size>0</Size>", b"<Size>x</Size>")
    for status, body in ((403, error), (200, odd), (200, bad_size)):
        response = {"status_code": status, "headers": {}, "body": body}
        custom: dict = {}
        _parse_list_page(response_dict=response, customized_response_dict=custom)
        assert response["body"] == body and custom == {}
