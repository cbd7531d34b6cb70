"""Containers run by podman with CDI devices, and what a probe inside them sees.

The probe image is the smallest thing that can show a container's view: Debian's ``busybox``
and ``libc-bin`` (for ``ldconfig``), unpacked by ``mmdebstrap --variant=extract`` from the
same mirrors ``make image`` builds the agent's image from, cached under
``.cache/runtime/``. Each container runs from a fresh copy of that tree (``podman run
--rootfs``): no image store, no layer copies, and nothing one container writes (its
``/etc/ld.so.cache``) is seen by the next.

podman (4.3.1 in Debian 12) reads CDI specs from ``/etc/cdi`` and ``/var/run/cdi`` only, with
no setting to name others. So each container is started in a mount namespace of its own
(``unshare --mount``) where the test's CDI directory is bind-mounted on ``/var/run/cdi`` and
an empty tmpfs hides ``/etc/cdi``: the specs of this machine are never read, and the test's
never land in the machine's directories.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.conftest import ROOT

CACHE = ROOT / ".cache" / "runtime"
SUITE = os.environ.get("SUITE", "bookworm")
MIRROR = os.environ.get("MIRROR", "http://deb.debian.org")
PACKAGES = "busybox,libc-bin"
TOOLS = ("podman", "runc", "mmdebstrap", "unshare")
RUN_TIMEOUT = 120.0
BUSYBOX = "/bin/busybox"

#: What the probe prints, one section per heading: every character or block device under
#: /dev (path, type, major and minor in hex, as stat prints them), the environment, the
#: mounts, the loader cache, and the files named on its command line.
PROBE = r"""
bb=/bin/busybox
echo "== dev"
$bb find /dev \( -type c -o -type b \) -exec $bb stat -c '%n %F %t %T' {} \;
echo "== dirs"
$bb find /dev /tmp -type d
echo "== env"
$bb env
echo "== mounts"
$bb cat /proc/self/mountinfo
echo "== ldconfig"
/sbin/ldconfig -p
for file in "$@"; do
    echo "== file $file"
    $bb cat "$file"
done
echo "== end"
"""


@dataclass
class View:
    """What the probe printed, parsed."""

    devices: dict[str, tuple[str, int, int]]  # path -> (type, major, minor)
    directories: set[str]
    env: dict[str, str]
    mounts: list[str]  # mount points
    libraries: dict[str, str]  # soname -> path, from ldconfig -p
    files: dict[str, str]  # path -> content
    seconds: float = 0.0  # podman run's wall time
    output: str = field(default="", repr=False)


def parse(output: str) -> View:
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in output.splitlines():
        if line.startswith("== "):
            current = sections.setdefault(line[3:], [])
        else:
            current.append(line)
    if "end" not in sections:
        raise AssertionError(f"the probe did not finish:\n{output}")
    devices: dict[str, tuple[str, int, int]] = {}
    for line in sections.get("dev", []):
        path, *kind, major, minor = line.split()
        devices[path] = (" ".join(kind), int(major, 16), int(minor, 16))
    env = dict(line.split("=", 1) for line in sections.get("env", []) if "=" in line)
    mounts = [line.split()[4] for line in sections.get("mounts", []) if len(line.split()) > 4]
    libraries: dict[str, str] = {}
    for line in sections.get("ldconfig", [])[1:]:  # the first line counts the entries
        name, _, path = line.strip().partition(" => ")
        libraries.setdefault(name.split(" (")[0], path)
    files = {
        name[5:]: "\n".join(lines) for name, lines in sections.items() if name.startswith("file ")
    }
    return View(
        devices=devices,
        directories=set(sections.get("dirs", [])),
        env=env,
        mounts=mounts,
        libraries=libraries,
        files=files,
        output=output,
    )


def missing_tools() -> str:
    """Why containers cannot run here ("" when they can)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed: `make image-tools` installs them"
    if os.geteuid() != 0:
        return "the runtime test runs rootful podman and makes device nodes: run it as root"
    return ""


def probe_tree(workdir: Path) -> Path:
    """The probe's root file system, unpacked (fetched once into the cache)."""
    key = hashlib.sha256(f"{SUITE} {MIRROR} {PACKAGES}".encode()).hexdigest()[:12]
    archive = CACHE / f"probe-{SUITE}-{key}.tar"
    if not archive.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = archive.with_suffix(".tmp")
        subprocess.run(
            [
                "mmdebstrap", "--quiet", "--variant=extract", f"--include={PACKAGES}",
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--format=tar", SUITE, str(partial), f"deb {MIRROR}/debian {SUITE} main",
            ],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        partial.rename(archive)
    tree = workdir / "probe-root"
    tree.mkdir()
    with tarfile.open(archive) as tar:
        # files, directories and links only: the archive's /dev nodes (console, full, ...)
        # are the runtime's to make, and a copy of the tree would read /dev/full for ever
        members = [m for m in tar.getmembers() if m.isreg() or m.isdir() or m.issym() or m.islnk()]
        tar.extractall(tree, members=members, filter="tar")
    return tree


class Podman:
    """Runs probe containers from copies of ``tree``, with a podman store in ``workdir``."""

    def __init__(self, workdir: Path, tree: Path) -> None:
        self.workdir = workdir
        self.tree = tree
        self._runs = 0

    def run(
        self,
        cdi_dir: Path,
        device_ids: Sequence[str],
        files: Sequence[str] = (),
        options: Sequence[str] = (),
    ) -> View:
        """A container given exactly ``device_ids`` (CDI ids, resolved from ``cdi_dir``) and
        podman's run ``options`` runs the probe, which also prints ``files``; raises with
        podman's output if it fails."""
        self._runs += 1
        rootfs = self.workdir / f"rootfs-{self._runs}"
        shutil.copytree(self.tree, rootfs, symlinks=True)  # regular files only (probe_tree)
        try:
            started = time.monotonic()
            result = subprocess.run(
                self.command(cdi_dir, device_ids, rootfs, files, options),
                capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False,
            )  # fmt: skip
            seconds = time.monotonic() - started
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
        if result.returncode != 0:
            raise ContainerFailed(device_ids, result.stdout + result.stderr)
        view = parse(result.stdout)
        view.seconds = seconds
        return view

    def command(
        self,
        cdi_dir: Path,
        device_ids: Sequence[str],
        rootfs: Path,
        files: Sequence[str],
        options: Sequence[str],
    ) -> list[str]:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        podman = [
            "podman", "--root", str(self.workdir / "storage"),
            "--runroot", str(self.workdir / "run"), "--storage-driver", "vfs",
            "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
            "run", "--rm", "--network", "none",
            # rlimits no higher than ours: a sandbox cannot raise them to podman's defaults
            "--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096",
        ]  # fmt: skip
        for device_id in dict.fromkeys(device_ids):
            podman += ["--device", device_id]
        podman += options
        podman += ["--rootfs", str(rootfs), BUSYBOX, "sh", "-c", PROBE, "probe", *files]
        Path("/var/run/cdi").mkdir(exist_ok=True)  # the mount point (under /run: a tmpfs)
        isolate = (
            'mount --bind "$0" /var/run/cdi || exit 1; '
            "if [ -d /etc/cdi ]; then mount -t tmpfs cdi-hidden /etc/cdi || exit 1; fi; "
            'exec "$@"'
        )
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", isolate,
                str(cdi_dir), *podman]  # fmt: skip


class ContainerFailed(AssertionError):
    def __init__(self, device_ids: Sequence[str], output: str) -> None:
        super().__init__(f"podman run with {list(device_ids)} failed:\n{output}")
        self.output = output
