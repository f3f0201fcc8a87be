"""Shared pytest wiring: storage-server fixtures live in tests/servers.py."""

pytest_plugins = ["tests.servers"]
