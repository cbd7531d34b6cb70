"""``gpu-dra-agent sim apiserver``: run the embedded API server on its own, until SIGINT/SIGTERM.

Lets a developer point the agent, ``kubectl`` or a debugger at a throw-away API server without a
cluster. ``agent/cli.py`` mounts :func:`configure_parser` and dispatches to :func:`run`.
"""

from __future__ import annotations

import argparse
import signal
import sys

import anyio

from agent.sim.apiserver.server import EmbeddedApiServer


def _listen_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:6443, got {text!r}")
    return host.strip("[]"), int(port)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=_listen_address,
        default=("127.0.0.1", 0),
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free port (default 127.0.0.1:0)",
    )
    parser.add_argument(
        "--kubeconfig-out",
        metavar="FILE",
        help="write a kubeconfig pointing at the server to FILE",
    )
    parser.add_argument(
        "--kubernetes-version",
        default="1.35.0",
        help="version reported by /version (default 1.35.0)",
    )
    parser.add_argument(
        "--bookmark-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="interval of watch BOOKMARK events (default 60)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=0,
        metavar="N",
        help="answer 429 with Retry-After beyond N requests handled at once, as kube-apiserver's "
        "priority and fairness does; watches hold no seat (default 0: no limit)",
    )


async def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; returns the process exit code."""
    host, port = args.listen
    try:
        server = EmbeddedApiServer(
            kubernetes_version=args.kubernetes_version,
            bookmark_interval=args.bookmark_interval,
            max_in_flight=args.max_in_flight,
        )
    except ValueError as error:
        print(f"gpu-dra-agent sim apiserver: {error}", file=sys.stderr)
        return 2
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            url = await server.start(host, port)
        except OSError as error:
            print(f"gpu-dra-agent sim apiserver: cannot listen on {host}:{port}: {error}",
                  file=sys.stderr)  # fmt: skip
            return 1
        try:
            print(f"embedded API server listening on {url}", flush=True)
            if args.kubeconfig_out:
                path = server.write_kubeconfig(args.kubeconfig_out)
                print(f"kubeconfig written to {path}", flush=True)
            async for received in signals:
                print(f"received {signal.Signals(received).name}, stopping", flush=True)
                break
        finally:
            await server.stop()
    return 0
