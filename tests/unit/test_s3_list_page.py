"""The S3 listing's own page parsers (silofs/node/backends/s3lean.py ListPage: the regex
over S3's grammar and ElementTree for the rest) against botocore's: the same objects,
prefixes and continuation for the pages S3 sends, keys with XML's special characters,
unicode and entities round-tripping, and pages neither expects left to botocore. Real
stores are in test_backend_conformance.py and test_s3_lean.py."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote
from xml.sax.saxutils import escape

import botocore.session
import pytest
from botocore.parsers import create_parser

from silofs.node.backends.s3 import _EMPTY_PAGE, _PAGE_KEY, _page_from_parsed, _parse_list_page
from silofs.node.backends.s3lean import ListPage as _ListPage
from silofs.node.backends.s3lean import _parse_fast, xml_text

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
    return _page_from_parsed(parsed)


def test_pages_parse_as_botocore_parses_them() -> None:
    for url in (True, False):
        for token in (None, "k:ds/x&y"):
            body = _page(KEYS, ["ds/a b/", "ds/ü&/"], url, token)
            ours = _ListPage.from_xml(body)
            assert ours == _botocore(body, url)
            fast = _parse_fast(body)
            assert fast == ours  # the regex parser took it, and agrees
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


def _aws_page(keys: list[str], token: str | None) -> bytes:
    """A page as AWS writes it: ETags as &quot;, checksum elements, Owner, no EncodingType
    (keys XML-escaped), whitespace between elements as some stores pretty-print."""
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    ]
    parts.append("<Name>b</Name><Prefix>ds/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys>")
    parts.append(f"<IsTruncated>{'true' if token else 'false'}</IsTruncated>")
    for i, k in enumerate(keys):
        parts.append(
            f"<Contents>\n  <Key>{escape(k)}</Key>\n  <LastModified>2024-03-0{i + 1}T00:00:00.000Z"
            f"</LastModified><ETag>&quot;{i:032x}&quot;</ETag>"
            "<ChecksumAlgorithm>CRC64NVME</ChecksumAlgorithm>"
            "<ChecksumType>FULL_OBJECT</ChecksumType>"
            f"<Size>{i + 7}</Size><Owner><ID>x</ID></Owner>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )
    if token:
        parts.append(f"<NextContinuationToken>{escape(token)}</NextContinuationToken>")
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


def test_the_regex_parser_takes_aws_pages_with_entities_as_botocore_does() -> None:
    keys = ["ds/a&b<c>d\"e'f.bin", "ds/日本語/ü & ö.txt", "ds/&amp;literal&quot;"]
    token = "1w41l63U+&<>=/tok"
    body = _aws_page(keys, token)
    fast = _parse_fast(body)
    assert fast is not None and fast == _botocore(body, False)
    assert [i[0] for i in fast.items] == keys
    assert fast.token == token and fast.truncated
    assert fast.items[0][2] == f"{0:032x}" and fast.items[1][1] == 8


def test_character_references_and_the_predefined_entities() -> None:
    assert xml_text("a&#38;b&#x3C;&lt;&gt;&amp;&quot;&apos;&#x65E5;") == "a&b<<>&\"'日"
    for bad in ("a & b", "&nbsp;", "&#0;", "&#xD800;", "&#xFFFE;", "&amp"):
        with pytest.raises((ValueError, KeyError)):
            xml_text(bad)


@pytest.mark.parametrize(
    "change",
    [
        # Another element order, a comment, CDATA, a carriage return, a prefixed namespace,
        # an encoding other than UTF-8, an unknown entity: ElementTree's (or botocore's).
        lambda b: b.replace(b"<Key>", b"<Size>9</Size><Key>", 1).replace(
            b"</ETag><ChecksumAlgorithm>", b"</ETag><X/><ChecksumAlgorithm>", 1
        ),
        lambda b: b.replace(b"<Name>", b"<!-- hi --><Name>"),
        lambda b: b.replace(b"<Key>ds/", b"<Key><![CDATA[ds/]]>", 1),
        lambda b: b.replace(b"<Name>b", b"<Name>b\r"),
        lambda b: b.replace(b'encoding="UTF-8"', b'encoding="ISO-8859-1"'),
        lambda b: b.replace(b"ds/a", b"ds/&nbsp;a", 1),
    ],
)
def test_pages_outside_the_grammar_are_declined(change) -> None:  # type: ignore[no-untyped-def]
    body = change(_aws_page(["ds/a", "ds/b"], None))
    assert _parse_fast(body) is None


def test_a_prefixed_namespace_or_an_error_is_not_an_empty_page() -> None:
    prefixed = (
        b'<s3:ListBucketResult xmlns:s3="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<s3:IsTruncated>false</s3:IsTruncated><s3:Contents><s3:Key>k</s3:Key>"
        b"</s3:Contents></s3:ListBucketResult>"
    )
    error = b"<?xml version='1.0'?><Error><Code>SlowDown</Code></Error>"
    for body in (prefixed, error):
        assert _parse_fast(body) is None
    with pytest.raises(ValueError):
        _ListPage.from_bytes(error)


def test_a_contents_the_regex_cannot_read_sends_the_whole_page_to_elementtree() -> None:
    body = _aws_page(["ds/a", "ds/b"], None)
    # Size before Key in the second object only: counts differ, so no half-parsed page.
    odd = body.replace(b"<Key>ds/b</Key>", b"<Size>3</Size><Key>ds/b</Key>").replace(
        b"<Size>8</Size>", b""
    )
    assert _parse_fast(odd) is None
    page = _ListPage.from_bytes(odd)
    assert [(i[0], i[1]) for i in page.items] == [("ds/a", 7), ("ds/b", 3)]
