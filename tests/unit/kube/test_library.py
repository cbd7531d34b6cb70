"""agent.kube.library: kubernetes-asyncio loaded by the parts the agent uses, the rest on demand.

Each check runs in a fresh interpreter: the test process has imported the whole library long
before (the simulators use its models), and then nothing is deferred.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_fresh(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_only_the_used_parts_are_imported() -> None:
    out = run_fresh(
        """
        import sys
        import agent.kube.library as library
        loaded = [m for m in sys.modules if m.startswith("kubernetes_asyncio")]
        print(len(loaded))
        print("kubernetes_asyncio.client.models.v1_pod" in sys.modules)
        print("kubernetes_asyncio.client.api.apps_v1_api" in sys.modules)
        print(library.CoreV1Api.__module__, library.ApiClient.__module__)
        """
    )
    count, model, apps, where = out.splitlines()
    assert int(count) < 40
    assert model == "False" and apps == "False"
    assert where == (
        "kubernetes_asyncio.client.api.core_v1_api kubernetes_asyncio.client.api_client"
    )


def test_every_other_name_is_still_there() -> None:
    out = run_fresh(
        """
        import agent.kube.library as library
        import kubernetes_asyncio
        from kubernetes_asyncio import client, config, watch
        from kubernetes_asyncio.client import ApiClient, Configuration, rest
        print(ApiClient is library.ApiClient, Configuration is library.Configuration)
        print(client.CoreV1Api is library.CoreV1Api, rest.__name__)
        print(client.V1Pod.__name__, client.models.V1Node.__name__, client.AppsV1Api.__name__)
        print(config.load_config.__name__, watch.Watch.__name__, kubernetes_asyncio.__version__)
        """
    )
    assert out.splitlines() == [
        "True True",
        "True kubernetes_asyncio.client.rest",
        "V1Pod V1Node AppsV1Api",
        f"load_config Watch {_version()}",
    ]


def test_an_unknown_name_is_an_attribute_error() -> None:
    out = run_fresh(
        """
        import agent.kube.library
        from kubernetes_asyncio import client
        try:
            client.NoSuchThing
        except AttributeError:
            print("AttributeError")
        """
    )
    assert out.strip() == "AttributeError"


def _version() -> str:
    import kubernetes_asyncio

    return str(kubernetes_asyncio.__version__)


def test_the_agent_takes_the_library_through_agent_kube_library() -> None:
    """Any other ``from kubernetes_asyncio.client import X`` runs the package's ``__init__``
    (every model: some 40 MB an agent; the binder's import of ResourceV1Api once did).
    ``from kubernetes_asyncio import client`` is fine: it binds the deferred package."""
    import ast
    from pathlib import Path

    import agent

    root = Path(agent.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if (path.name == "library.py" and path.parent.name == "kube") or "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [
                f"{path.relative_to(root)}:{node.lineno} {name}"
                for name in names
                if name.startswith("kubernetes_asyncio.client")
            ]
    assert found == []
