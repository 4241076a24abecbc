"""Wheels made on the spot, for tests that install packages with no network."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path


def pure_wheel(where: Path, name: str, requires: Sequence[str] = (), init: bytes = b"") -> Path:
    """A pure wheel of ``name`` 1.0 in ``where``: one package whose ``__init__.py`` is ``init``,
    with ``requires`` as its Requires-Dist."""
    pkg = name.replace("-", "_")
    dist = f"{pkg}-1.0"
    files = {
        f"{pkg}/__init__.py": init,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
        + b"".join(f"Requires-Dist: {r}\n".encode() for r in requires),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
        for n, d in files.items()
    ]
    files[f"{dist}.dist-info/RECORD"] = "".join([*record, f"{dist}.dist-info/RECORD,,\n"]).encode()
    path = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return path
