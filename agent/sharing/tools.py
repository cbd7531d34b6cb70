"""The driver's own tools, run from the driver root: ``nvidia-smi`` and ``nvidia-cuda-mps-control``.

NVML has no call for the compute time-slice, and MPS is run and steered through its control
program; both come with the driver, so they are run from the driver root (``usr/bin``), with
the driver root's library directories first on ``LD_LIBRARY_PATH`` (a driver installed in a
container's root, as the GPU operator does, is not on the host's library path). Every call is
bounded (``timeout_s``) and a failure names the command and what it printed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio

from agent.errors import AgentError

NVIDIA_SMI = "nvidia-smi"
MPS_CONTROL = "nvidia-cuda-mps-control"
LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64")
#: ``nvidia-smi compute-policy --set-timeslice`` levels by the config's interval names.
TIMESLICE_LEVELS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class ToolFailed(AgentError):
    """A driver tool could not be run, timed out or exited with an error."""


class DriverTools:
    """Runs the driver's tools found under ``driver_root`` (where this process sees it)."""

    def __init__(self, driver_root: Path, timeout_s: float = 10.0) -> None:
        self.root = Path(driver_root)
        self.bin_dir = self.root / "usr/bin"
        self.timeout_s = timeout_s

    def path(self, tool: str) -> Path:
        return self.bin_dir / tool

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, the driver's libraries first, plus ``extra``."""
        env = dict(os.environ)
        libraries = [str(self.root / d) for d in LIBRARY_DIRS if (self.root / d).is_dir()]
        if libraries:
            current = env.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = ":".join([*libraries, *([current] if current else [])])
        env.update(extra or {})
        return env

    async def run(
        self,
        tool: str,
        args: Sequence[str],
        *,
        stdin: str = "",
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Run ``tool args``; its standard output, or ``ToolFailed``."""
        path = self.path(tool)
        command = [str(path), *args]
        shown = " ".join([tool, *args])
        if not path.is_file():
            raise ToolFailed(
                f"{shown}: {path} does not exist; is the driver root ({self.root}) mounted and "
                "does its driver ship the tool?"
            )
        try:
            with anyio.fail_after(self.timeout_s):
                result = await anyio.run_process(
                    command, input=stdin.encode(), env=self.environment(env), check=False
                )
        except TimeoutError:
            raise ToolFailed(f"{shown}: no answer within {self.timeout_s:g} s") from None
        except OSError as error:
            raise ToolFailed(f"{shown}: cannot run {path}: {error}") from error
        output = result.stdout.decode(errors="replace").strip()
        if result.returncode != 0:
            said = (result.stderr.decode(errors="replace").strip() or output)[-500:]
            raise ToolFailed(f"{shown}: exit status {result.returncode}: {said or 'no output'}")
        return output

    async def set_timeslice(self, gpu_uuid: str, interval: str) -> None:
        """``nvidia-smi compute-policy -i <uuid> --set-timeslice=<level>``."""
        level = TIMESLICE_LEVELS[interval]
        await self.run(NVIDIA_SMI, ["compute-policy", "-i", gpu_uuid, f"--set-timeslice={level}"])

    async def mps_control(self, pipe_dir: Path, commands: Sequence[str]) -> str:
        """Send ``commands`` (one per line) to the MPS control daemon of ``pipe_dir``."""
        return await self.run(
            MPS_CONTROL,
            [],
            stdin="".join(f"{c}\n" for c in commands),
            env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)},
        )
