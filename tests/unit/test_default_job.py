"""The job a mount gets without --job (cli.default_job) is a job name the daemon takes
(records.job_name_error) whatever its mountpoint is called, and names that were already
job names keep the job they had (an allocation by job name stays theirs)."""

from __future__ import annotations

import random

from silofs.cli import default_job
from silofs.records import is_slurm_job_name, job_name_error


def test_every_mountpoint_name_gives_a_valid_job_name() -> None:
    rng = random.Random(16)
    pool = ' \\/"\x00\x1f\x7f\x85\xa0\u200b\u202e\u3000\udcffaZ9-._é日\U0001f600'
    for _ in range(3000):
        name = "".join(rng.choice(pool) for _ in range(rng.randint(1, 260)))
        job = default_job("/mnt/" + name.replace("/", "_"))
        assert job_name_error(job) is None, (name, job)
    assert job_name_error(default_job("/mnt/" + "\U0001f600" * 63)) is None


def test_names_that_were_valid_keep_their_job() -> None:
    assert default_job("/data/imagenet").startswith("imagenet-")
    assert default_job("/data/my data\tset").startswith("my_data_set-")
    assert default_job("/").startswith("root-")
    long = "x" * 250
    assert default_job(f"/d/{long}") == f"{'x' * 200}-{default_job(f'/d/{long}')[-6:]}"
    two = default_job("/a/train"), default_job("/b/train")
    assert two[0] != two[1] and two[0][:6] == two[1][:6] == "train-"


def test_a_mountpoint_named_slurm_never_gets_a_slurm_prolog_job_name() -> None:
    """slurm-N names are the Slurm prolog's (docs/SECURITY.md "Jobs"); one mountpoint in
    16 named "slurm" has an all-digit digest and would be refused."""
    jobs = [default_job(f"/home/u{i}/slurm") for i in range(200)]
    assert not any(is_slurm_job_name(j) for j in jobs)
    assert sum(j.startswith("slurm_") for j in jobs) > 0  # the case occurred
    assert all(job_name_error(j) is None for j in jobs)
    assert is_slurm_job_name("slurm-12") and not is_slurm_job_name("slurm-12a")
    assert not is_slurm_job_name("slurm-") and not is_slurm_job_name("my-slurm-1")
