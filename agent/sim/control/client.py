"""The ``sim`` commands' side of the control socket: send one request, return the answer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream

from agent.errors import AgentError
from agent.sim.control.protocol import decode, encode

log = logging.getLogger(__name__)

#: How often a waiting client tries the socket again, and after how long it says it waits.
RETRY_INTERVAL = 0.05
NOTICE_AFTER = 1.0

_CHECK = (
    "is `gpu-dra-agent run --simulate ...` running with the same --plugins-dir and --driver-name?"
)


class ControlError(AgentError):
    """The control socket cannot be reached, or it refused the request."""


async def send_request(
    path: Path,
    request: dict[str, Any],
    timeout: float = 10.0,  # noqa: ASYNC109
    *,
    wait: float = 0.0,
) -> dict[str, Any]:
    """Send ``request`` to the agent listening on ``path``; raises ControlError. While nothing
    listens there yet (an agent still starting), try again for up to ``wait`` seconds; then
    the answer has ``timeout`` seconds."""
    stream = await connect(path, wait)
    try:
        with anyio.fail_after(timeout):
            async with stream:
                await stream.send(encode(request))
                data = b""
                while not data.endswith(b"\n"):
                    data += await stream.receive()
    except (OSError, anyio.EndOfStream) as err:
        raise ControlError(
            f"cannot reach the simulated agent's control socket {path}: {err}; {_CHECK}"
        ) from err
    except TimeoutError as err:
        raise ControlError(f"the control socket {path} did not answer in {timeout:g} s") from err
    reply = decode(data)
    if not reply.get("ok"):
        raise ControlError(f"the simulated agent refused the request: {reply.get('error')}")
    return reply


async def connect(path: Path, wait: float = 0.0) -> SocketStream:
    """A connection to the control socket ``path``. The agent opens it once its prepare engine
    and health monitor run, a moment after its start: while the socket (or its directory) does
    not exist yet, or refuses connections (a stopped agent's file, before its successor
    replaces it), try again for up to ``wait`` seconds, saying so after a second. Raises
    ControlError, at once for any other failure."""
    started = anyio.current_time()
    deadline, noticed = started + wait, False
    while True:
        try:
            return await anyio.connect_unix(path)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            now = anyio.current_time()
            if now >= deadline:
                raise ControlError(_not_listening(path, wait, err)) from err
            if not noticed and now - started >= NOTICE_AFTER:
                noticed = True
                log.info(
                    "waiting up to %g s for the simulated agent's control socket %s "
                    "(it opens once the agent's prepare engine runs)",
                    wait,
                    path,
                )
            await anyio.sleep(min(RETRY_INTERVAL, deadline - now))
        except OSError as err:
            raise ControlError(
                f"cannot reach the simulated agent's control socket {path}: {err}; {_CHECK}"
            ) from err


def _not_listening(path: Path, wait: float, err: OSError) -> str:
    """Why nothing answered on ``path``: the socket's directory, the socket or a listener."""
    if not path.parent.is_dir():
        why = f"its directory {path.parent} does not exist"
    elif isinstance(err, FileNotFoundError):
        why = "the socket does not exist"
    elif not path.is_socket():
        why = "it is not a socket"
    else:
        why = "nothing listens on it (connection refused: a stopped agent's socket file?)"
    waited = (
        f" after {wait:g} s of waiting for the agent to open it (once its prepare engine runs)"
        if wait
        else ""
    )
    return f"cannot reach the simulated agent's control socket {path}{waited}: {why}; {_CHECK}"


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
