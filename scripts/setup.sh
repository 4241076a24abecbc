#!/usr/bin/env bash
# Install everything sandfleet needs on a fresh Debian 12 machine. Run as root from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

# libseccomp2 (compiles the sandbox seccomp filter), gcc + libc6-dev (the static launcher and
# in-sandbox agent), musl-tools (the agent against musl: it starts in half the time of a static glibc
# binary on a VM), erofs-utils (layers), busybox-static (busybox image), mmdebstrap (debian/python
# images), crun and runc (optional OCI runtimes, tested too), bubblewrap (a benchmark peer),
# iproute2 (network checks), util-linux and mount (mkswap, swapon: compressed swap for paused sandboxes;
# nsenter and fincore in tests), git (recipes' git steps), zstd (zstd-compressed
# OCI layers when the zstandard module is absent), podman (the OCI import test imports archives it
# saves; a benchmark peer too), qemu-system-x86 and qemu-utils (the microvm and vm tiers; qemu-img
# makes the vm tier's copy-on-write disks), e2fsprogs (mke2fs -d: the vm tier's base disk of an image),
# openssl (tests: the network tests' stand-in upstream serves HTTPS with a certificate it makes),
# chromium (tests: the web console driven in a real headless browser by Playwright).
PACKAGES=(libseccomp2 gcc libc6-dev musl-tools erofs-utils busybox-static mmdebstrap crun runc bubblewrap iproute2 procps util-linux mount git zstd podman qemu-system-x86 qemu-utils e2fsprogs openssl chromium)
# npm vendors the web console's browser libraries below; a host with node from elsewhere has its npm.
command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# criu 4.1.1 (snapshot, restore, fork): bookworm's criu 3.17 cannot dump on this kernel. Debian
# trixie's package and the libraries it needs (trixie's glibc among them) are unpacked, without
# running any maintainer script, into a tree of their own; sandfleet runs criu through that tree's
# dynamic loader, so the host's userland is untouched. ~80 MiB, a few seconds.
CRIU_ROOT=/opt/sandfleet/criu
if ! [ -x "$CRIU_ROOT/usr/sbin/criu" ]; then
    rm -rf "$CRIU_ROOT.tmp"
    mkdir -p "$(dirname "$CRIU_ROOT")"
    mmdebstrap --quiet --variant=extract --include=criu trixie "$CRIU_ROOT.tmp" http://deb.debian.org/debian
    rm -rf "$CRIU_ROOT"
    mv "$CRIU_ROOT.tmp" "$CRIU_ROOT"
fi

# The guest kernel of the VM tiers: Debian's cloud kernel, unpacked (not installed: the host's /boot,
# initramfs hooks and bootloader stay untouched) with its modules into /opt/sandfleet/guest.
GUEST_DIR=/opt/sandfleet/guest
if ! compgen -G "$GUEST_DIR/boot/vmlinuz-*" >/dev/null; then
    rm -rf "$GUEST_DIR.tmp" && mkdir -p "$GUEST_DIR.tmp/debs"
    apt-get update -qq
    kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
    (cd "$GUEST_DIR.tmp/debs" && apt-get download -q "$kpkg" 2>&1 | grep -v 'unsandboxed' || true)
    dpkg-deb -x "$GUEST_DIR.tmp"/debs/*.deb "$GUEST_DIR.tmp"
    rm -rf "$GUEST_DIR.tmp/debs" "$GUEST_DIR"
    mv "$GUEST_DIR.tmp" "$GUEST_DIR"
fi

python3 -m pip install -q --disable-pip-version-check -e ".[node,dev,rl,cluster,e2b]"
# verl's sandbox-fusion client code, for tests/test_fusion.py (only that part of it is imported:
# verl itself pulls torch and ray, which its reward client does not need).
python3 -m pip install -q --disable-pip-version-check --no-deps "verl==0.9.1"
# SWE-ReX's own runtime tests (in its sdist), run against sandfleet's runtime by tests/test_adapter_swerex.py.
python3 -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps "swe-rex==1.4.0" \
    -d "${SANDFLEET_PEER_CACHE:-$HOME/.cache/sandfleet/peer}"
# The web console's npm libraries (xterm.js, uPlot), pinned by its package-lock.json, into the package.
bash scripts/vendor_console.sh
# E2B's JS SDK, pinned by its package-lock.json, for tests/test_e2b.py (no install scripts).
(cd tests/js && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
# The agent, the launcher and criu's shim, compiled once here (the daemon copies them at start).
python3 -m sandfleet.runtime.prebuild >/dev/null
