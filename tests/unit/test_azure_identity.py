"""Azure Entra ID through azure-identity: when silofs uses DefaultAzureCredential."""

from __future__ import annotations

import pytest
from azure.identity import DefaultAzureCredential

from silofs.node.backends.azure import resolve_auth
from silofs.node.backends.base import BackendOptions
from silofs.uri import parse_uri

URI = parse_uri("az://acct/container/prefix/")
_ENV = (
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN", "AZURE_FEDERATED_TOKEN_FILE", "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_STORAGE_BLOB_ENDPOINT",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def test_asked_for_explicitly() -> None:
    auth = resolve_auth(URI, BackendOptions(extra={"credential": "default"}))
    assert isinstance(auth.credential, DefaultAzureCredential)
    assert "DefaultAzureCredential" in auth.source
    assert auth.account_url == "https://acct.blob.core.windows.net"


def test_workload_identity_and_service_principal_environments(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(tmp_path / "token"))
    assert isinstance(resolve_auth(URI, BackendOptions()).credential, DefaultAzureCredential)
    monkeypatch.delenv("AZURE_FEDERATED_TOKEN_FILE")
    for name in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET"):
        monkeypatch.setenv(name, "x")
    assert isinstance(resolve_auth(URI, BackendOptions()).credential, DefaultAzureCredential)


def test_not_by_default_and_keys_or_anonymous_win(monkeypatch) -> None:
    assert resolve_auth(URI, BackendOptions()).credential is None  # no IMDS probing
    opts = BackendOptions(extra={"credential": "default", "anonymous": "true"})
    assert resolve_auth(URI, opts).anonymous
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "sv=2020&sig=abc")
    auth = resolve_auth(URI, BackendOptions(extra={"credential": "default"}))
    assert "SAS" in auth.source
