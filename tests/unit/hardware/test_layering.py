"""The hardware layer is the bottom layer: it imports nothing from the layers above it.

``agent/hardware`` is what every other part builds on (discovery, the NVML facade, the event
pump, the simulated library). An import from ``agent.health``, ``agent.dra``, ``agent.kube``,
``agent.kubelet`` or ``agent.node`` would tie it to code that itself depends on the hardware
layer, which is how the package cycles of round 1 came about. The simulated library must not
have an import cycle among its own modules either. Both are checked on the source (every import
statement, including those inside functions and under ``TYPE_CHECKING``), and the checkers are
themselves tested on small packages that break the rules.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

import agent

AGENT = Path(agent.__file__).parent
FORBIDDEN = ("agent.health", "agent.dra", "agent.kube", "agent.kubelet", "agent.node")


def module_name(path: Path, root: Path) -> str:
    """``agent.hardware.events`` for ``<root>/agent/hardware/events.py`` (root holds ``agent``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def statements(path: Path, root: Path) -> Iterator[tuple[int, list[str], list[str]]]:
    """Each import statement of a file as (line, modules, from-names): ``import a, b`` gives
    ``[a, b]`` and no names; ``from P import x, y`` gives ``[P]`` and ``[P.x, P.y]`` (each may be
    a submodule or a name defined in ``P``). Relative imports are resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node.lineno, [alias.name for alias in node.names], []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, [module], [f"{module}.{alias.name}" for alias in node.names]


def imports_of(path: Path, root: Path) -> Iterator[tuple[str, int]]:
    """Every module a file may import, with its line (``from P import x`` yields P and P.x)."""
    for line, modules, names in statements(path, root):
        for module in modules + names:
            yield module, line


def upward_imports(package_dir: Path, root: Path) -> list[str]:
    """``file:line -> module`` for each import statement of a forbidden layer under
    ``package_dir`` (the first forbidden name the statement imports)."""
    found: dict[tuple[Path, int], str] = {}
    for path in sorted(package_dir.rglob("*.py")):
        for module, line in imports_of(path, root):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN):
                found.setdefault((path, line), f"{path.relative_to(root)}:{line} -> {module}")
    return list(found.values())


def targets(path: Path, root: Path, modules: Collection[str]) -> set[str]:
    """The modules among ``modules`` that a file depends on. ``from P import x`` depends on the
    submodule ``P.x`` when there is one, and on the package ``P`` only for names defined there
    (a package ``__init__`` that re-exports its submodules is no dependency of theirs)."""
    found: set[str] = set()
    for _, imported, names in statements(path, root):
        found |= {
            m for m in imported if m in modules and not (names and all(n in modules for n in names))
        }
        found |= {n for n in names if n in modules}
    return found


def import_cycles(package_dir: Path, root: Path) -> list[list[str]]:
    """The import cycles among the modules of one package (strongly connected components)."""
    modules = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        edges[name] = targets(path, root, modules) - {name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_hardware_imports_no_higher_layer() -> None:
    assert upward_imports(AGENT / "hardware", AGENT.parent) == []


def test_simulated_library_has_no_import_cycle() -> None:
    assert import_cycles(AGENT / "hardware" / "simulated", AGENT.parent) == []


def test_the_hardware_modules_are_all_seen() -> None:
    """The checks read the real tree (an empty walk would pass vacuously)."""
    names = {module_name(p, AGENT.parent) for p in (AGENT / "hardware").rglob("*.py")}
    assert {"agent.hardware.events", "agent.hardware.simulated.library"} <= names
    events = dict(imports_of(AGENT / "hardware" / "events.py", AGENT.parent))
    assert "agent.hardware.health_events" in events


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_upward_imports_are_found_in_every_spelling(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/hardware/__init__.py": "",
            "agent/hardware/a.py": "from agent.health.events import HealthEvent\n",
            "agent/hardware/b.py": "def f():\n    import agent.kube.rawapi\n",
            "agent/hardware/c.py": "from agent import dra\n",
            "agent/hardware/sub/__init__.py": "",
            "agent/hardware/sub/d.py": "from ...node import engine\n",
            "agent/hardware/e.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agent.kubelet.api import X\n"
            ),
            "agent/hardware/ok.py": "from agent.hardware import a\nfrom agent.errors import E\n",
        },
    )
    found = upward_imports(tmp_path / "agent" / "hardware", tmp_path)
    assert found == [
        "agent/hardware/a.py:1 -> agent.health.events",
        "agent/hardware/b.py:2 -> agent.kube.rawapi",
        "agent/hardware/c.py:1 -> agent.dra",
        "agent/hardware/e.py:3 -> agent.kubelet.api",
        "agent/hardware/sub/d.py:1 -> agent.node",
    ]


def test_a_cycle_is_found_even_under_type_checking(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "agent/__init__.py": "",
            "agent/sim/__init__.py": "",
            "agent/sim/library.py": "from agent.sim import capi\nimport agent.sim.core\n",
            "agent/sim/capi.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agent.sim.library import Lib\n"
            ),
            "agent/sim/core.py": "",
        },
    )
    assert import_cycles(tmp_path / "agent" / "sim", tmp_path) == [
        ["agent.sim.capi", "agent.sim.library"]
    ]
    (tmp_path / "agent/sim/capi.py").write_text("from agent.sim.core import Lib\n")
    assert import_cycles(tmp_path / "agent" / "sim", tmp_path) == []
