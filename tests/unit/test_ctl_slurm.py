"""The controller's Slurm source: squeue's two output forms parsed, GPUs and host lists,
the priority permutation, bounded commands, [slurm] settings, and the round with an
in-process fake slurmctld (the real one: tests/integration/test_slurm.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from silofs_ctl.controller import Controller
from silofs_ctl.controller_cmd import render_plan
from silofs_ctl.controller_config import load_controller_config
from silofs_ctl.slurm import (
    SlurmConfig,
    SlurmError,
    SlurmJob,
    expand_hostlist,
    gpu_count,
    job_gpus,
    parse_comment,
    parse_json,
    parse_text,
    priority_targets,
    run_bounded,
    text_format,
)
from silofs_ctl.tomlcheck import ConfigError

from tests.unit.test_ctl_controller import GB, IMAGENET, MB, TB, WIKI, FakeNode, config

# --- the comment, GPUs, host lists ----------------------------------------------------


def test_comment_tokens_are_the_prologs_and_bad_values_count_as_not_given() -> None:
    assert parse_comment(
        "run 3 silofs=s3://b/imagenet/ silofs.ideal_io=900MB/s silofs.epochs=90 silofs=/d/wiki"
    ) == (("s3://b/imagenet/", "/d/wiki"), 900 * MB, 90.0)
    assert parse_comment("silofs= silofs.ideal_io=fast silofs.epochs=-1 xsilofs=/a") == (
        (),
        None,
        None,
    )
    assert parse_comment("") == ((), None, None)
    # A rate without a unit is not one, as for `job register --ideal-io` (the prolog
    # cancels such a job): not 100 B/s, which would rank it as needing no IO.
    assert parse_comment("silofs=/d silofs.ideal_io=100") == (("/d",), None, None)


@pytest.mark.parametrize(
    "tres, gpus",
    [
        ("gres:gpu:2", 2),  # 22.05 tres_per_node
        ("gres/gpu:2", 2),  # newer spelling
        ("cpu=1,mem=1M,node=1,billing=1,gres/gpu=2", 2),  # TRES, running
        ("gres:gpu:a100:2", 2),
        ("gres/gpu:a100=3,gres/gpu=3", 3),  # typed and untyped: the untyped total
        ("gres:gpu:a100:1,gres:gpu:v100:2", 3),
        ("gres:gpu", 1),
        ("cpu=4,mem=1G", None),
        ("N/A", None),
        ("", None),
    ],
)
def test_gpus_from_tres_and_gres_strings(tres: str, gpus: int | None) -> None:
    assert gpu_count(tres) == gpus


def test_a_jobs_gpus_prefer_its_allocation_then_per_job_then_per_node_times_nodes() -> None:
    assert job_gpus("gres/gpu=8", "gres:gpu:2", "", "", "", 4, 1) == 8
    assert job_gpus("", "gres:gpu:2", "gres:gpu:4", "", "", 4, 1) == 2
    assert job_gpus("", "", "gres:gpu:4", "", "", 3, 1) == 12
    assert job_gpus("", "", "", "gres:gpu:1", "", 2, 6) == 6
    assert job_gpus("", "", "", "", "cpu=1", 1, 1) == 0


def test_host_lists_expand_with_padding_and_are_bounded() -> None:
    assert expand_hostlist("gpu[01-03,7],cpu1") == ("gpu01", "gpu02", "gpu03", "gpu7", "cpu1")
    assert expand_hostlist("r[1-2]n[1-2]") == ("r1n1", "r1n2", "r2n1", "r2n2")
    assert expand_hostlist("(null)") == () and expand_hostlist("") == ()
    with pytest.raises(SlurmError, match="over"):
        expand_hostlist("n[0-99999999]")
    with pytest.raises(SlurmError, match="bad host list"):
        expand_hostlist("n[a-b]")


# --- squeue's answers ------------------------------------------------------------------


def _row(job_id: int, state: str | list, comment: str, **kw: object) -> dict:
    return {"job_id": job_id, "job_state": state, "comment": comment, "node_count": 1, **kw}


def test_json_of_slurm_22_05_and_of_newer_data_parsers() -> None:
    text = json.dumps(
        {
            "jobs": [
                _row(
                    1,
                    "RUNNING",
                    "silofs=/d/a silofs.epochs=2",
                    nodes="gpu[1-2]",
                    node_count=2,
                    tres_alloc_str="cpu=2,gres/gpu=4",
                    tres_per_node="gres:gpu:2",
                    priority=100,
                    user_name="ann",
                ),  # fmt: skip
                _row(
                    2,
                    ["PENDING"],
                    "silofs=/d/b",
                    tres_per_job="gres/gpu:1",
                    priority={"set": True, "infinite": False, "number": 90},
                    job_id_extra=None,
                ),  # fmt: skip
                _row(3, "COMPLETED", "silofs=/d/c", priority=80),
                _row(4, "PENDING", "", priority=0),
                "not a job",
            ]
        }
    )
    jobs = parse_json(text)
    assert [j.id for j in jobs] == ["1", "2", "4"]
    run, pend, plain = jobs
    assert run.running and run.nodes == ("gpu1", "gpu2") and run.gpus == 4
    assert run.datasets == ("/d/a",) and run.epochs == 2 and run.user == "ann"
    assert pend.pending and pend.gpus == 1 and pend.priority == 90 and pend.nodes == ()
    assert not plain.managed and plain.held
    with pytest.raises(SlurmError, match="not JSON"):
        parse_json("squeue: error: unrecognized option '--json'")
    with pytest.raises(SlurmError, match="no jobs list"):
        parse_json("{}")


def test_the_text_form_survives_a_comment_holding_any_text() -> None:
    delim = "~0123abcd~"
    evil = "silofs=/d/x silofs.epochs=3 a|b\tc\nJobID 99 | PENDING"

    def record(*fields: str) -> str:
        return "".join(f + delim for f in fields) + "\n"

    out = record("7", "PENDING", "2", "2", "", "50", "N/A", "N/A", "gres:gpu:2", "N/A",
                 "bob", evil)  # fmt: skip
    out += record("8", "RUNNING", "1", "1", "n1", "40", "cpu=1,gres/gpu=1", "N/A", "N/A",
                  "N/A", "ann", "(null)")  # fmt: skip
    out += record("9_[1-4]", "PENDING", "1", "1", "", "40", "N/A", "N/A", "N/A", "N/A", "ann",
                  "silofs=/d/y")  # fmt: skip
    jobs = parse_text(out, delim)
    assert [j.id for j in jobs] == ["7", "8"]  # a job array's id is not a job's
    assert jobs[0].gpus == 4 and jobs[0].datasets == ("/d/x",) and jobs[0].epochs == 3
    assert jobs[1].nodes == ("n1",) and not jobs[1].managed
    with pytest.raises(SlurmError, match="whole number"):
        parse_text(out.replace(delim, "", 1), delim)
    assert delim in text_format(delim) and text_format(delim).endswith(f"Comment:{delim}")


# --- the priority permutation ------------------------------------------------------------


def _pending(job_id: str, priority: int, managed: bool = True) -> SlurmJob:
    return SlurmJob(job_id, "PENDING", (), 1, priority, datasets=("/d",) if managed else ())


def test_priorities_are_permuted_into_the_order_and_nothing_if_it_holds() -> None:
    a, b, c = _pending("1", 30), _pending("2", 20), _pending("3", 10)
    assert priority_targets([a, b, c]) == {}
    # c first, then a, then b: they swap the values they hold among themselves
    assert priority_targets([c, a, b]) == {"3": 30, "1": 20, "2": 10}


def test_held_and_unmanaged_jobs_are_never_given_a_priority() -> None:
    held, plain = _pending("4", 0), _pending("5", 99, managed=False)
    a, b = _pending("1", 10), _pending("2", 20)
    targets = priority_targets([a, held, plain, b])
    assert targets == {"1": 20, "2": 10}


def test_equal_priorities_are_made_distinct_and_never_below_one() -> None:
    jobs = [_pending(str(i), 1) for i in range(1, 4)]
    assert priority_targets(jobs) == {"1": 3, "2": 2}  # the last keeps 1
    jobs = [_pending("1", 5), _pending("2", 5), _pending("3", 9)]
    assert priority_targets(jobs) == {"1": 9, "3": 4}  # 2 keeps its 5


# --- running commands ----------------------------------------------------------------------


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_command_that_fails_gives_its_last_line_of_stderr(tmp_path: Path) -> None:
    bad = _script(
        tmp_path,
        "squeue",
        'echo "squeue: error: debug noise" >&2\n'
        'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2\nexit 1',
    )
    with pytest.raises(SlurmError) as err:
        run_bounded([bad, "--json"], 5, 1000)
    assert str(err.value) == "squeue: slurm_load_jobs error: Unable to contact slurm controller"
    with pytest.raises(SlurmError, match="cannot run"):
        run_bounded([str(tmp_path / "missing")], 5, 1000)


def test_a_command_is_bounded_in_time_and_in_output(tmp_path: Path) -> None:
    slow = _script(tmp_path, "slow", "exec sleep 30")
    with pytest.raises(SlurmError, match="no answer in 0.5s"):
        run_bounded([slow], 0.5, 1000)
    loud = _script(tmp_path, "loud", "exec yes squeue")
    with pytest.raises(SlurmError, match="more than 100000 bytes"):
        run_bounded([loud], 10, 100_000)
    assert run_bounded([_script(tmp_path, "ok", "echo fine")], 5, 100) == "fine\n"


# --- [slurm] in controller.toml ------------------------------------------------------------


def _conf(tmp_path: Path, slurm: str) -> str:
    path = tmp_path / "controller.toml"
    path.write_text(
        'remote_io = "1GB/s"\n[[nodes]]\nname = "n1"\nsocket = "/run/n1.sock"\n' + slurm
    )
    return str(path)


def test_slurm_settings_and_their_defaults(tmp_path: Path) -> None:
    assert load_controller_config(_conf(tmp_path, "")).slurm is None
    assert load_controller_config(_conf(tmp_path, "[slurm]\n")).slurm == SlurmConfig()
    cfg = load_controller_config(
        _conf(
            tmp_path,
            '[slurm]\nsqueue = "/opt/slurm/bin/squeue"\ntimeout = "3s"\n'
            'format = "text"\npriority = "set"\nmax_priority_updates = 5\n'
            'max_output = "1MiB"\n',
        )  # fmt: skip
    ).slurm
    assert cfg == SlurmConfig(
        squeue="/opt/slurm/bin/squeue", timeout=3.0, max_output=1 << 20, format="text",
        priority="set", max_priority_updates=5,
    )  # fmt: skip


@pytest.mark.parametrize(
    "body, message",
    [
        ('priority = "on"', "priority must be one of off, log, set"),
        ('poll = "-1s"', "poll: duration must not be negative"),
        ('poll = "0.2s"', "poll must be at least 1s"),
        ('format = "xml"', "format must be one of auto, json, text"),
        ("timeout = 0", "timeout must be positive"),
        ("max_priority_updates = 0", "max_priority_updates must be positive"),
        ('squeue = ""', "squeue must be a command"),
        ("sqeue = 1", "unknown key 'sqeue'"),
    ],
)
def test_bad_slurm_settings_name_the_line(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_controller_config(_conf(tmp_path, f"[slurm]\n{body}\n"))
    assert ":6:" in str(err.value)


# --- the round, with a fake slurmctld -------------------------------------------------------


class FakeSlurm:
    """Answers like squeue and scontrol: jobs, priorities set, refusals, outages."""

    def __init__(self, jobs: list[SlurmJob], cfg: SlurmConfig) -> None:
        self.config = cfg
        self.list = jobs
        self.down: str | None = None
        self.refuse: str | None = None
        self.calls: list[tuple[str, int]] = []
        self.fifo = False

    def jobs(self) -> list[SlurmJob]:
        if self.down:
            raise SlurmError(self.down)
        return list(self.list)

    def priority_ignored(self) -> bool:
        return self.fifo

    def set_priority(self, job_id: str, priority: int) -> None:
        self.calls.append((job_id, priority))
        if self.refuse:
            raise SlurmError(self.refuse)
        self.list = [
            SlurmJob(j.id, j.state, j.nodes, j.gpus, priority, j.user, j.datasets,
                     j.ideal_io, j.epochs, j.submit) if j.id == job_id else j
            for j in self.list
        ]  # fmt: skip


def _queued(job_id: str, epochs: float, priority: int, **kw: object) -> SlurmJob:
    fields: dict = dict(datasets=(IMAGENET,), ideal_io=100 * MB, epochs=epochs)
    fields.update(kw)
    return SlurmJob(job_id, "PENDING", (), 2, priority, **fields)


def _setup(jobs: list[SlurmJob], **slurm: object) -> tuple[Controller, FakeSlurm, dict]:
    nodes = {"n1": FakeNode("n1", 1 * TB), "n2": FakeNode("n2", 1 * TB)}
    for node in nodes.values():
        node.add_dataset(IMAGENET, 1300 * GB)
    nodes["n1"].add_dataset(WIKI, 100 * GB)
    cfg = SlurmConfig(**{"priority": "set", "poll": 0.0, **slurm})  # type: ignore[arg-type]
    ctl = Controller(config("sjf", slurm=cfg), factory=lambda node: nodes[node.name])
    fake = FakeSlurm(jobs, cfg)
    ctl.slurm = fake  # type: ignore[assignment]
    return ctl, fake, nodes


def test_pending_jobs_enter_the_plan_in_sjf_order_and_get_priorities_in_it() -> None:
    queue = [
        _queued("11", epochs=9, priority=300),
        _queued("12", epochs=1, priority=200),
        _queued("13", epochs=3, priority=100),
        _queued("14", epochs=1, priority=50, ideal_io=None),  # no f*: not scorable
        _queued("15", epochs=1, priority=0),  # held
        SlurmJob("16", "PENDING", (), 2, 250),  # not a silofs job
    ]
    ctl, fake, _ = _setup(queue)
    plan = ctl.round(force=True)
    assert plan is not None
    assert [q.job.id for q in plan.queue] == ["12", "15", "13", "11", "14"]
    assert plan.queue[-1].score is None and "no f*" in plan.queue[-1].note
    # SJF order of the managed, not held jobs gets their own priorities permuted
    assert dict(fake.calls) == {"12": 300, "13": 200, "11": 100}
    assert {j.id: j.priority for j in fake.list} == {
        "11": 100, "12": 300, "13": 200, "14": 50, "15": 0, "16": 250,
    }  # fmt: skip
    table = render_plan(plan, {})
    assert "queued (SJF-SiloD order)" in table and "held" in table
    # in order now: the next plan sets nothing
    fake.calls.clear()
    ctl.round(force=True)
    assert fake.calls == []


def test_a_refusal_is_logged_once_and_not_retried_until_the_order_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctl, fake, _ = _setup([_queued("1", 9, 20), _queued("2", 1, 10)])
    fake.refuse = "scontrol: slurm_update error: Access/permission denied"
    with caplog.at_level(logging.WARNING):
        ctl.round(force=True)
        ctl.round(force=True)
    assert fake.calls == [("2", 20)]  # tried once, stopped at the first refusal
    refusals = [r for r in caplog.records if "Access/permission denied" in r.getMessage()]
    assert len(refusals) == 1 and "operator or admin" in refusals[0].getMessage()
    # a new job changes the wanted order: tried again
    fake.list.append(_queued("3", 0.5, 5))
    ctl.round(force=True)
    assert fake.calls[-1] == ("3", 20)


def test_updates_per_round_are_bounded_and_the_rest_follow_next_poll() -> None:
    queue = [_queued(str(i), epochs=10 - i, priority=100 - i) for i in range(6)]
    ctl, fake, _ = _setup(queue, max_priority_updates=2)
    ctl.round(force=True)
    assert len(fake.calls) == 2
    assert ctl.round() is not None  # the rest do not wait for the interval
    assert len(fake.calls) == 4


def test_log_mode_and_dry_run_only_say_what_they_would_set() -> None:
    queue = [_queued("1", 9, 20), _queued("2", 1, 10)]
    ctl, fake, _ = _setup(queue, priority="log")
    ctl.round(force=True)
    assert fake.calls == []
    assert ctl.priority_lines == [
        "would run: scontrol update JobId=2 Priority=20 (now 10)",
        "would run: scontrol update JobId=1 Priority=10 (now 20)",
    ]
    ctl, fake, _ = _setup(queue, priority="set")
    plan = ctl.round(force=True, dry_run=True)
    assert fake.calls == [] and plan is not None
    assert [q.new_priority for q in plan.queue] == [20, 10]


def test_slurmctld_down_leaves_the_round_to_the_daemons_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctl, fake, nodes = _setup([])
    nodes["n1"].add_job("slurm-7", WIKI)
    fake.down = "squeue: slurm_load_jobs error: Unable to contact slurm controller"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            plan = ctl.round(force=True)
            assert plan is not None and [j.name for j in plan.jobs] == ["slurm-7"]
    downs = [r for r in caplog.records if "Unable to contact" in r.getMessage()]
    assert len(downs) == 1 and ctl.slurm_down
    fake.down = None
    with caplog.at_level(logging.WARNING):
        ctl.round(force=True)
    assert ctl.slurm_down is None and "answers again" in caplog.text


def test_a_running_job_slurm_knows_is_planned_before_its_prolog_registers_it() -> None:
    running = SlurmJob("21", "RUNNING", ("n2", "elsewhere"), 4, 100,
                       datasets=("s3://data/wiki",), ideal_io=30 * MB, epochs=2)  # fmt: skip
    ctl, _, nodes = _setup([running])
    nodes["n2"].add_dataset(WIKI, 100 * GB)
    plan = ctl.round(force=True)
    assert plan is not None
    job = next(j for j in plan.jobs if j.name == "slurm-21")
    # on the node of its that the controller knows, with f* from its comment; the URI
    # as the user wrote it (no trailing slash) is the daemon's dataset
    assert job.nodes == ("n2",) and job.f_star == 30 * MB and job.dataset == WIKI
    assert job.io is not None and job.io > 0
    assert nodes["n2"].puts and any(p[1] == "slurm-21" for p in nodes["n2"].puts)


def test_auto_format_falls_back_to_text_and_keeps_it(tmp_path: Path) -> None:
    from silofs_ctl.slurm import SlurmSource

    log = tmp_path / "calls"
    squeue = _script(
        tmp_path,
        "squeue",
        f'echo "$@" >> {log}\n'
        'case "$1" in --json) echo "squeue: unrecognized option --json" >&2; exit 1;; esac\n'
        "fmt=$(eval echo \\${$#}); d=${fmt#JobID:}; d=${d%%,*}\n"
        'printf "5${d}PENDING${d}1${d}1${d}${d}10${d}N/A${d}N/A${d}gres:gpu:1${d}N/A${d}u${d}'
        'silofs=/d/x${d}\\n"',
    )
    src = SlurmSource(SlurmConfig(squeue=squeue))
    assert [j.id for j in src.jobs()] == ["5"] and src.mode == "text"
    assert [j.gpus for j in src.jobs()] == [1]
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and calls[0] == "--json" and "--json" not in calls[2]


def test_a_scheduler_that_ignores_priority_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from silofs_ctl.slurm import SlurmSource

    conf = "Configuration data as of x\nPriorityType            = priority/basic\n"
    scontrol = _script(tmp_path, "scontrol", f'printf "{conf}SchedulerType = sched/builtin\\n"')
    assert SlurmSource(SlurmConfig(scontrol=scontrol)).priority_ignored()
    other = _script(tmp_path, "other", 'echo "SchedulerType = sched/backfill"')
    assert not SlurmSource(SlurmConfig(scontrol=other)).priority_ignored()
    ctl, fake, _ = _setup([_queued("1", 9, 20), _queued("2", 1, 10)])
    fake.fifo = True
    with caplog.at_level(logging.WARNING):
        ctl.round(force=True)
        fake.list.append(_queued("3", 0.5, 5))
        ctl.round(force=True)
    assert caplog.text.count("job id order whatever their priority") == 1


def test_a_queued_jobs_dataset_keeps_its_idle_cache_before_others() -> None:
    ctl, fake, nodes = _setup([])
    n1 = nodes["n1"]
    n1.datasets.clear()
    n1.add_dataset(IMAGENET, 1300 * GB, cached=800 * GB)
    n1.add_dataset(WIKI, 400 * GB, cached=300 * GB)
    plan = ctl.round(force=True, dry_run=True)
    assert plan is not None  # nobody reads either: the fuller one is kept first
    assert plan.cache["n1"] == {IMAGENET: 800 * GB, WIKI: 200 * GB}
    fake.list = [_queued("31", 1, 10, datasets=("s3://data/wiki",))]
    plan = ctl.round(force=True, dry_run=True)
    assert plan is not None and plan.queue[0].dataset == WIKI
    assert plan.cache["n1"] == {WIKI: 300 * GB, IMAGENET: 700 * GB}


def test_slurmctld_is_asked_at_most_every_poll_and_again_after_setting_priorities() -> None:
    ctl, fake, _ = _setup([_queued("1", 9, 20), _queued("2", 1, 10)], poll=3600.0)
    asked = []
    real = fake.jobs
    fake.jobs = lambda: asked.append(1) or real()  # type: ignore[method-assign]
    ctl.round(force=True)  # asks, sets two priorities
    ctl.round(force=True)  # asks again: its answer held the old priorities
    ctl.round(force=True)  # within the poll: the last answer serves
    assert len(asked) == 2 and len(fake.calls) == 2
