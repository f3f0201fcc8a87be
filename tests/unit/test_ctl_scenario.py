"""Scenario files: what is refused, with a message naming the line; and the simulate CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from silofs_ctl.cli import main
from silofs_ctl.scenario import ScenarioError, load_scenario, parse_duration, parse_scenario

GOOD = """\
description = "two jobs"
[cluster]
remote_io = "200MB/s"

[[cluster.nodes]]
gpus = 4
cache = "1TiB"

[[cluster.nodes]]
gpus = 4
cache = "1TB"

[[jobs]]
name = "resnet50-a"
submit = "0s"
gpus = 1
dataset = "imagenet-a"
dataset_size = "1.3TiB"
ideal_io = "114MB/s"
epochs = 13

[[jobs]]
name = "resnet50-b"
submit = "1.5h"
gpus = 8
dataset = "imagenet-a"
ideal_io = "912MB/s"
epochs = 0.5
"""


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def refused(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "s.toml")
    return str(info.value)


def test_good_scenario_units() -> None:
    s = parse_scenario(GOOD, "s.toml")
    assert s.remote_io == 200e6
    assert [n.cache for n in s.nodes] == [2**40, 10**12]  # TiB binary, TB decimal
    a, b = s.jobs
    assert a.dataset_size == b.dataset_size == round(1.3 * 2**40)  # named once, shared
    assert (a.submit, b.submit) == (0.0, 5400.0)
    assert b.epochs == 0.5 and b.ideal_io == 912e6
    assert s.total_gpus == 8


def test_unknown_key_is_refused_naming_its_line() -> None:
    text = GOOD.replace("epochs = 0.5", "epochs = 0.5\nepoch = 3")
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, 'epoch = 3')}: ")
    assert "unknown key 'epoch'" in message


def test_unknown_key_in_cluster_and_nodes_tables() -> None:
    text = GOOD.replace('remote_io = "200MB/s"', 'remote_io = "200MB/s"\nlink = 3')
    assert refused(text).startswith(f"s.toml:{line_of(text, 'link = 3')}: unknown key 'link'")
    text = GOOD.replace('cache = "1TB"', 'cache = "1TB"\nssd = "2TB"')
    assert refused(text).startswith(f"s.toml:{line_of(text, 'ssd =')}: unknown key 'ssd'")


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ('dataset_size = "1.3TiB"', 'dataset_size = "-1.3TiB"', "dataset_size"),
        ('cache = "1TB"', "cache = -5", "cache = -5"),
        ('ideal_io = "114MB/s"', 'ideal_io = "-114MB/s"', "ideal_io"),
        ('submit = "1.5h"', 'submit = "-1.5h"', "submit"),
    ],
)
def test_negative_sizes_rates_and_times_are_refused_naming_the_line(
    old: str, new: str, needle: str
) -> None:
    text = GOOD.replace(old, new)
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, new)}: ")
    assert "must not be negative" in message and needle.split()[0] in message


def test_job_larger_than_the_cluster_is_refused_naming_the_line() -> None:
    text = GOOD.replace("gpus = 8", "gpus = 9")
    message = refused(text)
    assert message == (
        f"s.toml:{line_of(text, 'gpus = 9')}: job 'resnet50-b' needs 9 GPUs "
        "but the cluster has only 8"
    )


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("epochs = 13", "epochs = 0", "epochs must be positive"),
        ("gpus = 1", 'gpus = "one"', "gpus must be a whole number"),
        (
            'dataset = "imagenet-a"\ndataset_size = "1.3TiB"',
            'dataset = "imagenet-a"',
            "missing key 'dataset_size'",
        ),
        ('ideal_io = "912MB/s"', 'ideal_io = "912MB/s"\ndataset_size = "1TB"', "was given size"),
        ('name = "resnet50-b"', 'name = "resnet50-a"', "used twice"),
        ('remote_io = "200MB/s"', 'remote_io = "fast"', "not a rate"),
        ('ideal_io = "114MB/s"', 'ideal_io = "unlimited"', "positive, finite"),
    ],
)
def test_other_mistakes_name_the_line(old: str, new: str, expect: str) -> None:
    text = GOOD.replace(old, new, 1)
    message = refused(text)
    assert expect in message
    assert message.split(":")[1].isdigit()


def test_syntax_errors_and_missing_tables() -> None:
    assert "not valid TOML" in refused(GOOD + "oops = [")
    assert "at least one [[jobs]]" in refused(GOOD.split("[[jobs]]")[0])
    assert "missing key 'cluster'" in refused('description = "x"\n')


def test_durations() -> None:
    assert parse_duration("90") == 90 and parse_duration(90) == 90
    assert parse_duration("5m") == 300 and parse_duration("2d") == 172800
    assert parse_duration("250ms") == 0.25


# ---------------------------------------------------------------------- CLI


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return str(path)


def test_cli_simulate_prints_jct_makespan_and_fairness(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["simulate", write(tmp_path, GOOD), "--scheduler", "fifo", "--cache", "silod"]
    )
    assert res.exit_code == 0, res.output
    for needle in ("resnet50-a", "resnet50-b", "average JCT", "makespan", "average fairness"):
        assert needle in res.output


@pytest.mark.slow
def test_cli_simulate_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            write(tmp_path, GOOD),
            "--scheduler",
            "gavel",
            "--cache",
            "alluxio",
            "--json",
            "--plot",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["scheduler"] == "gavel" and data["cache"] == "alluxio"
    assert {j["name"] for j in data["jobs"]} == {"resnet50-a", "resnet50-b"}
    assert data["makespan_s"] >= max(j["jct_s"] for j in data["jobs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_bad_scenario_in_one_line(tmp_path: Path) -> None:
    text = GOOD.replace("gpus = 8", "gpus = 64")
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text)])
    assert res.exit_code == 1
    assert "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert lines == [
        f"silofs-ctl: error: {tmp_path / 's.toml'}:{line_of(text, 'gpus = 64')}: "
        "job 'resnet50-b' needs 64 GPUs but the cluster has only 8"
    ]


def test_load_scenario_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ('cache = "1TiB"', "cache = nan", "cache must be a finite number, not nan"),
        ('cache = "1TiB"', "cache = inf", "cache must be a finite number, not inf"),
        ('remote_io = "200MB/s"', "remote_io = nan", "remote_io must be a number, not nan"),
        ('dataset_size = "1.3TiB"', "dataset_size = nan", "dataset_size must be a finite"),
        ('ideal_io = "114MB/s"', "ideal_io = inf", "positive, finite"),
        ("epochs = 13", "epochs = nan", "epochs must be positive: nan"),
        ('submit = "0s"', "submit = inf", "duration must be a finite number"),
        ('submit = "0s"', f'submit = "{"9" * 400}s"', "duration too large"),
        ("gpus = 4\n", "gpus = 4\ncount = 20000\n", "more than 10000 nodes"),
    ],
)
def test_nan_inf_and_huge_values_are_one_line_naming_the_line(
    old: str, new: str, expect: str
) -> None:
    """TOML's nan and inf reached int() (ValueError, OverflowError: a traceback), and a
    node count of 30 million built its node list for minutes."""
    text = GOOD.replace(old, new, 1)
    message = refused(text)
    assert expect in message, message
    assert message.split(":")[1].isdigit()


def test_remote_io_inf_is_unlimited() -> None:
    assert parse_scenario(GOOD.replace('"200MB/s"', "inf"), "s.toml").remote_io == float("inf")


SOLO = """\
[cluster]
remote_io = "100MB/s"
[[cluster.nodes]]
gpus = 1
cache = "500GB"
[[jobs]]
name = "solo"
gpus = 1
dataset = "d"
dataset_size = "1TB"
ideal_io = "200MB/s"
epochs = 5
"""


def test_a_run_past_the_horizon_is_refused_at_load() -> None:
    # 1 PB read 10^9 times at 1 B/s: the simulator stepped for minutes, then gave up.
    text = SOLO.replace('"1TB"', '"1PB"').replace('ideal_io = "200MB/s"', 'ideal_io = "1B/s"')
    text = text.replace("epochs = 5", "epochs = 1e9")
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, 'epochs')}: job 'solo' needs 3.17e+16 ")
    # Fast enough at f*, but every byte comes through a link of 1 B/s once at least.
    text = SOLO.replace('remote_io = "100MB/s"', 'remote_io = "1B/s"')
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, 'remote_io')}: remote_io fetches")
    # Each job fits alone (6 years), not both on the cluster's one GPU.
    one = SOLO.replace('"1TB"', '"1GB"').replace('"200MB/s"', '"1MB/s"')
    one = one.replace("epochs = 5", "epochs = 189216")
    text = one + one[one.index("[[jobs]]") :].replace('"solo"', '"duo"').replace(
        'dataset_size = "1GB"\n', ""
    )
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, '[[cluster.nodes]]')}: the jobs need 12 ")
    assert "of all 1 GPUs" in message


def test_a_run_at_the_horizon_still_simulates(tmp_path: Path) -> None:
    # 1 GB at 1 MB/s is 1,000 s an epoch: 315,360 epochs are ten years exactly.
    text = SOLO.replace('"1TB"', '"1GB"').replace('"200MB/s"', '"1MB/s"')
    text = text.replace("epochs = 5", "epochs = 315360")
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["makespan_s"] == pytest.approx(10 * 365 * 86400, rel=1e-6)


def test_a_job_submitted_far_after_the_others_still_simulates(tmp_path: Path) -> None:
    """Idle time costs the simulator no steps: only the time jobs run is bounded."""
    text = SOLO.replace("epochs = 5", 'epochs = 5\nsubmit = "3650000d"')
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["jobs"][0]["jct_s"] < 86400


@pytest.mark.parametrize(
    "text,expect",
    [
        # [[jobs]] written as an array of values, [[cluster.nodes]] as a list of names.
        (
            GOOD[: GOOD.index("[[jobs]]")].replace("description", "jobs = [1, 2]\ndescription"),
            "s.toml:1: jobs must be a table, not 1",
        ),
        (
            GOOD.replace(
                'remote_io = "200MB/s"', 'remote_io = "200MB/s"\nnodes = ["a"]', 1
            ).replace(
                '[[cluster.nodes]]\ngpus = 4\ncache = "1TiB"\n\n'
                '[[cluster.nodes]]\ngpus = 4\ncache = "1TB"\n',
                "",
            ),
            "s.toml:4: cluster.nodes must be a table, not 'a'",
        ),
    ],
)
def test_a_list_of_values_where_tables_belong_is_one_line(
    tmp_path: Path, text: str, expect: str
) -> None:
    """`jobs = [1, 2]` reached `for key in table` with an int: TypeError, a traceback."""
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text)])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [f"silofs-ctl: error: {tmp_path}/{expect}"]


def test_a_scenario_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """A binary or Latin-1 file raised UnicodeDecodeError out of read_text: a traceback."""
    path = tmp_path / "s.toml"
    path.write_bytes(GOOD.replace("two jobs", "deux t\xe2ches").encode("latin-1"))
    res = CliRunner().invoke(main, ["simulate", str(path)])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        f"silofs-ctl: error: {path}: not UTF-8 text (byte 21: invalid continuation byte); "
        "TOML files are UTF-8"
    ]


def test_interval_nan_is_refused_at_once(tmp_path: Path) -> None:
    """FloatRange(min=1) passed nan: 30 s of stepping at t=0, then "gave up after
    5000000 steps"."""
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, SOLO), "--interval", "nan"])
    assert res.exit_code == 2
    assert "Invalid value for --interval: must be a number of seconds, not nan" in res.output
    assert "Traceback" not in res.output and "gave up" not in res.output


@pytest.mark.parametrize("submit", ["1e17", "1e308", '"3650001000d"'])
def test_a_submit_time_past_the_clocks_precision_is_refused(submit: str) -> None:
    """A 200 s job submitted at 1e17 s reported a JCT of 192 s, at 1e308 s one of 0 s:
    the float clock's step there is longer than the job, and nothing said so."""
    text = SOLO.replace("epochs = 5", f"epochs = 5\nsubmit = {submit}")
    message = refused(text)
    assert message.startswith(f"s.toml:{line_of(text, 'submit')}: submit is ")
    assert "past the simulator's 100,000 (its clock would lose" in message


def test_a_submit_time_at_the_bound_still_simulates_to_the_millisecond(tmp_path: Path) -> None:
    # 1 GB at 200 MB/s (f*) over a 100 MB/s link: 5 epochs, the first at 100 MB/s (10 s),
    # the other four from the 500 GB cache at f* (5 s each): 30 s.
    text = SOLO.replace('"1TB"', '"1GB"').replace("epochs = 5", 'epochs = 5\nsubmit = "36500000d"')
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["jobs"][0]["jct_s"] == pytest.approx(30.0, abs=1e-3)


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('name = "resnet50-a"', 'name = "a\\u001b[31mRED\\nrow"', "name = "),
        ('dataset = "imagenet-a"', 'dataset = "i\\u001b]0;t\\u0007"', "dataset = "),
        ("gpus = 4\n", 'gpus = 4\nname = "n\\r"\n', 'name = "n'),
    ],
)
def test_a_name_with_a_control_character_is_refused_naming_the_line(
    tmp_path: Path, old: str, new: str, key: str
) -> None:
    """simulate's table printed a trace's job names as they were: ESC sequences reached
    the terminal (click strips them only when stdout is not one) and a newline made a
    row of its own."""
    text = GOOD.replace(old, new, 1)
    res = CliRunner().invoke(main, ["simulate", write(tmp_path, text)])
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"silofs-ctl: error: {tmp_path}/s.toml:{line_of(text, key)}: ")
    assert line.endswith("holds a control character (a newline, ESC, ...)")
