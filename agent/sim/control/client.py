"""The ``sim`` commands' side of the control socket: send one request, return the answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from agent.errors import AgentError
from agent.sim.control.protocol import decode, encode


class ControlError(AgentError):
    """The control socket cannot be reached, or it refused the request."""


async def send_request(
    path: Path,
    request: dict[str, Any],
    timeout: float = 10.0,  # noqa: ASYNC109
) -> dict[str, Any]:
    """Send ``request`` to the agent listening on ``path``; raises ControlError."""
    try:
        with anyio.fail_after(timeout):
            async with await anyio.connect_unix(path) as stream:
                await stream.send(encode(request))
                data = b""
                while not data.endswith(b"\n"):
                    data += await stream.receive()
    except (OSError, anyio.EndOfStream) as err:
        raise ControlError(
            f"cannot reach the simulated agent's control socket {path}: {err}; is "
            "`gpu-dra-agent run --simulate ...` running with the same --plugins-dir and "
            "--driver-name?"
        ) from err
    except TimeoutError as err:
        raise ControlError(f"the control socket {path} did not answer in {timeout:g} s") from err
    reply = decode(data)
    if not reply.get("ok"):
        raise ControlError(f"the simulated agent refused the request: {reply.get('error')}")
    return reply


async def wait_engine_started(plugin_dir: Path, timeout: float = 30.0) -> None:  # noqa: ASYNC109
    """Until a simulated agent whose data directory is ``plugin_dir`` accepts connections on its
    control socket: it opens it once its prepare engine and health monitor run, after the
    kubelet's sockets (which open first, so a registration alone does not say the engine is
    up). Harnesses that inject faults or read the checkpoint right after a start wait here;
    raises ``TimeoutError``."""
    from agent.sim.control.protocol import control_socket_path

    path = control_socket_path(plugin_dir)
    with anyio.fail_after(timeout):
        while True:
            try:
                stream = await anyio.connect_unix(path)
            except OSError:  # not there yet, or a killed agent's socket file
                await anyio.sleep(0.02)
                continue
            await stream.aclose()
            return
