"""Shared pytest wiring: servers, nodes and marks come from tests/support/fixtures.py."""

pytest_plugins = ["tests.support.fixtures"]
