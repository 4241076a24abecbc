"""The node's tiers: each one's backend built from its configuration model (a tier's code is imported
only when a node runs it), and which tiers this host can run (for `sandfleet doctor`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sandfleet.backends.base import TierBackend
from sandfleet.backends.config import BackendConfig
from sandfleet.runtime.doctor import Check

if TYPE_CHECKING:
    from sandfleet.images import LayerStore


def build_backend(
    config: BackendConfig,
    *,
    state_dir: Path,
    run_dir: Path,
    store: LayerStore,
    built: dict[str, TierBackend] | None = None,
) -> TierBackend:
    """The tier `config` describes, not started yet. `built`: the node's tiers built before it (the
    fncall tier shares the container tier's backend when there is one)."""
    if config.type == "container":
        from sandfleet.backends.container.backend import ContainerBackend

        return ContainerBackend(config, state_dir=state_dir, run_dir=run_dir, store=store)
    if config.type in ("microvm", "vm"):
        from sandfleet.backends.vm.backend import VMBackend

        return VMBackend(config, state_dir=state_dir, run_dir=run_dir, store=store)
    if config.type == "fncall":
        from sandfleet.backends.container.backend import ContainerBackend
        from sandfleet.backends.fncall.backend import FncallBackend

        container = (built or {}).get("container")
        if isinstance(container, ContainerBackend):
            return FncallBackend(config, container=container, shared=True)
        return FncallBackend.own(config, state_dir=state_dir / "fncall", run_dir=run_dir / "fncall", store=store)
    raise ValueError(f"unknown tier {config.type!r}")  # pragma: no cover (the union admits no other)


def tier_checks(
    host: list[Check], *, qemu: str = "qemu-system-x86_64", guest_dir: Path = Path("/opt/sandfleet/guest")
) -> Iterator[Check]:
    """Each isolation tier: usable on this host or not, and why (`host`: what run_checks found)."""
    from sandfleet.backends.vm import guest

    checks = {c.name: c for c in host}
    container_needs = ("root", "user namespaces", "filesystem overlay", "filesystem erofs", "cgroups", "libseccomp")
    missing = [n for n in container_needs if checks.get(n) is not None and checks[n].status == "fail"]
    yield Check(
        "tier container",
        "fail" if missing else "ok",
        f"missing: {', '.join(missing)}" if missing else "namespaces, cgroups, seccomp, overlay of EROFS layers",
    )
    yield Check(
        "tier fncall",
        "fail" if missing else "ok",
        "needs the container tier"
        if missing
        else "calls forked from warm interpreters in container workers "
        "(images with python3: the built-in python image needs mmdebstrap once)",
    )
    ok, why = guest.usable(qemu, guest_dir)
    kvm = Path("/dev/kvm")
    accel = (
        "KVM when /dev/kvm runs a standard guest (probed by the daemon), else TCG"
        if kvm.exists()
        else "TCG (no /dev/kvm: correct but ~10-50x slower than KVM)"
    )
    for tier in ("microvm", "vm"):
        yield Check(
            f"tier {tier}",
            "ok" if ok else "warn",
            f"{why}; {accel}" if ok else f"{why} (scripts/setup.sh installs QEMU and unpacks the guest kernel)",
        )
