"""``--device-metadata``: the KEP-5304 files of each prepared request, as a device effector.

The engine knows it only through ``node.effectors.DeviceEffector``, so the files follow the
engine's rules for what a prepare changes, like the claims' CDI specs:

- **apply** (last of the effectors): one intent per request of the claim (namespace, claim
  name, request ref, pod claim name) is written into the claim's ``PrepareStarted`` entry,
  durably, before any file; then per request the metadata file and its CDI spec
  (``files``); the devices come back with the request's CDI id added to their
  ``cdi_device_ids``, so the ``PrepareCompleted`` record and every answer (also the
  re-answer of a claim prepared before) carry it.
- **undo** (unprepare, the rollback of a failed prepare): spec, file and directories of each
  intent's request go; what is gone counts as done.
- **recover** (startup, under the node lock): a claim that never completed has its files
  removed (its intents say which); a completed claim gets what is missing back (the spec on
  the tmpfs CDI directory after it was emptied; the file, from the checkpoint's devices and
  the devices' attributes now, if someone removed it); spec files and claim directories no
  intent names, and whose claim has no CDI spec of its own (a claim adopted after a corrupt
  checkpoint keeps its files), are removed.

The claim's namespace, name, pod claim name and request refs come from the engine's read of
the ResourceClaim (``notes``); the attributes are those of the published devices
(``set_devices``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from agent.dra import cdi
from agent.dra.model import DraDevice
from agent.metadata import document as doc
from agent.metadata.document import MetadataDevice, MetadataError, RequestMetadata
from agent.metadata.files import MetadataFiles
from agent.metadata.notes import NotingClaimReader
from agent.node import checkpoint as cp
from agent.node.cdi import CdiSpecDirectory
from agent.node.effectors import (
    Describe,
    EffectFailed,
    Prepared,
    RecordIntents,
    StartupRecovery,
    undo_unfinished,
)
from agent.node.offload import FILES

NAME = "metadata"
log = logging.getLogger(__name__)


class MetadataEffector:
    """The ``DeviceEffector`` of the module docstring."""

    name = NAME

    def __init__(
        self,
        files: MetadataFiles,
        notes: NotingClaimReader | None,
        devices: Iterable[DraDevice] = (),
    ) -> None:
        """``notes`` None: ``--device-metadata`` is off; no claim gets files, but those of
        claims prepared while it was on are still removed (their intents name them)."""
        self._files = files
        self._notes = notes
        self._attributes: dict[str, dict[str, Any]] = {}
        self.set_devices(devices)

    @property
    def driver(self) -> str:
        return self._files.driver

    def set_devices(self, devices: Iterable[DraDevice]) -> None:
        """The published devices: their attributes go into the files written from now on."""
        self._attributes = {
            d.name: {key: value.to_dict() for key, value in d.attributes.items()} for d in devices
        }

    # -- DeviceEffector ----------------------------------------------------------------------

    def handles(self, device: str) -> bool:
        return self._notes is not None  # on: every prepared request gets its file

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None:
        return None  # files per claim: nothing to share

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        note = self._notes.take(uid) if self._notes is not None else None
        if note is None:
            raise EffectFailed(
                f"claim {uid}: device metadata needs the ResourceClaim, which this prepare did "
                "not read; the kubelet's retry reads it again"
            )
        pool = devices[0].pool if devices else ""
        refs = {d.device: note.requests.get(d.device) or d.requests for d in devices}
        grouped = doc.group_requests(refs.items())
        namespace, claim = note.namespace, note.name
        try:
            requests = [
                self._request(uid, namespace, claim, note.pod_claim_name, ref, names, pool)
                for ref, names in grouped.items()
            ]
            intents = tuple(_intent(m) for m in requests)
        except (MetadataError, cdi.CdiSpecError) as error:
            raise EffectFailed(f"claim {uid}: device metadata: {error}") from error
        await record(intents)  # durable before any file exists
        ids: dict[str, str] = {}
        try:
            for metadata in requests:
                ids[metadata.base_request] = await FILES.run(self._files.write, metadata)
        except OSError as error:
            removed = await self._remove(uid, intents, leftover_ok=True)
            raise EffectFailed(
                f"claim {uid}: could not write its device metadata under "
                f"{self._files.root} or {self._files.cdi_root}: {error}",
                () if removed else intents,
            ) from error
        return tuple(_with_ids(d, [ids[r] for r in d.requests if r in ids]) for d in devices)

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        await self._remove(uid, intents)

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery:
        report = await undo_unfinished(self.name, checkpoint, self.undo)
        problems = list(report.problems)
        for claim in checkpoint.completed():
            for intent in (i for i in claim.intents if i.effector == self.name):
                try:
                    metadata = self._rebuilt(claim, intent)
                    await FILES.run(self._files.ensure, metadata)
                except (MetadataError, cdi.CdiSpecError, OSError, ValueError) as error:
                    problems.append(f"claim {claim.uid}: cannot rebuild its metadata: {error}")
        problems.extend(await FILES.run(self._sweep, checkpoint))
        for problem in problems:
            log.warning("device metadata: %s", problem)
        return replace(report, problems=tuple(problems))

    # -- helpers -------------------------------------------------------------------------------

    def _request(
        self,
        uid: str,
        namespace: str,
        claim: str,
        pod_claim_name: str | None,
        request: str,
        names: list[str],
        pool: str,
    ) -> RequestMetadata:
        devices = tuple(
            MetadataDevice(pool, name, self._attributes.get(name, {})) for name in names
        )
        metadata = RequestMetadata(
            self.driver, namespace, claim, uid, request, pod_claim_name, devices
        )
        doc.cdi_spec(metadata, self._files.host_file(metadata))  # checks every name
        return metadata

    def _rebuilt(self, claim: cp.PreparedClaim, intent: cp.Intent) -> RequestMetadata:
        request = intent.string("request")
        base = doc.base_request(request)
        names = [d.device for d in claim.devices if base in d.requests]
        pool = claim.devices[0].pool if claim.devices else ""
        return self._request(
            claim.uid,
            intent.string("namespace"),
            intent.string("claim"),
            str(intent.get("podClaimName") or "") or None,
            request,
            names,
            pool,
        )

    async def _remove(
        self, uid: str, intents: tuple[cp.Intent, ...], *, leftover_ok: bool = False
    ) -> bool:
        """Remove the files of ``intents``; False when some could not be (``EffectFailed``
        unless ``leftover_ok``)."""
        failed: list[str] = []
        for intent in intents:
            try:
                args = (intent.string(k) for k in ("namespace", "claim", "request"))
                await FILES.run(self._files.remove, uid, *args)
            except (OSError, MetadataError, cdi.CdiSpecError) as error:
                failed.append(str(error))
        if failed and not leftover_ok:
            raise EffectFailed(
                f"claim {uid}: could not remove its device metadata: {'; '.join(failed)}",
                intents,
            )
        return not failed

    def _sweep(self, checkpoint: cp.Checkpoint) -> list[str]:
        """Remove spec files and claim directories no intent names (module docstring)."""
        kept = {
            c.uid for c in checkpoint.claims.values() if any(i.effector == NAME for i in c.intents)
        }
        kept |= CdiSpecDirectory(self._files.cdi_root, self.driver).claim_uids()
        doomed = [
            (path, self._files.remove_spec_file, "metadata spec")
            for path, uid in self._files.spec_files().items()
            if uid not in kept
        ] + [
            (path, self._files.remove_claim_dir, "metadata")
            for path, owner in self._files.claim_dirs().items()
            if owner not in kept
        ]
        problems = []
        for path, remove, what in doomed:
            try:
                remove(path)
            except OSError as error:
                problems.append(f"cannot remove the orphaned {what} {path}: {error}")
        return problems


def _intent(metadata: RequestMetadata) -> cp.Intent:
    """What ``recover`` rebuilds the request's files from (the checkpoint holds non-empty
    strings only: no ``podClaimName`` for a claim not made from a template)."""
    parameters = [
        ("namespace", metadata.namespace),
        ("claim", metadata.claim),
        ("request", metadata.request),
    ]
    if metadata.pod_claim_name:
        parameters.append(("podClaimName", metadata.pod_claim_name))
    return cp.Intent(NAME, metadata.devices[0].name, tuple(parameters))


def _with_ids(device: cp.PreparedDevice, ids: list[str]) -> cp.PreparedDevice:
    added = tuple(i for i in dict.fromkeys(ids) if i not in device.cdi_device_ids)
    return replace(device, cdi_device_ids=(*device.cdi_device_ids, *added)) if added else device
