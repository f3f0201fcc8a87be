"""The simulator's Alluxio model against an exact item-level LRU on small traces.

Owns: the check that the flow-level LRU model (sim_lru's Che holdings, found at re-plans
only, and the random-once-per-epoch hit profile) gives per-job hit ratios close to an
exact LRU that sees every item read of several jobs over datasets sharing one pool.
Rates are the jobs' f* (the link is unlimited), so both sides read the same items at
the same times and only the cache model differs.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass

import pytest
from silofs_ctl.policies.base import water_fill
from silofs_ctl.scenario import parse_scenario
from silofs_ctl.simulator import Simulation

ITEM = 1_000_000  # bytes per item: 1 MB


@dataclass(frozen=True)
class Reader:
    name: str
    dataset: str
    items_per_s: float
    submit: float
    epochs: int


def exact_lru_run(
    readers: list[Reader],
    sizes: dict[str, int],
    capacity: int,
    seed: int,
    link: float = math.inf,
) -> dict[str, tuple[list[float], float]]:
    """Per reader, the hit ratio of each epoch and the completion time in one item-level
    LRU of `capacity` items.

    Every reader reads its dataset once per epoch in a fresh random order from its
    submission; reads of all readers are applied in time order. A reader's rate is the
    flow model's, min(f*, share / (1 - hit)) with the link (items/s) shared max-min by
    f* x (1 - hit), where hit is what it measured over its last `window` reads (f* when
    the link is unlimited); rates are found again every `every` reads."""
    rng = random.Random(seed)
    order = {r.name: iter(()) for r in readers}
    epoch = {r.name: -1 for r in readers}
    left = {r.name: r.epochs * sizes[r.dataset] for r in readers}
    recent: dict[str, deque[int]] = {r.name: deque() for r in readers}
    window, every = 50, 20
    cache: OrderedDict[tuple[str, int], None] = OrderedDict()
    hits = {r.name: [0] * r.epochs for r in readers}
    done: dict[str, float] = {}
    by_name = {r.name: r for r in readers}
    rate = {r.name: r.items_per_s for r in readers}
    due = [(r.submit, r.name) for r in readers]  # next read of each reader
    heapq.heapify(due)
    reads = 0
    while due:
        now, name = heapq.heappop(due)
        r = by_name[name]
        item = next(order[name], None)
        if item is None:
            epoch[name] += 1
            order[name] = iter(rng.sample(range(sizes[r.dataset]), sizes[r.dataset]))
            item = next(order[name])
        key = (r.dataset, item)
        hit = key in cache
        if hit:
            hits[name][epoch[name]] += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        recent[name].append(hit)
        if len(recent[name]) > window:
            recent[name].popleft()
        left[name] -= 1
        if left[name] == 0:
            done[name] = now
        else:
            heapq.heappush(due, (now + 1.0 / rate[name], name))
        reads += 1
        if reads % every == 0 and not math.isinf(link):
            rate = flow_rates(readers, recent, done, link, rate)
    out = {}
    for r in readers:
        ratios = [h / sizes[r.dataset] for h in hits[r.name]]
        out[r.name] = (ratios, done[r.name] - r.submit)
    return out


def flow_rates(
    readers: list[Reader],
    recent: dict[str, deque[int]],
    done: dict[str, float],
    link: float,
    old: dict[str, float],
) -> dict[str, float]:
    """The flow model's rates at the hit ratios the readers measured lately."""
    hit = {r.name: sum(recent[r.name]) / max(1, len(recent[r.name])) for r in readers}
    demands = {r.name: r.items_per_s * (1.0 - hit[r.name]) for r in readers if r.name not in done}
    shares = water_fill(link, demands)
    out = dict(old)
    for name, share in shares.items():
        ceiling = next(r.items_per_s for r in readers if r.name == name)
        h = hit[name]
        out[name] = ceiling if h >= 1.0 else min(ceiling, share / (1.0 - h))
    return out


def scenario_text(readers: list[Reader], sizes: dict[str, int], capacity: int, link: float) -> str:
    io = "unlimited" if math.isinf(link) else f"{link * ITEM}"
    lines = [
        f'[cluster]\nremote_io = "{io}"',
        f'[[cluster.nodes]]\ngpus = {len(readers)}\ncache = "{capacity * ITEM}"',
    ]
    declared: set[str] = set()
    for r in readers:
        size = "" if r.dataset in declared else f'dataset_size = "{sizes[r.dataset] * ITEM}"\n'
        declared.add(r.dataset)
        lines.append(
            f'[[jobs]]\nname = "{r.name}"\nsubmit = "{r.submit}s"\ngpus = 1\n'
            f'dataset = "{r.dataset}"\n{size}ideal_io = "{r.items_per_s * ITEM}"\n'
            f"epochs = {r.epochs}"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Case:
    readers: list[Reader]
    sizes: dict[str, int]
    capacity: int  # items
    link: float  # items/s
    hit_tol: float  # steady hit ratio, absolute
    jct_tol: float  # relative


CASES = {
    # One dataset per job, the link unlimited: Che's holdings and the hit profile alone.
    "apart": Case(
        [
            Reader("fast", "small", 5.0, 0.0, 12),
            Reader("slow-1", "big-1", 2.0, 0.0, 4),
            Reader("slow-2", "big-2", 1.5, 200.0, 4),
        ],
        {"small": 600, "big-1": 2500, "big-2": 2000},
        2000,
        math.inf,
        0.03,
        0.0,
    ),
    # The same behind a link that cannot feed them all: the holdings at the rates they
    # lead to (found at re-plans), and the rates at the hit ratios they get.
    "apart-link": Case(
        [
            Reader("fast", "small", 5.0, 0.0, 12),
            Reader("slow-1", "big-1", 2.0, 0.0, 4),
            Reader("slow-2", "big-2", 1.5, 200.0, 4),
        ],
        {"small": 600, "big-1": 2500, "big-2": 2000},
        2000,
        2.5,
        0.05,
        0.08,
    ),
    # Two jobs on one dataset: the model takes each as alone in an LRU of the dataset's
    # holding, but the other reader's reads keep items recent too, so it under-estimates
    # their hits (by about a third here); kept as the model's known gap.
    "shared": Case(
        [
            Reader("a", "d1", 4.0, 0.0, 6),
            Reader("b", "d1", 2.0, 300.0, 4),
            Reader("c", "d2", 3.0, 0.0, 8),
        ],
        {"d1": 2000, "d2": 1500},
        1800,
        math.inf,
        0.2,
        0.0,
    ),
}


def steady(ratios: list[float]) -> float:
    """Mean hit ratio of the epochs after the first (the first is cold, or not steady)."""
    rest = ratios[1:]
    return sum(rest) / len(rest)


@pytest.mark.parametrize("name", sorted(CASES))
def test_alluxio_model_is_close_to_an_exact_item_level_lru(name: str) -> None:
    case = CASES[name]
    exact = exact_lru_run(case.readers, case.sizes, case.capacity, seed=5, link=case.link)
    text = scenario_text(case.readers, case.sizes, case.capacity, case.link)
    result = Simulation(parse_scenario(text), "fifo", "alluxio").run()
    model = {j.name: j for j in result.jobs}
    for r in case.readers:
        ratios, jct = exact[r.name]
        print(
            f"{name} {r.name}: steady hit exact {steady(ratios):.3f} "
            f"model {steady(model[r.name].epoch_hit_ratios):.3f}; "
            f"JCT exact {jct:.0f}s model {model[r.name].jct:.0f}s"
        )
    for r in case.readers:
        ratios, jct = exact[r.name]
        got = model[r.name]
        assert steady(got.epoch_hit_ratios) == pytest.approx(steady(ratios), abs=case.hit_tol)
        if case.jct_tol:
            assert got.jct == pytest.approx(jct, rel=case.jct_tol), r.name
