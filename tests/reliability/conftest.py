"""Reliability tests reuse the real-node fixtures of the integration tests."""

from tests.integration.conftest import make_node  # noqa: F401  (a fixture, by import)
