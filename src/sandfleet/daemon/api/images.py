"""Images: list, delete, gc, push, import, build (built-in), and recipe builds."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from sandfleet.daemon.api.common import (
    BUILD_BEAT,
    NDJSON,
    Api,
    CheckedRoute,
    ImageRefParam,
    ImageRefQuery,
    stream,
)
from sandfleet.models import (
    GcResult,
    ImageInfo,
    ImageList,
    ImportRequest,
    Ok,
    RecipeBuildRequest,
)


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node = api.node

    @api.route(r, "images")
    async def images() -> ImageList:
        return ImageList(images=await node.images.list_images())

    @api.route(r, "delete_image")
    async def delete_image(ref: ImageRefParam) -> Ok:
        await node.images.delete_image(ref)
        return Ok()

    @api.route(r, "gc_images")
    async def gc_images(min_age: Annotated[float, Query(ge=0)] = 600.0) -> GcResult:
        removed, freed = await node.images.gc_images(min_age)
        return GcResult(removed=removed, bytes=freed)

    @api.route(r, "push_image")
    async def push_image(ref: ImageRefQuery) -> ImageInfo:
        return await node.images.push_image(ref)

    @api.route(r, "import_image")
    async def import_image(req: ImportRequest) -> ImageInfo:
        return await node.images.import_image(req.path, req.ref)

    @api.route(r, "build_image")
    async def build_image(ref: ImageRefQuery) -> ImageInfo:
        return await node.images.build_image(ref)

    @api.route(r, "build_recipe", response_class=StreamingResponse, responses=NDJSON)
    async def build_recipe(req: RecipeBuildRequest) -> StreamingResponse:
        """BuildEvent lines: progress, each step as it finishes (its commands' output before it),
        then one `done` with the image; closing the connection cancels the build."""
        return stream(await node.builds.build_recipe(req.recipe, req.base_dir), BUILD_BEAT)

    return r
