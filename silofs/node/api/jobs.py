"""Jobs: a cluster scheduler's registration of one (GPUs, f*, epochs, datasets; a Slurm
prolog, configs/slurm/), its view, and forgetting it.

Owns checking a registration's fields, the only thing the controller plans with that a
node is told rather than measures. Who may register or forget is the route table's
(node/routes.py); persistence is the Daemon's.
"""

from __future__ import annotations

from typing import Any

from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.errors import UsageError
from silofs.node.api.fields import amount, field, job_name, string_list, usage_error_as
from silofs.node.daemon import Daemon
from silofs.node.views import job_view
from silofs.units import parse_rate
from silofs.uri import parse_uri

_REGISTRATION_KEYS = {
    "gpus",
    "ideal_io",
    "epochs",
    "datasets",
    "scheduler",
    "scheduler_id",
    "nodes",
    "uid",
}
_MAX_GPUS = 1 << 16
_MAX_DATASETS = 64
_MAX_NODES = 4096
_MAX_EPOCHS = 1e9
_MAX_UID = (1 << 32) - 2  # (uid_t)-1 is "no uid"


async def register_job(d: Daemon, req: Request, job: str) -> Response:
    job = job_name(job)
    info = parse_registration(req.json())
    await d.register_job(job, info)
    return json_response({"job": job, "registration": info})


async def get_job(d: Daemon, req: Request, job: str) -> Response:
    job = job_name(job)
    j = d.jobs.get(job)
    if j is None:
        raise HTTPError(404, f"no job {job!r} on this node")
    return json_response(job_view(d, j))


async def forget_job(d: Daemon, req: Request, job: str) -> Response:
    job = job_name(job)
    if job not in d.jobs and job not in d.allocs.io:
        raise HTTPError(404, f"no job {job!r} on this node")
    with usage_error_as(409):  # still in use
        await d.forget_job(job)
    return json_response({"forgot": "job", "job": job})


def parse_registration(body: dict) -> dict[str, Any]:
    """A job registration, checked: what the controller may plan with (GPUs, f*,
    epochs, datasets as canonical URIs) and where it comes from (scheduler, its job id,
    the job's nodes), and whose job it is ("uid": a Slurm prolog's $SLURM_JOB_UID; the
    job's owner from then on, docs/SECURITY.md "Jobs"). HTTPError(400) naming the first
    bad field."""
    unknown = sorted(set(body) - _REGISTRATION_KEYS)
    if unknown:
        raise HTTPError(400, f"unknown field {unknown[0]!r} in a job registration")
    gpus = field(body, "gpus", int)
    if not 0 <= gpus <= _MAX_GPUS:
        raise HTTPError(400, f"field 'gpus' must be between 0 and {_MAX_GPUS}")
    info: dict[str, Any] = {"gpus": gpus}
    if body.get("ideal_io") is not None:
        info["ideal_io"] = amount(body, "ideal_io", parse_rate, allow_null=False)
    epochs = body.get("epochs")
    if epochs is not None:
        if isinstance(epochs, bool) or not isinstance(epochs, int | float):
            raise HTTPError(400, "field 'epochs' must be a number")
        if not 0 < epochs <= _MAX_EPOCHS:
            raise HTTPError(400, f"field 'epochs' must be more than 0 and at most {_MAX_EPOCHS:g}")
        info["epochs"] = epochs
    canonical = []
    for uri in string_list(body, "datasets", _MAX_DATASETS):
        try:
            canonical.append(parse_uri(uri).canonical)
        except UsageError as exc:
            raise HTTPError(400, f"field 'datasets': {exc}") from None
    info["datasets"] = canonical
    info["nodes"] = string_list(body, "nodes", _MAX_NODES)
    for name in ("scheduler", "scheduler_id"):
        value = field(body, name, str, required=False)
        if value is not None:
            if len(value) > 255 or not value.isprintable():
                raise HTTPError(400, f"field {name!r} must be printable, at most 255 characters")
            info[name] = value
    uid = field(body, "uid", int, required=False)
    if uid is not None:
        if not 0 <= uid <= _MAX_UID:
            raise HTTPError(400, f"field 'uid' must be between 0 and {_MAX_UID}")
        info["uid"] = uid
    return info
