"""The CDI spec writes of one prepare request, handed to a file thread in groups.

A request of many claims used to give each claim's spec write a hop of its own to a file
thread and back: on the 2-core development VM handing work to a sleeping thread (the
queue's ``put`` wakes it) took 15-40 us of the event loop's time, up to 170 us under load,
and each of those threads then took turns with the event loop for the GIL while the loop
was still reading the other claims. :class:`SpecWrites` keeps one group open: a claim whose
spec is ready joins the group that is queued and not yet taken by its thread, or opens a new
one; the thread closes the group when it starts on it and writes its specs one after the
other. A request of one claim makes exactly one hand-over, as before.

A CDI directory on a tmpfs (``/var/run/cdi`` on a real node) is the exception: once the
first group's thread has found that out (``CdiSpecDirectory.probe_memory``), each spec is
written on the event loop itself. The module rule (blocking I/O goes to a thread) exists
because a disk write can wait for the device for milliseconds; a write to a tmpfs copies
the bytes into the page cache and ends (its fsyncs are no-ops): about 50 us for a claim's
spec, less than the hand-over it saves (some 0.2 ms to reach the thread and 0.15 ms to get
back to the loop on the development VM, on the critical path of a one-claim prepare). A
disk-backed directory keeps the thread.

Every spec is still written by ``CdiSpecDirectory.write_claim`` (atomic and durable on its
own: temporary, fsync, rename, directory fsync) in a thread, under its own ``cdi.write``
span, and one claim's failed write fails that claim only.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio

from agent.dra.cdi import CdiSpecError
from agent.node.cdi import CdiSpecDirectory
from agent.node.errors import NodeError
from agent.node.facts import claim_spec
from agent.node.holders import Prepared
from agent.node.offload import FILES, IoThreads
from agent.telemetry.tracing import tracer

#: Per claim of a group: None (its spec is on disk) or the error its write raised.
Outcomes = dict[str, NodeError | CdiSpecError | None]


class _Group:
    """Specs for one thread job; ``open`` until the thread takes them."""

    __slots__ = ("done", "open", "specs")

    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}
        self.open = True
        self.done: asyncio.Future[Outcomes] | None = None


class SpecWrites:
    """The spec writes of one request (module docstring)."""

    def __init__(self, specs: CdiSpecDirectory, threads: IoThreads = FILES) -> None:
        self._specs = specs
        self._threads = threads
        self._lock = threading.Lock()  # the loop joining a group against its thread closing it
        self._group: _Group | None = None  # the newest group

    async def write(self, uid: str, devices: Prepared) -> None:
        """Write ``uid``'s spec durably; raises its ``CdiSpecError`` or ``NodeError``."""
        spec = claim_spec(self._specs.driver, uid, devices)
        with tracer().start_as_current_span("cdi.write") as span:
            span.set_attribute("k8s.resourceclaim.uid", uid)
            if self._specs.known_in_memory:  # a memory write, on the loop (module docstring)
                self._specs.write_claim(uid, spec)
                return
            with self._lock:
                group = self._group
                joined = group is not None and group.open
                if group is None or not joined:
                    group = self._group = _Group()
                group.specs[uid] = spec
            if not joined:
                try:
                    group.done = self._threads.submit(self._write_group, group)
                except BaseException:
                    group.open, self._group = False, None
                    raise
            assert group.done is not None
            with anyio.CancelScope(shield=True):  # a write that started is waited for
                outcomes = await asyncio.shield(group.done)
            error = outcomes.get(uid)
            if error is not None:
                raise error

    def _write_group(self, group: _Group) -> Outcomes:
        """In the thread: close ``group`` to newcomers, then write its specs in turn."""
        with self._lock:
            group.open = False
        outcomes: Outcomes = {}
        for uid, spec in group.specs.items():
            try:
                self._specs.write_claim(uid, spec)
            except (NodeError, CdiSpecError) as error:
                outcomes[uid] = error
            else:
                outcomes[uid] = None
        self._specs.probe_memory()  # once per directory: later specs may skip the thread
        return outcomes
