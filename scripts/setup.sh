#!/usr/bin/env bash
# Install everything sandfleet needs on a fresh Debian 12 machine. Run as root from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

# libseccomp2 (compiles the sandbox seccomp filter), gcc + libc6-dev (the static launcher and
# in-sandbox agent), erofs-utils (layers), busybox-static (busybox image), mmdebstrap (debian/python
# images), crun and runc (optional OCI runtimes, tested too), bubblewrap (a benchmark peer),
# iproute2 (network checks), util-linux and mount (mkswap, swapon: compressed swap for paused sandboxes;
# nsenter in tests).
PACKAGES=(libseccomp2 gcc libc6-dev erofs-utils busybox-static mmdebstrap crun runc bubblewrap iproute2 procps util-linux mount)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
