"""The allocations a controller (or an admin) makes: a dataset's cache and admission
mode, a job's remote IO, and the list of all of them.

Owns reading and checking those requests and answering what was set. Who may change
them is the route table's (node/routes.py); the sum check, persistence and enforcement
are the Daemon's.
"""

from __future__ import annotations

from silofs.control.router import HTTPError, Request, Response, json_response
from silofs.node.api.fields import amount, dataset_uri, field, job_name, usage_error_as
from silofs.node.daemon import Daemon
from silofs.units import parse_rate, parse_size


async def get_cache(d: Daemon, req: Request, name: str) -> Response:
    uri = dataset_uri(d, name)
    return json_response({"dataset": uri, "bytes": d.allocs.cache.get(uri)})


async def put_cache(d: Daemon, req: Request, name: str) -> Response:
    body = req.json()
    uri = dataset_uri(d, name)
    size = amount(body, "bytes", parse_size, allow_null=True)
    with usage_error_as(409):  # more than the cache
        missed = await d.set_cache_allocation(uri, size)
    if missed is None:
        return json_response({"dataset": uri, "bytes": size})
    # A cluster share: the members that do not hold it yet (they pull it once back).
    return json_response({"dataset": uri, "bytes": size, "members_not_reached": missed})


async def get_io(d: Daemon, req: Request, job: str) -> Response:
    job = job_name(job)
    return json_response({"job": job, "bytes_per_s": d.allocs.io.get(job)})


async def put_io(d: Daemon, req: Request, job: str) -> Response:
    body = req.json()
    job = job_name(job)
    rate = amount(body, "bytes_per_s", parse_rate, allow_null=True)
    await d.set_io_allocation(job, rate)
    return json_response({"job": job, "bytes_per_s": rate})


async def del_io(d: Daemon, req: Request, job: str) -> Response:
    job = job_name(job)
    if not await d.clear_io_allocation(job):
        raise HTTPError(404, f"job {job!r} has no remote IO allocation on this node")
    return json_response({"job": job, "bytes_per_s": None, "cleared": True})


async def get_mode(d: Daemon, req: Request, name: str) -> Response:
    uri = dataset_uri(d, name)
    return json_response({"dataset": uri, "mode": d.allocs.mode(uri)})


async def put_mode(d: Daemon, req: Request, name: str) -> Response:
    mode = field(req.json(), "mode", str)
    uri = dataset_uri(d, name)
    with usage_error_as(400):  # neither uniform nor lru
        await d.set_mode(uri, mode)
    return json_response({"dataset": uri, "mode": mode})


async def all_allocations(d: Daemon, req: Request) -> Response:
    return json_response(
        {
            "cache": d.allocs.cache,
            "io": d.allocs.io,
            "admission": d.allocs.modes,
            "cache_size": d.cache_size,
        }
    )
