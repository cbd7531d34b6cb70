"""ComputeDomains over IMEX: the ``compute-domain.nvidia.com`` driver of the node agent.

Pods on different compute trays of one NVLink clique share memory through IMEX channels. The
agent serves a second DRA driver next to ``gpu.nvidia.com`` (its own sockets, its own slice
with the device ``channel-0``); preparing a channel claim joins the node to the claim's
ComputeDomain (an entry in the domain's ``status.nodes``, written with optimistic
concurrency), runs the node's IMEX daemon for that domain as a supervised child and injects
the channel device nodes through CDI. ``controller`` turns a ComputeDomain into the
ResourceClaimTemplate pods use. docs/ARCHITECTURE.md, "ComputeDomains", has the whole story.
"""

#: The driver's name, in the package (which loads nothing), so that its kubelet sockets
#: (:mod:`agent.imex.sockets`) open before the configs' and devices' modules load.
DRIVER = "compute-domain.nvidia.com"
