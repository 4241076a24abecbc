"""Images: list, delete, gc, push, import, build (built-in), and recipe builds."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from sandfleet.daemon.api.common import (
    BUILD_BEAT,
    NDJSON,
    CheckedRoute,
    ImageRefParam,
    ImageRefQuery,
    stream,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    GcResult,
    ImageInfo,
    ImageList,
    ImportRequest,
    Ok,
    RecipeBuildRequest,
)


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.get("/v1/images", response_model=ImageList)
    async def images() -> ImageList:
        return ImageList(images=await service.list_images())

    @r.delete("/v1/images/{ref:path}", response_model=Ok)
    async def delete_image(ref: ImageRefParam) -> Ok:
        await service.delete_image(ref)
        return Ok()

    @r.post("/v1/images/gc", response_model=GcResult)
    async def gc_images(min_age: Annotated[float, Query(ge=0)] = 600.0) -> GcResult:
        removed, freed = await service.gc_images(min_age)
        return GcResult(removed=removed, bytes=freed)

    @r.post("/v1/images/push", response_model=ImageInfo)
    async def push_image(ref: ImageRefQuery) -> ImageInfo:
        return await service.push_image(ref)

    @r.post("/v1/images/import", response_model=ImageInfo)
    async def import_image(req: ImportRequest) -> ImageInfo:
        return await service.import_image(req.path, req.ref)

    @r.post("/v1/images/build", response_model=ImageInfo)
    async def build_image(ref: ImageRefQuery) -> ImageInfo:
        return await service.build_image(ref)

    @r.post("/v1/images/recipes", response_class=StreamingResponse, responses=NDJSON)
    async def build_recipe(req: RecipeBuildRequest) -> StreamingResponse:
        """BuildEvent lines: progress, each step as it finishes (its commands' output before it),
        then one `done` with the image; closing the connection cancels the build."""
        return stream(await service.build_recipe(req.recipe, req.base_dir), BUILD_BEAT)

    return r
