"""The NVML error matrix: every recorded NVML function failing with every error code.

``Matrix`` runs an operation once to record the C functions it calls, then once per
(function, code) with that function's next call failing (``fail_next``), and collects what
went wrong; ``test_nvml_errors.py`` holds the operations and their promises.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pynvml

from agent.hardware.errors import HardwareError, NvmlLibraryNotFound
from agent.hardware.simulated import SimulatedHost

#: Every error code the bindings define (NVML_ERROR_UNKNOWN is 999).
CODES = sorted(
    {v for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_") and isinstance(v, int)}
)
#: Codes by which NVML says an instance does not exist (or MIG is off).
ABSENT = {pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED}
#: Codes a step may absorb by design: IN_USE (a destroy is retried while a process exits),
#: INVALID_ARGUMENT (with NOT_SUPPORTED and NOT_FOUND: "this GPU offers no such profile"
#: while the layout's profiles are listed).
SOFT = {pynvml.NVML_ERROR_IN_USE, pynvml.NVML_ERROR_INVALID_ARGUMENT}
#: One case (an operation with one injected failure) must end within this.
CASE_LIMIT_S = 5.0
#: Functions recorded but not injected: session setup and teardown around the MIG and
#: compute-mode cases (discovery covers them: it opens its own session).
SESSION = {"nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString"}


def python_name(c_function: str) -> str:
    """The pynvml name of a C function (``nvmlDeviceGetCount_v2`` -> ``nvmlDeviceGetCount``;
    a ``...V`` struct variant is named after its unversioned function, which it falls back to)."""
    return re.sub(r"(_v\d+|V)$", "", c_function)


def precise(error: BaseException, function: str, code: int) -> bool:
    """A HardwareError that names the failed call and its code (a library that cannot be
    loaded has its own error, which says what to install)."""
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND and function.startswith("nvmlInit"):
        return isinstance(error, NvmlLibraryNotFound)
    text = str(error)
    return (
        isinstance(error, HardwareError)
        and python_name(function) in text
        and f"NVML error {code}" in text
    )


def clear_failures(host: SimulatedHost) -> None:
    with host.library.lock:  # injected failures the case did not consume must not leak
        host.library._failures.clear()
        host.library._gpu_failures.clear()


def recorded(host: SimulatedHost) -> dict[str, int]:
    with host.library.lock:
        return dict(host.library.calls)


class Matrix:
    """Runs one operation for every (recorded function, code) and collects what went wrong."""

    def __init__(self, host: SimulatedHost) -> None:
        self.host = host
        self.problems: list[str] = []
        self.cases = 0

    async def record(self, operation: Callable[[], Awaitable[Any]]) -> list[str]:
        before = recorded(self.host)
        await operation()
        after = recorded(self.host)
        called = [f for f, n in after.items() if n > before.get(f, 0)]
        return sorted(set(called) - SESSION)

    async def run(
        self,
        functions: list[str],
        case: Callable[[str, int], Awaitable[str | None]],
        reset: Callable[[], Awaitable[None]],
    ) -> None:
        for function in functions:
            for code in CODES:
                self.cases += 1
                clear_failures(self.host)
                self.host.library.fail_next(function, code)
                try:
                    with anyio.fail_after(CASE_LIMIT_S):
                        problem = await case(function, code)
                except TimeoutError:
                    problem = f"no answer within {CASE_LIMIT_S} s"
                except Exception as error:
                    problem = f"raised {type(error).__name__}: {error}"
                clear_failures(self.host)
                if problem:
                    self.problems.append(f"{function} -> {code}: {problem}")
                try:
                    await reset()
                except Exception as error:
                    self.problems.append(
                        f"{function} -> {code}: the next clean run failed: "
                        f"{type(error).__name__}: {error}"
                    )

    def check(self, minimum_functions: int, functions: list[str]) -> None:
        assert len(functions) >= minimum_functions, functions
        assert self.cases == len(functions) * len(CODES)
        assert not self.problems, "\n".join(self.problems[:40])
