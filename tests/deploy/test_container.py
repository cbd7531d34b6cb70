"""deploy/container/Dockerfile, checked without a container engine (none on CI machines).

What can go wrong without building it: copying files that do not exist, a base image older
than the project's Python, an entrypoint that is not the project's script, a venv path that
differs from what the probes and docs use, and losing the build-time bytecode step.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from tests.deploy.conftest import ROOT, build

DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comment lines dropped."""
    joined: list[str] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            joined.append(current.strip())
            current = ""
    return [(line.split(" ", 1)[0], line.split(" ", 1)[1]) for line in joined]


def test_every_copied_file_exists() -> None:
    sources = []
    for op, args in instructions():
        if op == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source


def base_arguments() -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults (what FROM may name)."""
    defaults: dict[str, str] = {}
    for op, args in instructions():
        if op == "FROM":
            break
        if op == "ARG":
            name, _, default = args.partition("=")
            defaults[name] = default
    return defaults


def test_base_images_satisfy_the_projects_python() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = tuple(int(p) for p in project["requires-python"].removeprefix(">=").split("."))
    bases = [args.split()[0] for op, args in instructions() if op == "FROM"]
    assert len(bases) == 2 and len(set(bases)) == 1, "build and runtime stages must match"
    # One build argument names the base (make image builds on a Debian-made one); its default
    # is the public image docker users build on.
    assert bases[0] == "${BASE_IMAGE}"
    base = base_arguments()["BASE_IMAGE"]
    match = re.fullmatch(r"python:(\d+)\.(\d+)-slim-\w+", base)
    assert match is not None, base
    assert (int(match[1]), int(match[2])) >= minimum


def test_locked_install_with_bytecode_and_the_agent_as_entrypoint() -> None:
    runs = " ".join(args for op, args in instructions() if op == "RUN")
    assert "pip install --no-deps -r requirements.lock" in runs
    assert "pip check" in runs
    assert "compileall" in runs
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = [args for op, args in instructions() if op == "ENTRYPOINT"]
    assert entrypoint == ['["gpu-dra-agent"]'] and "gpu-dra-agent" in scripts
    env = " ".join(args for op, args in instructions() if op == "ENV")
    assert "PATH=/opt/gpu-dra-agent/venv/bin:$PATH" in env  # exec probes call gpu-dra-agent


def test_the_daemonset_runs_this_image_with_a_run_command() -> None:
    daemonset = next(
        o for o in build(ROOT / "deploy/kubernetes/overlays/production") if o["kind"] == "DaemonSet"
    )
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's entrypoint is the agent"
    assert container["args"][0] == "run"


def test_nvml_is_loaded_from_the_daemonsets_driver_root_and_nothing_else() -> None:
    runs = " ".join(args for op, args in instructions() if op == "RUN")
    env = " ".join(args for op, args in instructions() if op == "ENV")
    (library_path,) = re.findall(r"LD_LIBRARY_PATH=(\S+)", env)
    links = re.search(r'ln -s "([^"]+)/\$dir/libnvidia-ml\.so\.1" "([^"]+)/\$dir/"', runs)
    assert links is not None
    driver_root, link_dir = links.groups()
    dirs = re.search(r"for dir in ([^;]+); do", runs)
    assert dirs is not None
    assert library_path.split(":") == [f"{link_dir}/{d}" for d in dirs[1].split()]
    daemonset = next(
        o for o in build(ROOT / "deploy/kubernetes/overlays/production") if o["kind"] == "DaemonSet"
    )
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env_vars = {e["name"]: e.get("value") for e in container["env"]}
    assert env_vars["NVIDIA_DRIVER_ROOT_MOUNT"] == driver_root
    assert "LD_LIBRARY_PATH" not in env_vars  # the driver root's own libc must stay out
    assert driver_root in {m["mountPath"] for m in container["volumeMounts"]}


def test_the_build_context_holds_exactly_what_is_copied() -> None:
    """.dockerignore excludes everything but the COPY sources: a new COPY whose file is left
    out fails here, not in the middle of a build; the venv and .cache stay out."""
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line.removeprefix("!") for line in lines if line.startswith("!")}
    copied = {
        source
        for op, args in instructions()
        if op == "COPY" and not args.startswith("--from")
        for source in args.split()[:-1]
    }
    assert allowed == copied


def _script_env(tmp_path: Path, *tools: str) -> dict[str, str]:
    """PATH with only the named system tools (symlinked), as on a machine without the rest."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    return {**os.environ, "PATH": str(bin_dir)}


def test_make_image_names_the_missing_tools_one_line_each(tmp_path: Path) -> None:
    bash = shutil.which("bash") or "/bin/bash"
    result = subprocess.run(
        [bash, str(ROOT / "scripts" / "build_image.sh")],
        capture_output=True,
        text=True,
        env={**_script_env(tmp_path, "dirname", "id"), "IMAGE_DIR": str(tmp_path / "image")},
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "missing: mmdebstrap (make image): sudo apt-get install mmdebstrap"
    assert lines[1] == "missing: buildah (make image): sudo apt-get install buildah"
    if os.geteuid() != 0:
        assert lines[2] == "missing: newuidmap (make image): sudo apt-get install uidmap"
    assert not (tmp_path / "image").exists(), "nothing is made before the tools are there"
