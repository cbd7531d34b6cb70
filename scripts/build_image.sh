#!/usr/bin/env bash
# Build the agent's OCI image from deploy/container/Dockerfile without any container registry.
#
# Why: build and CI machines often reach Debian's mirrors and PyPI but no container registry,
# so the Dockerfile's public base (python:3.11-slim-bookworm) cannot be pulled, and they run
# no container daemon. This script makes an equivalent base from Debian's packages with
# mmdebstrap (bookworm's python3 is 3.11), imports it into buildah and builds the *same*
# Dockerfile users build with docker, naming that base with --build-arg BASE_IMAGE. buildah
# runs with vfs storage and chroot isolation: no daemon, no overlay or fuse mounts, no nested
# container runtime.
#
# Everything lives under IMAGE_DIR (default .cache/image, gitignored; `make clean` removes it):
#   base-<suite>-<key>.tar  the mmdebstrap root filesystem, one per package set and mirror list,
#                           so a second run skips mmdebstrap (about 30 s) altogether;
#   storage/, run/          buildah's (and podman's) storage and run root. Other tools see the
#                           image with the same flags:
#                           podman --root IMAGE_DIR/storage --runroot IMAGE_DIR/run --storage-driver vfs
# Settings (environment): IMAGE (default localhost/gpu-dra-agent:dev), IMAGE_DIR, SUITE
# (default bookworm), MIRROR (default http://deb.debian.org), PIP_CERT and the proxy variables
# (used by the build only when set: plain PyPI otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/gpu-dra-agent:dev}
IMAGE_DIR=${IMAGE_DIR:-.cache/image}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org}
# What the Dockerfile needs of its base: `python` (3.11+) with the venv module (and pip for
# the venvs, from python3-venv's bundled wheels); CA certificates for anything fetched later.
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates

missing=0
need() { # tool, package
    command -v "$1" >/dev/null || { echo "missing: $1 (make image): sudo apt-get install $2" >&2; missing=1; }
}
need mmdebstrap mmdebstrap
need buildah buildah
if [ "$(id -u)" != 0 ]; then
    need newuidmap uidmap # mmdebstrap and buildah run in a user namespace when not root
fi
[ "$missing" = 0 ] || exit 1

mkdir -p "$IMAGE_DIR"
IMAGE_DIR=$(cd "$IMAGE_DIR" && pwd)
buildah=(buildah --root "$IMAGE_DIR/storage" --runroot "$IMAGE_DIR/run" --storage-driver vfs)

# The base: a minimal Debian with the suite's updates and security fixes, without docs
# (what the slim Python images leave out too).
sources=(
    "deb $MIRROR/debian $SUITE main"
    "deb $MIRROR/debian $SUITE-updates main"
    "deb $MIRROR/debian-security $SUITE-security main"
)
mmdebstrap_args=(
    --variant=minbase --include="$PACKAGES"
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
)
key=$(printf '%s\n' "${mmdebstrap_args[@]}" "${sources[@]}" | sha256sum | cut -c1-12)
base_tar="$IMAGE_DIR/base-$SUITE-$key.tar"
base_image="localhost/gpu-dra-agent-base:$SUITE-$key"

if [ ! -s "$base_tar" ]; then
    echo "base: mmdebstrap $SUITE ($PACKAGES) -> $base_tar"
    mmdebstrap --quiet "${mmdebstrap_args[@]}" --format=tar "$SUITE" "$base_tar.tmp" "${sources[@]}"
    mv "$base_tar.tmp" "$base_tar"
fi
if ! "${buildah[@]}" inspect --type image "$base_image" >/dev/null 2>&1; then
    echo "base: importing $base_tar as $base_image"
    container=$("${buildah[@]}" from scratch)
    "${buildah[@]}" add --quiet "$container" "$base_tar" / >/dev/null
    "${buildah[@]}" config --cmd /bin/bash --env LANG=C.UTF-8 "$container"
    "${buildah[@]}" commit --quiet --rm "$container" "$base_image" >/dev/null
fi

# This machine's way to PyPI reaches the build steps only when the caller has one: a proxy
# (the predefined proxy build arguments) and pip's CA bundle (PIP_CERT, for a TLS-inspecting
# proxy; bind-mounted for the RUN steps, not copied). The image keeps none of them.
build_args=(--build-arg "BASE_IMAGE=$base_image")
for name in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
    if [ -n "${!name:-}" ]; then build_args+=(--build-arg "$name=${!name}"); fi
done
if [ -n "${PIP_CERT:-}" ]; then
    build_args+=(--volume "$(realpath "$PIP_CERT"):/run/pip-ca.crt:ro" --build-arg PIP_CERT=/run/pip-ca.crt)
fi

# What the build reads (the context .dockerignore lets through, the Dockerfile, this script and
# the base), hashed into a label: an image built from the same inputs is reused as it is.
# Under vfs even a fully cached build copies every step's root filesystem (about a minute).
inputs=$(
    {
        find requirements.lock requirements-dev.lock pyproject.toml README.md agent \
            deploy/container/Dockerfile .dockerignore scripts/build_image.sh -type f \
            ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
        echo "$base_image ${build_args[*]}"
    } | sha256sum | cut -c1-16
)
label=org.gpu-dra-agent.build-inputs
if [ -z "${FORCE:-}" ] && [ "$("${buildah[@]}" inspect --type image \
    --format "{{index .OCIv1.Config.Labels \"$label\"}}" \
    "$IMAGE" 2>/dev/null)" = "$inputs" ]; then
    size=$("${buildah[@]}" images --format '{{.Size}}' "$IMAGE" | head -n1)
    echo "image: $IMAGE ($size) is up to date (inputs $inputs; FORCE=1 rebuilds) in $IMAGE_DIR/storage"
    exit 0
fi

start=$(date +%s)
# --layers: a change to agent/ alone reuses the dependency layer (no PyPI downloads).
if ! "${buildah[@]}" build --isolation chroot --layers --pull=never \
    -f deploy/container/Dockerfile "${build_args[@]}" --label "$label=$inputs" -t "$IMAGE" . >"$IMAGE_DIR/build.log" 2>&1; then
    tail -n 30 "$IMAGE_DIR/build.log" >&2
    echo "image build failed: $IMAGE_DIR/build.log" >&2
    exit 1
fi
# Under vfs every image is a full copy: keep the layers of this build (the next build's cache)
# and remove the untagged ones that older builds left. The log names each step's image by an
# ID prefix ("--> 69de4a9a0de") or in full ("--> Using cache 69de4a9a0de3...").
keep=$(grep -oE '^--> (Using cache )?[0-9a-f]{11,64}' "$IMAGE_DIR/build.log" | grep -oE '[0-9a-f]{11,64}$' || true)
for id in $("${buildah[@]}" images --all --filter dangling=true --noheading --no-trunc --format '{{.ID}}'); do
    id=${id#sha256:}
    kept=0
    for prefix in $keep; do
        if [[ $id == "$prefix"* ]]; then kept=1; break; fi
    done
    [ "$kept" = 1 ] || "${buildah[@]}" rmi "$id" >/dev/null 2>&1 || true
done
size=$("${buildah[@]}" images --format '{{.Size}}' "$IMAGE" | head -n1)
echo "image: $IMAGE ($size, built in $(($(date +%s) - start)) s) in $IMAGE_DIR/storage"
