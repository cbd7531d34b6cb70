"""GPU health: NVML events in, device taints and the kubelet's health stream out.

The incumbent driver taints a GPU on a fatal XID and never untaints it until the plugin restarts,
has no health stream to the kubelet, and cannot watch health while dynamic MIG is on. Here the
decisions live in a pure state machine (:mod:`agent.health.state`, configured by
:mod:`agent.health.policy`), NVML events come from the pump in :mod:`agent.hardware.events`, and
:mod:`agent.health.monitor` applies each decision: ResourceSlice taints through the slice
publisher, the ``DRAResourceHealth`` stream (:mod:`agent.health.stream`), a Node Event, a log
line and a span. Recovery is part of the machine, not an afterthought.
"""
