"""gcs.py's listing records made from objects.list's JSON items: `updated` read as the
library reads it (fraction truncated to microseconds), content ids in each form (MD5,
a composite object's CRC32C, neither), an object without `updated`. Side by side with
the library's Blob objects on fake-gcs-server: tests/integration/test_gcs_lean.py."""

from __future__ import annotations

import pytest
from google.cloud._helpers import _rfc3339_nanos_to_datetime

from silofs.node.backends.gcs import _content_id, _listed, _rfc3339


@pytest.mark.parametrize(
    "text",
    [
        "2024-01-02T03:04:05Z",
        "2024-01-02T03:04:05.1Z",
        "2024-01-02T03:04:05.123Z",
        "2024-01-02T03:04:05.123456Z",
        "2024-01-02T03:04:05.1234567Z",
        "2024-01-02T03:04:05.999999999Z",
        "1999-12-31T23:59:59.000001Z",
    ],
)
def test_updated_is_read_as_the_library_reads_it(text: str) -> None:
    assert _rfc3339(text) == _rfc3339_nanos_to_datetime(text).timestamp()


def test_items_become_records_with_the_content_id_of_each_form() -> None:
    items = [
        {"name": "ds/a", "size": "5", "generation": "17", "md5Hash": "bWQ1", "crc32c": "Y3Jj",
         "updated": "2024-01-02T03:04:05.5Z"},
        {"name": "ds/b", "size": "0", "generation": "18", "crc32c": "Y3Jj",
         "updated": "2024-01-02T03:04:05.5Z"},
        {"name": "ds/c", "size": "7", "generation": "19"},
    ]  # fmt: skip
    a, b, c = _listed(items)
    assert (a.name, a.size, a.generation, a.mtime) == ("ds/a", 5, 17, 1704164645.5)
    assert _content_id(a) == "gs-md5:bWQ1:5:17"
    assert _content_id(b) == "gs-crc32c:Y3Jj:0:18"
    assert _content_id(c) == "gs-none:7:19" and c.mtime == 0.0
