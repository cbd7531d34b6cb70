"""The agent's side of the control socket: each request becomes a call on the simulated library.

Requests are executed in a worker thread because the simulated library's lock may be held by an
NVML call that was given a latency; the answer carries ``injected_at`` (``time.monotonic()``,
system-wide on Linux) so that benchmarks in another process can time from the injection itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import SocketStream, TaskStatus

from agent.errors import describe
from agent.hardware.simulated.library import SimulatedNvmlLibrary
from agent.sim.control.protocol import MAX_LINE, OPERATIONS, decode, encode

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
MAX_STORM = 100_000


class ControlRequestError(ValueError):
    """A request the control socket refuses; the message goes back to the caller."""


class SimulationControl:
    """``await task_group.start(control.run)``: serve the control socket until cancelled."""

    def __init__(self, path: Path, library: SimulatedNvmlLibrary) -> None:
        self.path = path
        self.library = library

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        listener = await anyio.create_unix_listener(self.path)
        os.chmod(self.path, 0o600)  # it can break GPUs, simulated ones: owner only
        log.info("simulation control socket listening", extra={"socket": str(self.path)})
        try:
            task_status.started()
            await listener.serve(self._serve_one)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _serve_one(self, connection: SocketStream) -> None:
        async with connection:
            try:
                with anyio.fail_after(REQUEST_TIMEOUT):
                    request = decode(await _read_line(connection))
                    reply = await self.execute(request)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                # a client gone before its request was whole (a readiness probe connects
                # and closes): nothing to answer, the socket keeps serving
                log.debug("a control connection closed without a whole request")
                return
            except (ValueError, KeyError, TypeError, IndexError, TimeoutError) as err:
                reply = {"ok": False, "error": describe(err)}
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await connection.send(encode(reply))

    async def execute(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request; raises ControlRequestError (or ValueError) for a bad one."""
        op = request.get("op")
        if op not in OPERATIONS:
            raise ControlRequestError(f"unknown operation {op!r}; use one of {OPERATIONS}")
        index = self.gpu_index(str(request.get("gpu", "")))
        reply = await anyio.to_thread.run_sync(self._apply, op, index, request)
        uuid = self.library.state.gpus[index].spec.uuid
        log.info("simulated fault: %s on GPU %d", op, index, extra={"request": request})
        return {"ok": True, "op": op, "gpu": index, "uuid": uuid, **reply}

    def gpu_index(self, gpu: str) -> int:
        gpus = self.library.state.gpus
        if gpu.isdigit() and int(gpu) < len(gpus):
            return int(gpu)
        for index, candidate in enumerate(gpus):
            if candidate.spec.uuid == gpu:
                return index
        raise ControlRequestError(
            f"no GPU {gpu!r} on this simulated host: give an index 0-{len(gpus) - 1} or a UUID"
        )

    def _apply(self, op: str, index: int, request: dict[str, Any]) -> dict[str, Any]:
        library = self.library
        injected_at = time.monotonic()
        delivered = 0
        if op == "xid":
            xid, count = int(request["xid"]), int(request.get("count", 1))
            if not 1 <= count <= MAX_STORM:
                raise ControlRequestError(f"count must be 1-{MAX_STORM}, not {count}")
            gi, ci = request.get("gpu_instance_id"), request.get("compute_instance_id")
            for _ in range(count):
                delivered += library.inject_xid(index, xid, gi, ci)
        elif op == "ecc":
            delivered = library.inject_ecc(index, double_bit=not request.get("single_bit", False))
        elif op == "gpu-lost":
            library.lose_gpu(index)
        elif op == "destroy-gpu-instance":  # behind the agent's back, as nvidia-smi mig -dgi
            gi = int(request["gpu_instance_id"])
            if gi not in library.state.gpus[index].gpu_instances:
                raise ControlRequestError(f"GPU {index} has no GPU instance {gi}")
            library.destroy_gpu_instance(index, gi)
        else:
            library.recover_gpu(index)
        return {"delivered": delivered, "injected_at": injected_at}


async def _read_line(connection: SocketStream) -> bytes:
    data = b""
    while b"\n" not in data:
        if len(data) > MAX_LINE:
            raise ControlRequestError(f"a request is one line of at most {MAX_LINE} bytes")
        chunk = await connection.receive()
        data += chunk
    return data.split(b"\n", 1)[0]
