"""An OCI archive's index, manifests and configs: parsing them, and choosing the image to import."""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from .models import DIGEST_RE, InvalidRefError, parse_ref
from .oci_archive import _archive_path
from .oci_errors import OciImportError, OciRefError

if TYPE_CHECKING:
    from .oci_archive import _Source

_REF_NAME = "org.opencontainers.image.ref.name"
_CONTAINERD_NAME = "io.containerd.image.name"
_MAX_JSON = 16 << 20  # manifests and configs are small; don't read a huge "manifest" into memory
_MAX_INDEX_DEPTH = 4
_INDEX_TYPES = frozenset(
    {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
)
_MANIFEST_TYPES = frozenset(
    {"application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"}
)
_CONFIG_TYPES = frozenset(
    {"application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"}
)
# The compression is sniffed from the blob itself; the media type only has to name a tar layer.
_LAYER_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)
# platform.machine() -> GOARCH, the spelling of OCI platform objects.
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}
_M = TypeVar("_M", bound=BaseModel)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class _Platform(_Model):
    os: str = ""
    architecture: str = ""


class _Descriptor(_Model):
    media_type: str = Field("", alias="mediaType")
    digest: str
    size: int = Field(ge=0)
    annotations: dict[str, str] = Field(default_factory=dict)
    platform: _Platform | None = None


class _Index(_Model):
    manifests: list[_Descriptor]


class _Manifest(_Model):
    config: _Descriptor
    layers: list[_Descriptor]


class _DockerEntry(_Model):
    config: str = Field(alias="Config")
    repo_tags: list[str] | None = Field(None, alias="RepoTags")
    layers: list[str] = Field(alias="Layers")


class _DockerManifest(RootModel[list[_DockerEntry]]):
    pass


class _Layout(_Model):
    image_layout_version: str = Field(alias="imageLayoutVersion")


class _RootFS(_Model):
    diff_ids: list[str] = Field(default_factory=list)


class _RunConfig(_Model):
    env: list[str] | None = Field(None, alias="Env")
    working_dir: str | None = Field(None, alias="WorkingDir")
    user: str | None = Field(None, alias="User")


class _ImageConfig(_Model):
    config: _RunConfig | None = None
    rootfs: _RootFS | None = None


def _parse(model: type[_M], data: bytes, what: str) -> _M:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise OciImportError(f"{what} is malformed: {problems}") from None


@dataclass(frozen=True)
class _LayerBlob:
    """One layer as the archive states it; digests are None where the archive gives none."""

    path: str
    digest: str | None  # sha256 of the blob as stored (maybe compressed)
    size: int | None
    diff_id: str | None  # sha256 of the uncompressed tar (the config's rootfs.diff_ids)


@dataclass(frozen=True)
class _Plan:
    config: _ImageConfig
    config_digest: str
    layers: list[_LayerBlob]


@dataclass(frozen=True)
class _Candidate:
    """An image of the archive; loading its manifest and config is deferred to the chosen one."""

    labels: tuple[str, ...]  # names as the archive spells them, for messages
    refs: tuple[str, ...]  # the same, normalised to name:tag (unusable ones dropped)
    bare_tags: tuple[str, ...]  # OCI ref.name annotations that are only a tag, no repository
    load: Callable[[], _Plan]


def normalise_ref(ref: str) -> str:
    """An archive's image name in our grammar: ``docker.io/library/python:3.11`` -> ``library/python:3.11``.

    The registry host (a first component with a dot or port, or ``localhost``) and any
    ``@digest`` are dropped and the name is lowercased. Raises InvalidRefError if the rest is
    still not a valid ``name[:tag]``.
    """
    name = ref.strip().split("@", 1)[0]
    host, sep, rest = name.partition("/")
    if sep and ("." in host or ":" in host or host == "localhost"):
        name = rest
    repo, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:
        repo, tag = name, ""
    name, tag = parse_ref(f"{repo.lower()}:{tag}" if tag else repo.lower())
    return f"{name}:{tag}"


def _usable_ref(name: str) -> str | None:
    try:
        return normalise_ref(name)
    except InvalidRefError:
        return None


def _select(candidates: list[_Candidate], ref: str | None, source: Path) -> tuple[_Candidate, str]:
    """Pick the image to import and the ``name:tag`` to store it under."""
    if not candidates:
        raise OciImportError(f"{source} holds no image (for linux/{_host_arch()})")

    def listing() -> str:
        return ", ".join(" / ".join(c.labels) or "(unnamed)" for c in candidates)

    if ref is not None:
        want = normalise_ref(ref)
        if len(candidates) == 1:
            return candidates[0], want
        hits = [c for c in candidates if want in c.refs]
        if not hits:
            tag = want.rpartition(":")[2]
            hits = [c for c in candidates if tag in c.bare_tags]
        if len(hits) == 1:
            return hits[0], want
        how = "no image" if not hits else f"{len(hits)} images"
        raise OciRefError(f"{how} in {source} match {want!r}; it holds: {listing()}")
    if len(candidates) > 1:
        raise OciRefError(f"{source} holds {len(candidates)} images ({listing()}); pass a ref to choose one")
    (only,) = candidates
    if not only.refs:
        raise OciRefError(f"the image in {source} has no usable name ({listing()}); pass a ref such as 'myimage:1.0'")
    return only, only.refs[0]


def _read_json(src: _Source, path: str, digest: str | None, size: int | None, what: str) -> tuple[bytes, str]:
    """Read a small JSON file, verifying its digest and size where the archive states them."""
    with src.open(path) as f:
        data = f.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise OciImportError(f"{what} ({path}) is larger than {_MAX_JSON} bytes")
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest is not None and actual != digest:
        raise OciImportError(f"{what} ({path}) has digest {actual}, expected {digest}: the archive is corrupt")
    if size is not None and len(data) != size:
        raise OciImportError(f"{what} ({path}) is {len(data)} bytes, expected {size}: the archive is corrupt")
    return data, actual


def _blob_path(digest: str) -> str:
    if DIGEST_RE.match(digest):
        return "blobs/sha256/" + digest.removeprefix("sha256:")
    algorithm, sep, _ = digest.partition(":")
    if sep and algorithm != "sha256":
        raise OciImportError(f"unsupported digest algorithm {algorithm!r} in {digest!r} (only sha256)")
    raise OciImportError(f"malformed digest {digest!r}")


def _read_blob(src: _Source, desc: _Descriptor, what: str) -> bytes:
    return _read_json(src, _blob_path(desc.digest), desc.digest, desc.size, f"{what} {desc.digest}")[0]


def _name_digest(path: str) -> str | None:
    """The digest a docker-save member name states: Docker >= 25 stores ``blobs/sha256/<hex>``,
    older Docker and podman name the config ``<hex>.json`` (the image id is its digest)."""
    if path.startswith("blobs/sha256/"):
        digest = "sha256:" + path.removeprefix("blobs/sha256/")
    elif "/" not in path and path.endswith(".json"):
        digest = "sha256:" + path.removesuffix(".json")
    else:
        return None
    return digest if DIGEST_RE.match(digest) else None


def _diff_ids(config: _ImageConfig, n_layers: int, what: str) -> list[str | None]:
    ids = config.rootfs.diff_ids if config.rootfs is not None else []
    if not ids:
        return [None] * n_layers
    if len(ids) != n_layers:
        raise OciImportError(f"{what} lists {len(ids)} diff_ids for {n_layers} layers")
    return list(ids)


def _docker_plan(src: _Source, entry: _DockerEntry) -> _Plan:
    cfg_path = _archive_path(entry.config)
    raw, cfg_digest = _read_json(src, cfg_path, _name_digest(cfg_path), None, "image config")
    config = _parse(_ImageConfig, raw, f"image config {cfg_path}")
    diff_ids = _diff_ids(config, len(entry.layers), f"image config {cfg_path}")
    layers = []
    for path, diff_id in zip(entry.layers, diff_ids, strict=True):
        path = _archive_path(path)
        layers.append(_LayerBlob(path, _name_digest(path), None, diff_id))
    return _Plan(config, cfg_digest, layers)


def _docker_candidates(src: _Source) -> list[_Candidate]:
    raw, _ = _read_json(src, "manifest.json", None, None, "manifest.json")
    out = []
    for entry in _parse(_DockerManifest, raw, "manifest.json").root:
        labels = tuple(entry.repo_tags or ())
        refs = tuple(r for r in map(_usable_ref, labels) if r is not None)
        out.append(_Candidate(labels, refs, (), partial(_docker_plan, src, entry)))
    return out


def _host_arch() -> str:
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


def _runs_here(desc: _Descriptor) -> bool:
    p = desc.platform
    return p is None or (p.os == "linux" and p.architecture == _host_arch())


def _oci_plan(src: _Source, desc: _Descriptor) -> _Plan:
    for _ in range(_MAX_INDEX_DEPTH):
        if desc.media_type in _MANIFEST_TYPES:
            break
        if desc.media_type not in _INDEX_TYPES:
            raise OciImportError(f"unsupported media type {desc.media_type!r} for image {desc.digest}")
        index = _parse(_Index, _read_blob(src, desc, "image index"), f"image index {desc.digest}")
        fits = [m for m in index.manifests if _runs_here(m)]
        if not fits:
            have = sorted({f"{m.platform.os}/{m.platform.architecture}" for m in index.manifests if m.platform})
            raise OciImportError(f"image index {desc.digest} has no linux/{_host_arch()} image (has: {have})")
        desc = fits[0]
    else:
        raise OciImportError(f"image indexes nested deeper than {_MAX_INDEX_DEPTH} levels")
    manifest = _parse(_Manifest, _read_blob(src, desc, "image manifest"), f"image manifest {desc.digest}")
    if manifest.config.media_type not in _CONFIG_TYPES:
        raise OciImportError(f"unsupported config media type {manifest.config.media_type!r} (not a container image)")
    raw = _read_blob(src, manifest.config, "image config")
    config = _parse(_ImageConfig, raw, f"image config {manifest.config.digest}")
    for layer in manifest.layers:
        if layer.media_type not in _LAYER_TYPES:
            raise OciImportError(f"unsupported layer media type {layer.media_type!r} for layer {layer.digest}")
    diff_ids = _diff_ids(config, len(manifest.layers), f"image config {manifest.config.digest}")
    layers = [
        _LayerBlob(_blob_path(d.digest), d.digest, d.size, diff_id)
        for d, diff_id in zip(manifest.layers, diff_ids, strict=True)
    ]
    return _Plan(config, manifest.config.digest, layers)


def _oci_candidates(src: _Source) -> list[_Candidate]:
    raw, _ = _read_json(src, "oci-layout", None, None, "oci-layout")
    version = _parse(_Layout, raw, "oci-layout").image_layout_version
    if not version.startswith("1."):
        raise OciImportError(f"unsupported OCI layout version {version!r}")
    raw, _ = _read_json(src, "index.json", None, None, "index.json")
    out = []
    for desc in _parse(_Index, raw, "index.json").manifests:
        if not _runs_here(desc):
            continue
        labels: list[str] = []
        bare: list[str] = []
        for key in (_CONTAINERD_NAME, _REF_NAME):
            name = desc.annotations.get(key)
            if name is None or name in labels:
                continue
            # The OCI spec suggests a bare tag for ref.name; podman and others store a full name.
            (labels if ":" in name or "/" in name else bare).append(name)
        refs = tuple(r for r in map(_usable_ref, labels) if r is not None)
        out.append(_Candidate(tuple(labels + bare), refs, tuple(bare), partial(_oci_plan, src, desc)))
    return out


def _candidates(src: _Source, source: Path) -> list[_Candidate]:
    # `docker save` of Docker >= 25 writes both formats; manifest.json has the full RepoTags.
    if src.has("manifest.json"):
        return _docker_candidates(src)
    if src.has("oci-layout"):
        return _oci_candidates(src)
    raise OciImportError(f"{source} is neither a docker save archive (manifest.json) nor an OCI layout (oci-layout)")


__all__ = ["normalise_ref"]
