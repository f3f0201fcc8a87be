"""The daemon serves a mount only the version it listed, and replaces bad cached values.

Owns, in-process (a Daemon without its socket, a local directory as the store): a chunk
request naming a version no listing generation has is VersionMismatchError (409 on the
socket), counted in status and /metrics, and never answered with bytes; a cached value
that fails verification or is of format 1 is refetched and replaced, not missed forever.
The same on real FUSE mounts: tests/integration/test_one_version.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from silofs.cache.format import ChunkRef, StaleFormatError, decode_header, verify_chunk
from silofs.errors import VersionMismatchError
from silofs.node.daemon import Daemon
from silofs.node.metrics import render
from silofs.node.views import dataset_view, status_view
from tests.unit.inprocess import listed, mounted, running
from tests.unit.test_chunk_format import GOLDEN_V1


def test_a_request_for_another_version_is_refused(daemon: Daemon, bucket: Path) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            obj = listed(d, ds, "f1.bin")
            data, _ = await d.get_chunk(m, "f1.bin", 0, False, obj.version)
            assert data == bytes([1]) * len(data)
            with pytest.raises(VersionMismatchError, match="changed since this mount listed"):
                await d.get_chunk(m, "f1.bin", 0, False, "a-version-no-listing-has")
            assert dataset_view(d, ds)["version_mismatches"] == 1
            uri = ds.uri.canonical
            text = render(status_view(d))
            assert f'silofs_dataset_version_mismatches_total{{dataset="{uri}"}} 1' in text

    trio.run(main)


def test_a_bad_cached_value_is_replaced_not_missed_forever(
    daemon: Daemon,
    bucket: Path,
) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            obj = listed(d, ds, "f2.bin")
            ref = ChunkRef.of(obj, m.chunk_size, 0)
            # A format-1 value under the chunk's key (as an older silofs left it).
            with d.store.env.begin(write=True) as txn:
                txn.put(ref.key, GOLDEN_V1, db=d.store.db(b"chunks"))
            data, source = await d.get_chunk(m, "f2.bin", 0, False, obj.version)
            assert source == "remote" and data == bytes([2]) * ref.length

            def replaced() -> bool:
                with d.store.read_txn() as txn:
                    value = txn.get(ref.key, db=d.store.db(b"chunks"))
                    try:
                        verify_chunk(value, obj.content_id, m.chunk_size, 0, ref.length)
                    except StaleFormatError:
                        return False
                    return decode_header(value).length == ref.length

            with trio.fail_after(10):
                while not replaced():
                    await trio.sleep(0.01)
            assert ds.fetch.corrupt_chunks == 0  # stale, not corrupt
            data, source = await d.get_chunk(m, "f2.bin", 0, False, obj.version)
            assert source == "cache" and data == bytes([2]) * ref.length

    trio.run(main)


def test_a_refresh_makes_chunks_of_changed_objects_the_first_victims(
    daemon: Daemon,
    bucket: Path,
) -> None:
    async def main() -> None:
        async with running(daemon) as d:
            ds, m = await mounted(d, bucket)
            refs = {}
            for key in ("f0.bin", "f1.bin", "f2.bin"):
                obj = listed(d, ds, key)
                await d.get_chunk(m, key, 0, False, obj.version)
                refs[key] = ChunkRef.of(obj, m.chunk_size, 0)
            await d.writer.flush()
            with d.store.env.begin() as txn:
                assert all(d.store.owns(txn, ds.id, r.key) for r in refs.values())
            (bucket / "f1.bin").write_bytes(b"new bytes")  # changed
            (bucket / "f2.bin").unlink()  # deleted
            await d.catalog.open_dataset(f"file://{bucket}/", True)
            with trio.fail_after(30):
                while ds.state != "ready" or ds.stale_chunks < 2:
                    await trio.sleep(0.01)
            assert ds.stale_chunks == 2
            with d.store.env.begin() as txn:
                cur = txn.cursor(db=d.store.db(b"stale"))
                rows = {bytes(k[8:]) for k, _ in cur}
            assert rows == {refs["f1.bin"].key, refs["f2.bin"].key}

    trio.run(main)
