"""Shared pytest wiring: servers, nodes and marks come from tests/support/fixtures.py.

Hypothesis runs without its per-example deadline (200 ms by default): no property here
promises a time, and one example stalled past 250 ms (a full collection of the suite's
heap, a busy 2-core host) failed its test as DeadlineExceeded, or as FlakyFailure when
the replay was quick. Bounds on time are asserted where they are promised.
"""

from hypothesis import settings

settings.register_profile("silofs", deadline=None)
settings.load_profile("silofs")

pytest_plugins = ["tests.support.fixtures"]
