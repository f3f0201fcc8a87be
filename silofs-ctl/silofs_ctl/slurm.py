"""The controller's Slurm source: the jobs slurmctld knows, and SJF order fed back as priority.

Owns: asking slurmctld (through `squeue`) for pending and running jobs each round (id,
state, nodes, GPUs from the TRES/gres fields, priority, and the `silofs=` tokens of the
comment, docs/CONTROLLER.md "Slurm"), with a timeout and a bound on the output; the
permutation of the managed pending jobs' priorities that puts them in a given order; and
running `scontrol update JobId=N Priority=P` for it.
Never: plans (plan.py orders the queue), talks to a node daemon, touches a job whose
comment has no `silofs=` token, releases a held job (priority 0 is a hold to Slurm), or
lets slurmctld being down stop a round (the caller gets a one-line SlurmError).

Two ways to read the queue. `squeue --json` (Slurm 21.08 and later; older answers
"unrecognized option") is parsed tolerantly: numbers may be plain or {"set", "number"}
objects and the state a string or a list, as the data_parser versions differ. Else a
fixed `squeue -O` format whose every field ends with a delimiter made of a random nonce
drawn for each call: the comment is the job owner's free text (it may hold "|", tabs or
newlines), but it cannot hold a string drawn after it was written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import selectors
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from silofs.errors import UsageError
from silofs.units import count, is_digits, parse_rate

log = logging.getLogger(__name__)

# States a job is "pending" or "running" in, for the controller. COMPLETING is over: its
# GPUs are being released and its epilog unmounts.
PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
RUNNING = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "RESIZING"})
# A hostlist longer than this is refused (a job's NodeList, expanded).
MAX_HOSTS = 100_000
# What one line of an error may carry.
MAX_ERROR = 200


class SlurmError(Exception):
    """slurmctld could not be asked or answered nonsense; the message is one line."""


@dataclass(frozen=True)
class SlurmConfig:
    """[slurm] in controller.toml (configs/controller.toml documents each key)."""

    squeue: str = "squeue"
    scontrol: str = "scontrol"
    poll: float = 10.0  # ask slurmctld at most this often; the last answer serves between
    timeout: float = 10.0  # per squeue / scontrol call
    max_output: int = 64 << 20  # bytes of squeue output; more is an error
    format: str = "auto"  # auto | json | text
    priority: str = "off"  # off | log | set
    max_priority_updates: int = 20  # scontrol calls per round


@dataclass(frozen=True)
class SlurmJob:
    """One job as slurmctld describes it, with the silofs tokens of its comment."""

    id: str  # numeric
    state: str  # PENDING, RUNNING, ...
    nodes: tuple[str, ...]  # allocated nodes (empty while pending)
    gpus: int  # of the whole job
    priority: int  # 0: held
    user: str = ""
    datasets: tuple[str, ...] = ()  # silofs= URIs as the comment writes them
    ideal_io: float | None = None
    epochs: float | None = None
    submit: float = 0.0  # epoch seconds

    @property
    def name(self) -> str:
        """The silofs job name the prolog mounts under."""
        return f"slurm-{self.id}"

    @property
    def managed(self) -> bool:
        """Does the comment name a dataset (a job the controller may reorder)?"""
        return bool(self.datasets)

    @property
    def pending(self) -> bool:
        return self.state in PENDING

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    @property
    def held(self) -> bool:
        return self.priority <= 0


def parse_comment(comment: str) -> tuple[tuple[str, ...], float | None, float | None]:
    """The prolog's tokens (configs/slurm/prolog.sh): datasets, f* (bytes/s), epochs.

    Whitespace-separated; `silofs=URI` repeatable, `silofs.ideal_io=RATE`,
    `silofs.epochs=N`; anything else is not ours. A value that does not parse is taken
    as not given (the prolog refuses such a job when it starts)."""
    datasets: list[str] = []
    ideal: float | None = None
    epochs: float | None = None
    for token in comment.split():
        key, _, value = token.partition("=")
        if not value:
            continue
        if key == "silofs":
            datasets.append(value)  # as written; plan.py matches it to a daemon's URI
        elif key == "silofs.ideal_io":
            try:
                rate = parse_rate(value, require_unit=True)  # as the prolog's register
            except UsageError:
                rate = None
            ideal = float(rate) if rate and rate > 0 else None
        elif key == "silofs.epochs":
            try:
                n = float(value)
            except ValueError:
                continue
            epochs = n if math.isfinite(n) and n > 0 else None
    return tuple(datasets), ideal, epochs


def gpu_count(tres: str) -> int | None:
    """GPUs in a TRES or gres string: "cpu=1,gres/gpu=2", "gres:gpu:a100:2",
    "gres/gpu:1", "gpu:2"; a bare "gres:gpu" is one. None: no GPU named."""
    if not tres or tres in ("N/A", "(null)"):
        return None
    typed = None
    for item in tres.split(","):
        item = item.strip()
        for prefix in ("gres:", "gres/"):
            item = item.removeprefix(prefix)
        parts = re.split("[:=]", item)
        if parts[0] != "gpu":
            continue
        n = int(parts[-1]) if len(parts) > 1 and is_digits(parts[-1]) else 1
        if len(parts) == 2 and "=" in item:
            return n  # "gres/gpu=N": the untyped total of a TRES string
        typed = (typed or 0) + n  # typed entries of a gres string add up
    return typed


def job_gpus(
    alloc: str, per_job: str, per_node: str, per_task: str, req: str, nodes: int, tasks: int
) -> int:
    """The whole job's GPUs: what it was given if running, else what it asked for."""
    for tres, times in ((alloc, 1), (per_job, 1), (per_node, nodes), (per_task, tasks)):
        n = gpu_count(tres)
        if n is not None:
            return n * max(1, times)
    return gpu_count(req) or 0


def expand_hostlist(text: str) -> tuple[str, ...]:
    """Slurm's compact host list: "gpu[01-03,7],cpu1" -> gpu01 gpu02 gpu03 gpu7 cpu1."""
    text = text.strip()
    if not text or text in ("(null)", "N/A", "None assigned"):
        return ()
    out: list[str] = []
    for part in _split_top(text):
        for host in _expand_one(part):
            out.append(host)
            if len(out) > MAX_HOSTS:
                raise SlurmError(f"host list of over {MAX_HOSTS} names")
    return tuple(out)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(part: str) -> Iterable[str]:
    open_at = part.find("[")
    if open_at < 0:
        yield part
        return
    close = part.find("]", open_at)
    if close < 0:
        raise SlurmError(f"bad host list {part[:MAX_ERROR]!r}")
    head, ranges, tail = part[:open_at], part[open_at + 1 : close], part[close + 1 :]
    for item in ranges.split(","):
        lo, _, hi = item.partition("-")
        if not is_digits(lo) or (hi and not is_digits(hi)):
            raise SlurmError(f"bad host list {part[:MAX_ERROR]!r}")
        width = len(lo)
        first, last = int(lo), int(hi) if hi else int(lo)
        if last - first > MAX_HOSTS:
            raise SlurmError(f"host list of over {MAX_HOSTS} names")
        for n in range(first, last + 1):
            for rest in _expand_one(tail):
                yield f"{head}{n:0{width}d}{rest}"


def _num(value: Any) -> float | None:
    """A number as squeue --json gives it: plain, or {"set": .., "infinite": .., "number"}."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _state(value: Any) -> str:
    if isinstance(value, list):  # newer data_parser: ["PENDING", "REQUEUED"]
        return str(value[0]) if value else ""
    return str(value or "")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def parse_json(text: str) -> list[SlurmJob]:
    """Pending and running jobs from `squeue --json` (which lists every job it knows)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SlurmError(f"squeue --json: not JSON ({exc})") from None
    rows = data.get("jobs") if isinstance(data, Mapping) else None
    if not isinstance(rows, list):
        raise SlurmError("squeue --json: no jobs list in its answer")
    jobs = []
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        state = _state(row.get("job_state"))
        job_id = _num(row.get("job_id"))
        if job_id is None or (state not in PENDING and state not in RUNNING):
            continue
        nodes = int(_num(row.get("node_count")) or 1)
        tasks = int(_num(row.get("tasks")) or _num(row.get("num_tasks")) or 1)
        datasets, ideal, epochs = parse_comment(_text(row.get("comment")))
        jobs.append(
            SlurmJob(
                id=str(int(job_id)),
                state=state,
                nodes=expand_hostlist(_text(row.get("nodes"))) if state in RUNNING else (),
                gpus=job_gpus(
                    _text(row.get("tres_alloc_str")) if state in RUNNING else "",
                    _text(row.get("tres_per_job")),
                    _text(row.get("tres_per_node")),
                    _text(row.get("tres_per_task")),
                    _text(row.get("tres_req_str")),
                    nodes,
                    tasks,
                ),
                priority=int(_num(row.get("priority")) or 0),
                user=_text(row.get("user_name")),
                datasets=datasets,
                ideal_io=ideal,
                epochs=epochs,
                submit=_num(row.get("submit_time")) or 0.0,
            )
        )
    return jobs


# The text format: squeue -O fields, each followed by the call's delimiter. The comment
# is last and the only free text; the others are Slurm's own words and numbers.
TEXT_FIELDS = (
    "JobID",
    "State",
    "NumNodes",
    "NumTasks",
    "NodeList",
    "PriorityLong",
    "tres-alloc",
    "tres-per-job",
    "tres-per-node",
    "tres-per-task",
    "UserName",
    "Comment",
)


def text_format(delim: str) -> str:
    # ":" with no size and a suffix: the whole value (no 20-character cut), then delim.
    return ",".join(f"{name}:{delim}" for name in TEXT_FIELDS)


def parse_text(text: str, delim: str) -> list[SlurmJob]:
    """Jobs from `squeue -h -t ... -O text_format(delim)`."""
    parts = text.split(delim)
    n = len(TEXT_FIELDS)
    if parts and not parts[-1].strip():
        parts.pop()  # the newline after the last record
    if len(parts) % n:
        raise SlurmError(f"squeue: {count(len(parts), 'field')}, not a whole number of jobs")
    jobs = []
    for i in range(0, len(parts), n):
        f = parts[i : i + n]
        f[0] = f[0].lstrip("\n")  # the newline that ended the previous record
        (job_id, state, nnodes, ntasks, nodelist, prio, alloc, per_job, per_node, per_task,
         user, comment) = f  # fmt: skip
        job_id, state = job_id.strip(), state.strip()
        if not is_digits(job_id):
            continue  # an array task (123_4) or het component (123+0): not ours to move
        if state not in PENDING and state not in RUNNING:
            continue
        nodes, tasks = _int(nnodes, 1), _int(ntasks, 1)
        comment = "" if comment.strip() == "(null)" else comment
        datasets, ideal, epochs = parse_comment(comment)
        running = state in RUNNING
        jobs.append(
            SlurmJob(
                id=job_id,
                state=state,
                nodes=expand_hostlist(nodelist) if running else (),
                gpus=job_gpus(
                    alloc if running else "", per_job, per_node, per_task, "", nodes, tasks
                ),  # fmt: skip
                priority=_int(prio, 0),
                user=user.strip(),
                datasets=datasets,
                ideal_io=ideal,
                epochs=epochs,
            )
        )
    return jobs


def _int(text: str, default: int) -> int:
    text = text.strip()
    return int(text) if is_digits(text) else default


class SlurmSource:
    """Asks slurmctld through squeue; sets priorities through scontrol."""

    def __init__(self, config: SlurmConfig) -> None:
        self.config = config
        # "auto" settles on the first form that answers and keeps it.
        self.mode: str | None = None if config.format == "auto" else config.format

    def jobs(self) -> list[SlurmJob]:
        """Pending and running jobs; raises SlurmError (one line) if slurmctld cannot
        be asked."""
        if self.mode == "json":
            return parse_json(self._squeue_json())
        if self.mode == "text":
            return self._text_jobs()
        try:
            jobs = parse_json(self._squeue_json())
            self.mode = "json"
            return jobs
        except SlurmError as json_exc:
            try:
                jobs = self._text_jobs()
            except SlurmError:
                raise json_exc from None
            log.info("slurm: squeue --json did not answer (%s); using squeue -O", json_exc)
            self.mode = "text"
            return jobs

    def _squeue_json(self) -> str:
        return self._run([self.config.squeue, "--json"], self.config.max_output)

    def _text_jobs(self) -> list[SlurmJob]:
        delim = f"~{secrets.token_hex(12)}~"
        out = self._run(
            [self.config.squeue, "-h", "-t", "PENDING,RUNNING,CONFIGURING,SUSPENDED",
             "-O", text_format(delim)],
            self.config.max_output,
        )  # fmt: skip
        return parse_text(out, delim)

    def set_priority(self, job_id: str, priority: int) -> None:
        """`scontrol update JobId=N Priority=P`; SlurmError (one line) if refused."""
        if not is_digits(job_id) or priority < 1:
            raise ValueError(f"job {job_id!r} priority {priority}")
        self._run([self.config.scontrol, "update", f"JobId={job_id}", f"Priority={priority}"],
                  1 << 16)  # fmt: skip

    def priority_ignored(self) -> bool:
        """Does slurmctld start jobs in job id order whatever their priority? It does
        with sched/builtin and priority/basic (its "fifo_sched", when all partitions
        have one priority). False when it cannot tell."""
        try:
            out = self._run([self.config.scontrol, "show", "config"], 1 << 20)
        except SlurmError:
            return False
        conf = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                conf[key.strip()] = value.strip()
        return (
            conf.get("SchedulerType") == "sched/builtin"
            and conf.get("PriorityType") == "priority/basic"
        )

    def _run(self, argv: Sequence[str], limit: int) -> str:
        return run_bounded(argv, self.config.timeout, limit)


def run_bounded(argv: Sequence[str], timeout: float, limit: int) -> str:
    """Run a command; its stdout, at most `limit` bytes, within `timeout` seconds.
    SlurmError with one line (the command's last line of stderr) otherwise."""
    what = os.path.basename(argv[0])
    try:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except OSError as exc:
        raise SlurmError(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from None
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    why = None
    with selectors.DefaultSelector() as sel:
        assert proc.stdout and proc.stderr
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"no answer in {timeout:g}s"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = key.data
                if buf is err:
                    err[:] = (err + chunk)[-8192:]  # its last line is what we show
                    continue
                buf += chunk
            if len(out) > limit:
                why = f"more than {limit} bytes of output"
                break
    if why:
        proc.kill()
    try:
        code = proc.wait(max(0.1, deadline - time.monotonic()) if not why else 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        why = why or f"no answer in {timeout:g}s"
    finally:
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    if why:
        raise SlurmError(f"{what}: {why}")
    if code != 0:
        lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        raise SlurmError(f"{what}: {(lines[-1] if lines else f'exit status {code}')[:MAX_ERROR]}")
    return out.decode(errors="replace")


def priority_targets(order: Sequence[SlurmJob]) -> dict[str, int]:
    """New priorities that put the jobs (pending, managed, not held) in `order`, first
    highest, by permuting the priorities they hold now: as a group they keep their
    place among other users' jobs and only change places among themselves.

    Equal values are made distinct (one below the one before, never under 1). Only
    jobs whose priority changes are returned; nothing if the order already holds."""
    jobs = [j for j in order if j.pending and j.managed and not j.held]
    if all(a.priority > b.priority for a, b in zip(jobs, jobs[1:], strict=False)):
        return {}
    values = sorted((j.priority for j in jobs), reverse=True)
    for i in range(1, len(values)):
        values[i] = min(values[i], values[i - 1] - 1)
    values[-1] = max(values[-1], 1)
    for i in range(len(values) - 2, -1, -1):  # a floor of 1 may need room above it
        values[i] = max(values[i], values[i + 1] + 1)
    return {j.id: v for j, v in zip(jobs, values, strict=True) if j.priority != v}
