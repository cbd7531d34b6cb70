#!/usr/bin/env bash
# Copy files out of a Debian package into a directory of the checkout, without installing it.
#
#   scripts/fetch_deb_files.sh PACKAGE DEST FILE_IN_PACKAGE...
#
# `apt-get download` fetches the .deb (no root needed once apt's package lists exist) and
# `dpkg -x` unpacks it into a temporary directory; the named files (paths inside the
# package, e.g. usr/bin/prometheus) are copied flat into DEST. The tests read what they need
# from such a cache in the checkout (.cache/ by default, see the Makefile), never from files
# that the README does not install. DEST is replaced only once every file has arrived, so an
# interrupted run leaves no half-filled cache behind.
set -euo pipefail

if [ "$#" -lt 3 ]; then
    echo "usage: $0 PACKAGE DEST FILE_IN_PACKAGE..." >&2
    exit 2
fi
package=$1 dest=$2
shift 2

for tool in apt-get dpkg; do
    command -v "$tool" >/dev/null || {
        echo "$0: $tool is missing: fetching $package needs a Debian or Ubuntu machine" >&2
        exit 1
    }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# As root, apt-get would hand the download to its unprivileged _apt user, which cannot write
# into a private temporary directory; the download is verified against apt's lists either way.
download() { (cd "$work" && apt-get download -qq -o APT::Sandbox::User=root "$package" >"$work/apt.log" 2>&1); }
# A new machine may have no package lists yet; root can refresh them, anyone else is told how.
if ! download && grep -q "Unable to locate package" "$work/apt.log" && [ "$(id -u)" = 0 ]; then
    echo "$0: apt does not know $package yet: refreshing its package lists (apt-get update)" >&2
    apt-get update -qq >&2 || true
    download || true
fi
if ! ls "$work"/*.deb >/dev/null 2>&1; then
    cat "$work/apt.log" >&2
    if grep -q "Unable to locate package" "$work/apt.log" && [ "$(id -u)" = 0 ]; then
        echo "$0: apt's package lists have no $package (check /etc/apt/sources.list)" >&2
    elif grep -q "Unable to locate package" "$work/apt.log"; then
        echo "$0: apt does not know $package: refresh its package lists (sudo apt-get update) and run again" >&2
    else
        echo "$0: could not download the Debian package $package (see apt-get's message above)" >&2
    fi
    exit 1
fi
dpkg -x "$work"/*.deb "$work/root"

mkdir -p "$work/out"
for file in "$@"; do
    if [ ! -f "$work/root/$file" ]; then
        echo "$0: $package has no file $file" >&2
        exit 1
    fi
    cp "$work/root/$file" "$work/out/"
done
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.tmp"
mv "$work/out" "$dest.tmp"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "$package: $(ls "$dest" | tr '\n' ' ')-> $dest"
