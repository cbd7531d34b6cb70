"""Fault injection into a running simulated agent: the control socket and the ``sim`` commands.

Tests, the demo and an operator's dry run need to make a GPU fail *inside* a running agent, whose
simulated NVML library lives in the agent's process. In simulate mode (and only then) the agent
listens on ``<plugins-dir>/<driver>/sim-control.sock``; ``gpu-dra-agent sim xid|ecc|gpu-lost|
recover`` send one JSON request there and print the answer.
"""

from agent.sim.control.protocol import CONTROL_SOCKET_NAME, control_socket_path

__all__ = ["CONTROL_SOCKET_NAME", "control_socket_path"]
