"""A whole node service in this process, on the fake tier, for tests without root.

    async with InProcessNode(tmp_path) as node:
        async with node.client() as fleet:            # AsyncClient over an in-process ASGI transport
            sb = await fleet.create(image="busybox")
            assert (await sb.exec("echo hi")).stdout == "hi\\n"

Everything between the SDK and the backend is the product's own code: the routes (create_app), the
service (SandboxManager and its concerns), the state store (SQLite in `root`), admission and the
event journal. Only the tier is fake (testing/fake_backend.py), and images are empty manifests.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx

from sandfleet.client import AsyncClient
from sandfleet.daemon.api import create_app
from sandfleet.daemon.node.admission import Admission, AdmissionPolicy
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.daemon.node.state import StateStore
from sandfleet.daemon.security.audit import AuditLog
from sandfleet.daemon.security.iam import Iam
from sandfleet.daemon.security.tenancy import Tenancy
from sandfleet.daemon.service import SandboxManager
from sandfleet.images import LayerStore, parse_ref
from sandfleet.testing.fake_backend import FakeBackend

DEFAULT_IMAGES = ("busybox:latest", "python:3.11")


class InProcessNode:
    def __init__(
        self,
        root: Path,
        *,
        images: tuple[str, ...] = DEFAULT_IMAGES,
        max_sandboxes: int = 64,
        reaper_interval: float = 0.1,
        stopped_retention: float = 300.0,
        token: str | None = None,
        node_key: str | None = None,
    ) -> None:
        """`images`: refs that exist (one tiny layer each; the fake tier mounts nothing). `node_key`:
        the key in its ids (a cluster's nodes each have their own); by default a new one."""
        self.root = Path(root)
        self.images = images
        self.token = token
        self.backend = FakeBackend(self.root / "sandboxes")
        self.metrics = Metrics()
        self.state = StateStore(self.root / "state.db")
        self.store = LayerStore(self.root / "images")
        self.service = SandboxManager(
            backends=[self.backend],
            store=self.store,
            state=self.state,
            metrics=self.metrics,
            admission=Admission(AdmissionPolicy(max_sandboxes=max_sandboxes, max_cpu_load=None)),
            stopped_retention=stopped_retention,
            reaper_interval=reaper_interval,
            build_missing_images=False,
            snapshot_dir=None,
            client_factory=lambda: self.client(),
            audit=AuditLog(self.root / "audit"),
            run_dir=self.root / "run",
            node_key=node_key,
        )
        self.tenancy = Tenancy(self.service, None)
        self.app = create_app(self.service, self.tenancy, self.metrics, auth=Iam(None, token).enter if token else None)
        self._serving = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> InProcessNode:
        await self.state.open()
        layers = []
        if shutil.which("mkfs.erofs"):  # one tiny real layer, so images can be a recipe's base
            tree = self.root / "base-layer"
            (tree / "etc").mkdir(parents=True, exist_ok=True)
            (tree / "etc" / "fake-tier").write_text("a layer of sandfleet.testing\n")
            layers.append(await self.store.add_layer_from_dir(tree, "fake base", shift_ids=False))
        for ref in self.images:
            name, tag = parse_ref(ref)
            await asyncio.to_thread(self.store.put_manifest, name, tag, layers)
        await self.backend.start()

        async def ready() -> None:
            self._serving.set()
            await self._stop.wait()

        self._task = asyncio.get_running_loop().create_task(self.service.run(ready), name="in-process-node")
        waiter = asyncio.ensure_future(self._serving.wait())
        done, _ = await asyncio.wait({waiter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:  # recovery failed: say why
            waiter.cancel()
            self._task.result()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None and not self._task.done():
            for sb in await self.service.core.list(state="all"):
                if sb.state in ("running", "paused"):
                    await self.service.core.stop(sb.id, reason="node closed")
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.backend.close()
        await self.state.close()

    @property
    def key(self) -> str:
        """The node's key (in every id it makes)."""
        return self.service.core.node_key

    def transport(self) -> httpx.AsyncBaseTransport:
        """An HTTP transport straight to this node's routes (no socket): for SDK clients, or for a
        gateway's `transport` (a cluster of in-process nodes)."""
        return httpx.ASGITransport(app=self.app)

    def client(self, **kwargs: Any) -> AsyncClient:
        """An SDK client whose requests go straight to this node's routes (no socket)."""
        return AsyncClient(url="http://in-process", token=self.token, transport=self.transport(), **kwargs)
