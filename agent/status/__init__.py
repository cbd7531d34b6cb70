"""``gpu-dra-agent status``: what the agent believes about this node, and whether the
checkpoint, the CDI files, the hardware, the daemons and the published slices agree.

Read-only by construction: every source is read without the agent's locks and nothing is
written, so it answers while the agent runs and while it is down. ``collect`` and
``collect_live`` gather plain data, ``drift`` compares it (pure functions), ``render``
prints it, ``cli`` wires the command.
"""
