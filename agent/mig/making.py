"""Making dynamic MIG devices for one claim, under the GPU's lock: the instance at the
allocated placement (``steps.make_instance``, one trip to the NVML thread), a further share
of a placement that uses the instance its first share made, and the full GPU of a
partitionable GPU (no instance may exist; MIG mode goes off).

``MigEffector`` (``effector``) is the class; this mixin holds these methods so that each
module stays readable in one sitting.
"""

from __future__ import annotations

from dataclasses import replace

from agent.crash import crash_point
from agent.dra.partitionable import mode_change_without_reset
from agent.hardware.hostfiles import HostFiles
from agent.hardware.mig_ops import LiveGpuInstance, MigOps
from agent.mig.steps import HalfMade, ModeOff, Occupied, make_instance, reconfigure_span
from agent.mig.teardown import Made
from agent.mig.users import InstanceUsers
from agent.node import checkpoint as cp
from agent.node.effectors import EffectFailed
from agent.node.plan import NodeDevice


class MigMaking:
    """The making half of :class:`agent.mig.effector.MigEffector`."""

    _ops: MigOps
    _host: HostFiles
    _caps_major: int | None
    _users: InstanceUsers
    #: (parent UUID, GI id) -> the claim whose instance it is
    _owners: dict[tuple[str, int], str]

    async def _whole(
        self, uid: str, node: NodeDevice, enabled: bool, instances: list[LiveGpuInstance]
    ) -> bool:
        """A full-GPU device: no instance may exist; MIG mode goes off. Returns the mode."""
        gpu = node.gpu
        if instances:
            listed = ", ".join(self._describe_instance(gpu.uuid, gi) for gi in instances)
            raise EffectFailed(
                f"claim {uid}: device {node.name} is the whole GPU {gpu.minor} ({gpu.uuid}), "
                f"which has MIG instances: {listed}; it can be prepared once they are gone"
            )
        if not enabled:
            return False
        with reconfigure_span("mode", gpu) as span:
            span.set_attribute("mig.mode", "off")
            await self._ops.set_mig_mode(gpu.uuid, False)
        return False

    async def _attach(
        self, uid: str, node: NodeDevice, device: cp.PreparedDevice, shared: cp.PreparedDevice
    ) -> tuple[cp.PreparedDevice, LiveGpuInstance]:
        """A further share of a placement: the instance made for its first share (the caller
        holds the GPU's lock), which must still be there."""
        gpu, slot, mig = node.gpu, node.slot, shared.mig
        assert slot is not None and mig is not None
        layout = await self._ops.read_layout(gpu.uuid, with_uuids=False)
        live = next(
            (
                gi
                for gi in layout.instances
                if gi.id == mig.gi_id
                and gi.start == slot.placement.start
                and gi.profile_id == slot.profile.profile_id
            ),
            None,
        )
        if live is None:
            users = ", ".join(self._users.users(device.device)) or "none"
            raise EffectFailed(
                f"claim {uid}: device {node.name}: the GPU instance {mig.gi_id} its other "
                f"shares use (claims {users}) is gone from GPU {gpu.minor} ({gpu.uuid}); "
                "unprepare those claims (delete their pods) so that the next share makes it "
                "again"
            )
        crash_point("after-mig-share-attach")
        return replace(device, uuid=shared.uuid, mig=mig), live

    async def _create(
        self,
        uid: str,
        node: NodeDevice,
        device: cp.PreparedDevice,
        intent: cp.Intent,
        created: list[Made],
    ) -> tuple[cp.PreparedDevice, LiveGpuInstance]:
        gpu, slot = node.gpu, node.slot
        assert slot is not None
        start, size = slot.placement.start, slot.placement.size
        with reconfigure_span("create", gpu, intent) as span:
            try:  # one trip to the NVML thread for the whole sequence
                gi_id, ci_id, mig_uuid, minors, mode_on = await self._ops.run(
                    make_instance,
                    self._host,
                    gpu.uuid,
                    gpu.minor,
                    mode_change_without_reset(gpu),
                    slot.profile.profile_id,
                    start,
                    size,
                    intent.integer("computeProfile"),
                )
            except Occupied as occupied:
                raise EffectFailed(
                    f"claim {uid}: device {node.name} cannot be made: placement "
                    f"{start}+{size} of GPU {gpu.minor} ({gpu.uuid}) is occupied by "
                    f"{self._describe_instance(gpu.uuid, occupied.instance)}"
                ) from None
            except ModeOff:
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: MIG mode of GPU {gpu.minor} "
                    f"({gpu.uuid}) is off, and an {gpu.architecture} GPU needs a reset to "
                    "turn it on; enable MIG mode (nvidia-smi -mig 1) and reset the GPU"
                ) from None
            except HalfMade as half:
                created.append(Made(intent, half.gi_id))
                if half.gi_id is not None:
                    self._owners[(gpu.uuid, half.gi_id)] = uid
                    span.set_attribute("mig.gpu_instance.id", half.gi_id)
                raise EffectFailed(f"claim {uid}: device {node.name}: {half.cause}") from half
            if mode_on:
                span.set_attribute("mig.mode", "on")
            created.append(Made(intent, gi_id, ci_id))
            self._owners[(gpu.uuid, gi_id)] = uid
            span.set_attribute("mig.gpu_instance.id", gi_id)
            span.set_attribute("mig.compute_instance.id", ci_id)
            if not mig_uuid.startswith("MIG-"):
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: NVML gave no MIG UUID for GPU "
                    f"instance {gi_id} compute instance {ci_id} of GPU {gpu.uuid}"
                )
            if self._caps_major is None or minors is None:
                raise EffectFailed(
                    f"claim {uid}: device {node.name}: no nvidia-caps major in /proc/devices or "
                    f"no capability file for gpu{gpu.minor}/gi{gi_id}/ci{ci_id} under "
                    "/proc/driver/nvidia/capabilities; is the nvidia-caps module loaded?"
                )
        mig = cp.MigInstance(gpu.uuid, gi_id, ci_id, self._caps_major, *minors)
        live = LiveGpuInstance(gi_id, slot.profile.profile_id, start, size)
        return replace(device, uuid=mig_uuid, mig=mig), live

    def _describe_instance(self, parent: str, gi: LiveGpuInstance) -> str:
        owner = self._owners.get((parent, gi.id))
        whose = f"made for claim {owner}" if owner else "not made by this agent for any claim"
        return f"GPU instance {gi.id} (profile id {gi.profile_id}, placement {gi.start}+{gi.size}, {whose})"
