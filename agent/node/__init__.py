"""The node's durable state and its effectors.

A prepare is acknowledged to the kubelet only after what is needed to undo it is on disk,
so this package owns every file the agent keeps on the node: ``durable`` (atomic writes,
fsync of file and directory, the inter-process node lock), ``checkpoint`` (the record of
prepared claims that survives agent restarts and detects reboots) and ``cdi`` (the CDI spec
files the container runtime reads). Decisions about *what* to write are made by the pure
``agent.dra`` layer; these modules only make them durable.
"""
