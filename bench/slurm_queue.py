"""What the controller's Slurm source costs a round, in CPU seconds, as the queue grows.

Owns: a synthetic squeue answer of Q pending jobs (each with a silofs= comment naming one
of the running cluster's datasets, f*, epochs, 1-8 GPUs, a priority) in both forms
(`squeue --json` as Slurm 22.05 writes it, and the -O text form with its delimiter), and
the timing of: parsing each form; planning the same running cluster (bench/policies.py's
synthetic cluster, J running jobs) without and with the queue (the difference is the
SJF-SiloD ordering of the queue); and the priority permutation. CPU seconds, best of
--repeat, so the figures hold on a busy machine; without and with come from one run.
Never: runs squeue or scontrol (their own cost is slurmctld's: a real call on the test
fixture is printed by tests/integration/test_slurm.py's runs), or checks correctness
(tests/unit/test_ctl_slurm.py does).

    python bench/slurm_queue.py                  # J=1000 running; Q = 100, 1k, 10k queued
    python bench/slurm_queue.py --running 10000 --queued 10000 --policy sjf
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "silofs-ctl"))
sys.path.insert(0, str(ROOT / "bench"))

from policies import _api, synthetic  # noqa: E402
from silofs_ctl.plan import plan_allocations  # noqa: E402
from silofs_ctl.slurm import (  # noqa: E402
    TEXT_FIELDS,
    parse_json,
    parse_text,
    priority_targets,
)

MB = 10**6


def squeue_answers(n: int, datasets: list[str], seed: int = 2) -> tuple[str, str, str]:
    """(json, text, delimiter) for n pending jobs."""
    rng = random.Random(seed)
    delim = "~5f0c1d2e3a4b~"
    rows, text = [], []
    for i in range(n):
        job_id = 100_000 + i
        gpus = rng.choice((1, 2, 4, 8))
        comment = (
            f"silofs={rng.choice(datasets)} silofs.ideal_io={rng.randint(10, 900)}MB/s "
            f"silofs.epochs={rng.randint(1, 90)} run-{i}"
        )
        prio = rng.randint(1, 10_000)
        rows.append(
            {
                "job_id": job_id,
                "job_state": "PENDING",
                "comment": comment,
                "nodes": "",
                "node_count": 1,
                "tasks": 1,
                "tres_per_node": f"gres:gpu:{gpus}",
                "tres_req_str": f"cpu=1,node=1,gres/gpu={gpus}",
                "priority": prio,
                "user_name": "u",
                "submit_time": 1_700_000_000 + i,
            }  # fmt: skip
        )
        fields = [str(job_id), "PENDING", "1", "1", "", str(prio), "N/A", "N/A",
                  f"gres:gpu:{gpus}", "N/A", "u", comment]  # fmt: skip
        assert len(fields) == len(TEXT_FIELDS)
        text.append("".join(f + delim for f in fields) + "\n")
    return json.dumps({"jobs": rows}), "".join(text), delim


def cpu(fn: Any, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, default=1000, help="running jobs (J)")
    ap.add_argument("--queued", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--policy", default="sjf")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    api = _api()
    config, entries, seen, ideal = synthetic(api, args.running)
    config = replace(config, policy=args.policy)
    datasets = sorted({ds for s in seen.values() for ds in s.datasets})
    base, _ = cpu(lambda: plan_allocations(config, entries, seen, ideal), args.repeat)
    print(f"running jobs {args.running}, policy {args.policy}, CPU seconds (best of "
          f"{args.repeat}); plan without a queue: {base:.3f} s")  # fmt: skip
    print(f"{'queued':>7} {'json MB':>8} {'parse json':>11} {'parse text':>11} "
          f"{'plan+queue':>11} {'queue cost':>11} {'permute':>8}")  # fmt: skip
    for n in args.queued:
        js, text, delim = squeue_answers(n, datasets)
        t_json, jobs = cpu(lambda js=js: parse_json(js), args.repeat)
        t_text, jobs_t = cpu(lambda t=text, d=delim: parse_text(t, d), args.repeat)
        assert [j.id for j in jobs] == [j.id for j in jobs_t]
        t_plan, plan = cpu(
            lambda q=jobs: plan_allocations(config, entries, seen, ideal, q), args.repeat
        )
        assert len(plan.queue) == n and all(q.score is not None for q in plan.queue)
        order = [q.job for q in plan.queue]
        t_perm, _ = cpu(lambda o=order: priority_targets(o), args.repeat)
        print(f"{n:>7} {len(js) / 1e6:>8.1f} {t_json:>11.3f} {t_text:>11.3f} "
              f"{t_plan:>11.3f} {t_plan - base:>11.3f} {t_perm:>8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
