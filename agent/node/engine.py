"""The prepare engine: the one owner of this node's prepared claims.

The kubelet surface hands it claim references; it reads each ResourceClaim, decides what to
prepare (``plan``), writes the claim's CDI spec and records the claim in the checkpoint, and
answers only once what is needed to undo the prepare is on disk. Unprepare works from the
checkpoint alone, because the ResourceClaim may already be gone. The engine owns the state
and the locks; a request's steps inside them are ``prepare_request`` (claim locks, reused
and new claims, spans), ``batch`` (the new claims) and ``unprepare``.

Latency is the point of the design (the acceptance target is p50 <= 1.5 x (gRPC round trip +
one claim GET + two durable writes)):

- one request's claims are read, planned and written concurrently;
- group commit: the whole request costs one ``PrepareStarted`` write and one
  ``PrepareCompleted`` write of the checkpoint, whatever its number of claims; concurrent
  requests share a write when one is already queued (``commit``);
- the ``PrepareStarted`` write needs only the claim identities the kubelet sent, so it runs
  while the claims are read, and the CDI specs (other files) are fsynced while it runs. A
  crash between any two of these writes is safe: startup removes a spec no checkpoint entry
  owns and rolls back started claims (``batch``, ``reconcile``);
- host facts (MIG capability minors, the common spec) are read at start; NVML is never
  called on the hot path (except by an effector, for devices it makes: ``effectors``); the
  checkpoint has one writer thread, which gets the ``PrepareStarted`` write before the claim
  GET starts (``offload``), and CDI specs go to a file thread unless their directory is a
  tmpfs (``spec_writes``); docs/PERFORMANCE.md says what each measure saved.

Rolling upgrades (kubelet-dra-protocol.md §1, §6, §8; nvidia-driver-facts.md §13): the
DaemonSet surges a new instance (its own socket names, ``--instance-id``) that must start,
register and become Ready while the old one still runs; the kubelet then sends each call
to the newest instance, so a claim prepared by the old one may be unprepared by the new
one. Both instances therefore share the on-disk state (checkpoint, CDI specs) and take
turns through the node lock, per request, never for their lifetime (which would stall the
rollout: the old pod goes only once the new one is Ready):

- every prepare/unprepare request, and startup reconciliation, holds the node lock while
  it reads or writes the shared state, and until its last checkpoint write is durable;
  concurrent requests of one process share one hold (``locks.SharedNodeLock``), so group
  commit keeps working;
- taking the lock never blocks the event loop and is bounded (``lock_timeout_s``, 10 s by
  default, well under the kubelet's 45 s deadline); on timeout every claim of the request
  gets an error naming the lock file and the holder's pid;
- whenever the lock is taken afresh, the engine checks whether the checkpoint file is
  still the one it last read or wrote (``CheckpointStore.changed``: the file's identity,
  with its inode kept open so that it cannot be reused; exact for every write, one
  ``stat``) and, if not, reloads it before any request looks at it. The flock calls and
  that ``stat`` are non-blocking metadata calls made on the event loop: a request pays
  about ten syscalls for the lock, no thread hop. Everything else in
  memory derives from the checkpoint (device holders: adminAccess is recorded per device;
  answers: the recorded devices), and reservations exist only inside a hold, so replacing
  the checkpoint rebuilds all of it. A file that does not load cleanly goes through the
  startup repair (``reconcile``), as a restart would.

Lock order (outermost first; a holder may only take locks further down):

1. the node lock (``flock`` on ``<plugin dir>/gpu-dra-agent.lock``), shared by the
   concurrent requests of this process and held while at least one of them runs (and
   during startup reconciliation); a reload happens at its acquisition;
2. the per-claim locks of one request, taken in ascending claim UID order (``locks``);
3. the checkpoint write lock (``commit``), held only around one checkpoint file write: the
   committer's single writer thread and its write in flight, which a commit waits for.

The checkpoint and the CDI writes of a batch are shielded from cancellation, so a kubelet
deadline that expires mid-request leaves memory and disk in agreement.

Devices that must be *made* on prepare (dynamic MIG instances) are the business of device
effectors (``effectors``): the engine hands them the planned devices of a claim, records the
intents they report in the claim's ``PrepareStarted`` entry, and asks them to undo on
unprepare and to recover at startup; it has no branch for any kind of device. An effector
that keeps something running for a prepared claim (the MPS daemons of ``agent.sharing``) gets
``_maintain`` once the engine serves: its work on one claim runs like a request (node lock,
claim lock) and may rewrite the claim's intents durably (a restarted daemon's pid); the
effectors hear of a reloaded checkpoint and of ``close()``.

Public API: ``PrepareEngine(...)``; ``await start() -> StartupReport``; ``await
prepare(claims) -> {uid: ClaimPrepareResult}``; ``await unprepare(claims) -> {uid: error or
None}``; ``await close()`` (waits for requests in flight; the last one releases the lock).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import anyio
from opentelemetry import trace

from agent.dra.partitionable import owned_by_intents
from agent.hardware.inventory import Inventory
from agent.kube.interfaces import ClaimReader, EventPoster
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint_store import CheckpointStore, LoadStatus
from agent.node.claim_steps import claim_span, read_and_plan, unique_claims
from agent.node.commit import CheckpointCommitter
from agent.node.durable import NodeLock
from agent.node.effectors import ClaimWork, DeviceEffector, Effects, amend_intents
from agent.node.errors import NodeError
from agent.node.facts import HostFacts
from agent.node.holders import DeviceHolders, Prepared
from agent.node.locks import ClaimLocks, SharedNodeLock
from agent.node.prepare_request import prepare_claims
from agent.node.reconcile import StartupReport, reconcile
from agent.node.types import ClaimPrepareResult, ClaimRef
from agent.node.unprepare import unprepare_known

LOCK_FILE = "gpu-dra-agent.lock"
log = logging.getLogger(__name__)


class EngineNotStarted(NodeError):
    """prepare/unprepare was called before ``start()`` finished or after ``close()``."""


class PrepareEngine:
    """Prepares and unprepares the claims of one driver on this node (module docstring)."""

    def __init__(
        self,
        *,
        driver: str,
        node_name: str,
        inventory: Inventory,
        plugin_dir: Path,
        cdi_root: Path,
        host_root: Path,
        driver_root: Path,
        claim_reader: ClaimReader,
        boot_id: str,
        events: EventPoster,
        lock_timeout_s: float = 10.0,
        driver_root_mount: Path | None = None,
        dynamic_mig: bool = False,
        adopt_mig_instances: bool = False,
        effectors: Sequence[DeviceEffector] = (),
        sharing: bool = False,
        ldconfig_path: str | None = None,
    ) -> None:
        """``dynamic_mig``: partitionable GPUs offer their MIG placements as devices, which
        an effector of ``effectors`` (``agent.mig``) makes on prepare; instances it did not
        make are static devices unless ``adopt_mig_instances``. ``sharing``: an
        effector applies sharing configs (``agent.sharing``); else they are refused.
        ``ldconfig_path``: the host's ldconfig, for the common CDI spec's ldcache hook
        (``HostFacts.read``); None: no hook."""
        self.driver = driver
        self.pool = node_name
        self._inventory = inventory
        self._plugin_dir = Path(plugin_dir)
        self._host_root = Path(host_root)
        self._driver_root = Path(driver_root)  # host path, named in CDI specs
        self._driver_files = Path(driver_root_mount or driver_root)  # where we read it
        self._reader = claim_reader
        self._events = events
        self._dynamic_mig = dynamic_mig
        self._adopt_mig = adopt_mig_instances
        self._sharing = sharing
        self._ldconfig = ldconfig_path
        self._effects = Effects(effectors)
        self._store = CheckpointStore(self._plugin_dir, boot_id)
        self._specs = CdiSpecDirectory(Path(cdi_root), driver)
        self._node_lock = SharedNodeLock(
            NodeLock(self._plugin_dir / LOCK_FILE, timeout=lock_timeout_s), self._on_lock_taken
        )
        self._claim_locks = ClaimLocks()
        self._state: CheckpointCommitter | None = None  # None: not accepting requests
        self._committer: CheckpointCommitter | None = None  # set by start(), kept by close()
        self._facts: HostFacts | None = None
        self._holders = DeviceHolders()
        self._running = 0  # prepare/unprepare calls in flight
        self._idle = anyio.Event()
        self._idle.set()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> StartupReport:
        """Read the host facts, reconcile the files under the node lock; returns the report.

        Waits (up to ``lock_timeout_s``, then raises ``LockTimeout``) while another instance
        has a request in flight; it never waits for that instance to exit.
        """
        await anyio.to_thread.run_sync(self._make_directories)
        async with self._node_lock.hold():
            loaded = await anyio.to_thread.run_sync(self._store.load)
            # Which MIG instances are the agent's own is on record (its intents), so the
            # checkpoint is read before the devices are (static instances stay static).
            dynamic = self._dynamic_mig and owned_by_intents(
                (
                    (i.effector, i.device)
                    for c in loaded.checkpoint.claims.values()
                    for i in c.intents
                ),
                self._adopt_mig,
            )
            self._facts = await anyio.to_thread.run_sync(
                functools.partial(
                    HostFacts.read,
                    self.driver,
                    self.pool,
                    self._inventory,
                    self._host_root,
                    self._driver_root,
                    self._driver_files,
                    dynamic_mig=dynamic,
                    ldconfig=self._ldconfig,
                )
            )
            checkpoint, report = await reconcile(
                self._store, self._specs, self._facts, self._events, loaded, self._effects
            )
            self._state = self._committer = CheckpointCommitter(
                self._store, checkpoint, tidy=self._store.close_retired, driver=self.driver
            )
        self._effects.attach(self._maintain)
        return report

    def _make_directories(self) -> None:
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        self._specs.root.mkdir(parents=True, exist_ok=True)

    async def close(self, grace_s: float = 30.0) -> None:
        """Refuse new requests and let those in flight finish (the last releases the lock)."""
        self._state = None
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
            await self._effects.close()
            await self._idle.wait()
        if self._running == 0:
            self._store.close()
            if self._committer is not None:
                self._committer.close()

    async def _on_lock_taken(self) -> None:
        """Reload the checkpoint if another instance wrote it since this one last did."""
        state = self._committer  # requests admitted before close() still need a reload
        if state is None or not self._store.changed():
            return
        with anyio.CancelScope(shield=True):  # memory must follow the file the store read
            loaded = await anyio.to_thread.run_sync(self._store.load)
            checkpoint = loaded.checkpoint
            if loaded.status is not LoadStatus.LOADED:
                assert self._facts is not None
                checkpoint, _ = await reconcile(
                    self._store, self._specs, self._facts, self._events, loaded, self._effects
                )
            state.reload(checkpoint)
            self._effects.reload(checkpoint)
        log.info(
            "the checkpoint %s was changed by another instance; reloaded %d claim(s)",
            self._store.path,
            len(checkpoint.claims),
            extra={"load_status": str(loaded.status)},
        )

    async def _maintain(self, effector: str, uid: str, work: ClaimWork) -> None:
        """An effector's ``work`` on claim ``uid`` between requests (``effectors.Maintain``):
        counted as a request, under the node lock and the claim's lock."""
        with self._request() as state:
            await self._node_lock.acquire()
            try:
                async with self._claim_locks.hold([uid]):

                    async def record(intents: tuple[cp.Intent, ...]) -> None:
                        state.update(amend_intents(state.checkpoint, uid, effector, intents))
                        await state.commit()

                    await work(state.checkpoint.claims.get(uid), record)
            finally:
                self._node_lock.release()

    @property
    def facts(self) -> HostFacts | None:
        """The devices and host facts read by ``start()`` (None before)."""
        return self._facts

    @property
    def node_lock(self) -> SharedNodeLock:
        """The node lock shared by this engine's requests."""
        return self._node_lock

    @property
    def checkpoint(self) -> cp.Checkpoint:
        """The in-memory checkpoint: what is on disk once a request of this instance
        returns, until the other instance of a rolling upgrade writes the file."""
        return self._started().checkpoint

    def _started(self) -> CheckpointCommitter:
        if self._state is None:
            raise EngineNotStarted("the prepare engine is not started (or already closed)")
        return self._state

    @contextmanager
    def _request(self) -> Iterator[CheckpointCommitter]:
        """Count a request in flight (``close`` waits for it)."""
        state = self._started()
        if self._running == 0:
            self._idle = anyio.Event()
        self._running += 1
        try:
            yield state
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    # -- prepare --------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, ClaimPrepareResult]:
        """Prepare ``claims``; every claim gets a result, one bad claim never fails others."""
        with self._request() as state:
            unique = unique_claims(claims)
            if not unique:
                return {}
            try:
                await self._node_lock.acquire()
            except NodeError as error:  # the lock timed out, or reloading failed
                return {ref.uid: ClaimPrepareResult(error=str(error)) for ref in unique}
            try:
                return await prepare_claims(
                    state,
                    unique,
                    claim_locks=self._claim_locks,
                    specs=self._specs,
                    holders=self._holders,
                    planner=self._plan,
                    effects=self._effects,
                )
            finally:
                self._node_lock.release()

    async def _plan(self, ref: ClaimRef, span: trace.Span) -> Prepared:
        """Read and plan one claim (``claim_steps.read_and_plan``)."""
        assert self._facts is not None
        return await read_and_plan(
            self._reader,
            self._facts,
            ref,
            span,
            driver=self.driver,
            pool=self.pool,
            sharing=self._sharing,
        )

    # -- unprepare ------------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        """Unprepare ``claims`` (idempotent; unknown claims succeed); uid -> error or None."""
        with self._request() as state:
            unique = unique_claims(claims)
            if not unique:
                return {}
            try:
                await self._node_lock.acquire()
            except NodeError as error:  # the lock timed out, or reloading failed
                return {ref.uid: str(error) for ref in unique}
            try:
                return await self._unprepare(state, unique)
            finally:
                self._node_lock.release()

    async def _unprepare(
        self, state: CheckpointCommitter, unique: list[ClaimRef]
    ) -> dict[str, str | None]:
        results: dict[str, str | None] = {ref.uid: None for ref in unique}
        async with self._claim_locks.hold(ref.uid for ref in unique):
            known = [ref for ref in unique if ref.uid in state.checkpoint.claims]
            if not known:
                return results
            spans = {ref.uid: claim_span("claim.unprepare", ref) for ref in known}
            try:
                with anyio.CancelScope(shield=True):
                    await unprepare_known(state, self._specs, known, spans, results, self._effects)
            finally:
                for uid, span in spans.items():
                    if results[uid] is not None:
                        span.set_status(trace.StatusCode.ERROR, results[uid] or "")
                    span.end()
        return results
