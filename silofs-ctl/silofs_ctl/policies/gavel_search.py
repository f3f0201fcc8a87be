"""The two searches of Gavel's max-min plan that its loop form (policies/gavel.py) and
its array form (policies/gavel_arrays.py) share, so both take the same steps and give
the same bits: Newton's method for a round's IO limit, and the bisection for how many
rounds IO allows. Owns no state and never builds a plan; each caller passes its own
IO tangent line and round test.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

log = logging.getLogger(__name__)


def newton_limit(
    line: Callable[[float], tuple[float, float]],
    start: float,
    budget: float,
    tol: float,
    steps: int,
) -> float:
    """Largest lam >= start with need(lam) <= budget, where line(lam) is (a, b), need's
    tangent a + b * lam at lam, by Newton's method on the concave piecewise-linear need
    (the loop form's _Loads.limit and gavel_arrays' both: one arithmetic, same bits)."""
    if math.isinf(budget):
        return math.inf
    lam = start
    for _ in range(steps):
        a, b = line(lam)
        if b <= 0.0:
            return math.inf if a <= budget * (1 + tol) else lam
        nxt = max(lam, (budget - a) / b)
        if nxt <= lam * (1 + 1e-15) + 1e-300:
            return nxt
        lam = nxt
    log.warning("max-min IO limit did not converge; using lam=%g", lam)
    return lam


def rounds_io_allows(io_ok: Callable[[int], bool], top: int) -> int:
    """How many leading rounds of the `top` (> 0) the GPUs allow also pass `io_ok`
    (which holds for a prefix of the rounds), by bisection. Usually IO binds in none
    of the rounds, or (just after it bound) in the first: those two are asked first."""
    if io_ok(top - 1):
        return top
    if not io_ok(0):
        return 0
    lo, hi = 1, top - 1  # io_ok holds below lo, fails at hi
    while lo < hi:
        mid = (lo + hi) // 2
        if io_ok(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo
