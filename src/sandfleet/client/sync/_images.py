# Generated from client/aio/_images.py by scripts/gen_sync_client.py: do not edit.
"""The client's calls on the node's images: list, build (built-in images and recipes), push, import, delete."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from urllib.parse import quote

from sandfleet.client import _base as b
from sandfleet.client.sync._http import _Calls
from sandfleet.models import BuildEvent, GcResult, ImageInfo, ImageList, ImportRequest, RecipeBuildRequest


class _Images(_Calls):
    def images(self) -> builtins.list[ImageInfo]:
        """The node's images."""
        return (self._model(ImageList, b.Call("GET", "/v1/images"))).images

    def delete_image(self, ref: str) -> None:
        """Delete an image's manifest (its layers go at the next `gc_images` once nothing uses them)."""
        self._send(b.Call("DELETE", "/v1/images/" + quote(ref, safe="")))

    def gc_images(self, min_age: float = 600.0) -> GcResult:
        """Delete layer files no image, sandbox or snapshot uses (and older than `min_age` seconds)."""
        return self._model(GcResult, b.Call("POST", "/v1/images/gc", params={"min_age": min_age}))

    def build_image(self, ref: str, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Build a built-in image (`busybox`, `debian:bookworm`, `python:3.11`); waits up to `timeout`
        seconds (default 30 minutes, whatever the client's timeout)."""
        call = b.Call("POST", "/v1/images/build", params={"ref": ref}, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)

    def build_recipe(
        self,
        recipe: str | os.PathLike[str],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        on_event: Callable[[BuildEvent], None] | None = None,
        timeout: float = b.BUILD_TIMEOUT,
    ) -> ImageInfo:
        """Build a recipe into the daemon's layer store: a path to a recipe file (its directory is
        where `copy` and `git` sources are read from, on the daemon's host), or its TOML text with
        `base_dir`. `on_event` gets each progress, step and output event as it comes; waits up to
        `timeout` seconds (default 30 minutes). Leaving early (an error in `on_event`) cancels it."""
        text, where = b.recipe_source(recipe, base_dir)
        body = RecipeBuildRequest(recipe=text, base_dir=where).model_dump(mode="json")
        call = b.Call("POST", "/v1/images/recipes", json=body, timeout=b.check_timeout(timeout, 0))
        image: ImageInfo | None = None
        with self._events(call, b.build_event) as events:
            for event in events:
                if event.type == "done":
                    image = event.image
                elif on_event is not None:
                    on_event(event)
        return b.built(image)

    def push_image(self, ref: str, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Publish a local image to the daemon's shared store as on-demand layers (other nodes
        then use it without copying its file data); waits up to `timeout` seconds (default 30 minutes)."""
        call = b.Call("POST", "/v1/images/push", params={"ref": ref}, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)

    def import_image(self, path: str, ref: str | None = None, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Import a `docker save` tarball or an OCI image layout (a path on the daemon's host); waits up
        to `timeout` seconds (default 30 minutes)."""
        body = ImportRequest(path=path, ref=ref).model_dump(mode="json")
        call = b.Call("POST", "/v1/images/import", json=body, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)
