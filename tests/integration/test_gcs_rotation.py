"""A GCS key rotated in its key file, end to end: google-auth's real service-account
token flow against a token endpoint here, and fake-gcs-server behind the fault proxy
refusing the old key's token (fake-gcs-server itself accepts any request).

Owns: the daemon's GCS backend reading its key file again when the store refuses the
token of the key it read first, and only then (base.RetryingBackend._renew).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from silofs.errors import AccessDeniedError
from silofs.node.backends import base
from silofs.node.backends.base import BackendOptions
from silofs.node.backends.gcs import GCSBackend
from silofs.uri import parse_uri
from tests.support.faultproxy import Fault, FaultPlan, FaultProxy
from tests.support.servers import GCSServer, clean_env, service_account_key

pytestmark = pytest.mark.servers


class _TokenEndpoint(BaseHTTPRequestHandler):
    """OAuth2's token endpoint for service-account JWTs: the access token it grants
    names the key that signed the assertion (its header's kid), "tok-<kid>"."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
        head = form["assertion"][0].split(".")[0]
        kid = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))["kid"]
        body = json.dumps({"access_token": f"tok-{kid}", "expires_in": 3600}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def token_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/token"
    server.shutdown()
    server.server_close()


def test_a_rotated_gcs_key_file_is_read_again_when_the_store_refuses_the_old_key(
    gcs_server: GCSServer, token_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The key file is rewritten with a new key and the old one revoked: the store
    refuses the old key's token, and the next request reads the file again and is made
    with the new key's. A refusal while the file is unchanged stays a denial."""
    clean_env(monkeypatch)
    monkeypatch.setattr(base, "RENEW_SECONDS", 0.0)  # a look at every refusal
    gcs_server.create("rotation", {"ds/a.bin": b"a", "ds/b.bin": b"b"})
    key = tmp_path / "key.json"
    service_account_key(key, "old", token_url)
    up = urlsplit(gcs_server.endpoint_url)
    with FaultProxy(upstream=(up.hostname or "127.0.0.1", up.port or 80), faults=FaultPlan()) as p:
        opts = BackendOptions(
            endpoint_url=p.url, max_attempts=2, backoff_base=0.001, extra={"key_file": str(key)}
        )
        backend = GCSBackend(parse_uri("gs://rotation/ds/"), opts)
        infos = {i.key: i for i in backend.list()}
        assert sorted(infos) == ["a.bin", "b.bin"]
        old = Fault("http_403", header=("authorization", "Bearer tok-old"))
        p.set_plan(FaultPlan(faults=[old]))
        with pytest.raises(AccessDeniedError):  # the file as it was: a real denial
            backend.get_range(infos["a.bin"], 0, 1)
        service_account_key(key, "new", token_url)
        assert backend.get_range(infos["a.bin"], 0, 1) == b"a"
        assert backend.get_range(infos["b.bin"], 0, 1) == b"b"
        assert sorted(i.key for i in backend.list()) == ["a.bin", "b.bin"]
        assert p.stats["http_403"] == 2  # the denial, then the one that found the new key
        backend.close()
