"""Write docs/public-api.txt: the SDK's public surface, name by name, so that a change to it is deliberate.

    python scripts/gen_public_api.py           # rewrite docs/public-api.txt
    python scripts/gen_public_api.py --check   # exit 1 if the checked-in copy differs (tests/test_lint.py)

The surface is what the public modules export in `__all__`: for each class its own public methods and
properties with their signatures (and a model's fields), for each function its signature. A diff of
this file in a change is the list of what it adds, renames or removes for users.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import sys
from pathlib import Path

import pydantic

OUT = Path(__file__).resolve().parent.parent / "docs" / "public-api.txt"
MODULES = [
    "sandfleet",
    "sandfleet.client",
    "sandfleet.testing",
    "sandfleet.images",
    "sandfleet.adapters.gym",
    "sandfleet.adapters.swerex",
    "sandfleet.adapters.minisweagent",
]


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _private(cls: type) -> bool:
    return cls.__name__.startswith("_") and cls.__module__.startswith("sandfleet.client.")


def _own(cls: type) -> dict[str, object]:
    """The class's members, with those of its private bases (`_Fleet`, a part of `AsyncClient`): they
    are the class's own for a user, wherever the source keeps them."""
    members: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass is cls or _private(klass):
            members.update(klass.__dict__)
    return members


def _class(name: str, cls: type) -> list[str]:
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object and not _private(b))
    lines = [f"class {name}({bases})" if bases else f"class {name}"]
    if issubclass(cls, enum.Enum):
        lines += [f"    {m.name} = {m.value!r}" for m in cls]
        return lines
    if issubclass(cls, pydantic.BaseModel):
        own = cls.__dict__.get("__annotations__", {})
        for field, info in cls.model_fields.items():
            if field in own:
                default = "" if info.is_required() else " = ..."
                lines.append(f"    {field}: {own[field]}{default}")
    for attr, value in sorted(_own(cls).items()):
        if attr.startswith("_") and attr not in ("__init__", "__call__", "__enter__", "__aenter__"):
            continue
        if isinstance(value, property):
            lines.append(f"    @property {attr}")
        elif isinstance(value, classmethod | staticmethod):
            lines.append(f"    @{type(value).__name__} {attr}{_signature(value.__func__)}")
        elif inspect.isfunction(value):
            kind = "async def" if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value) else "def"
            lines.append(f"    {kind} {attr}{_signature(value)}")
    return lines


def render() -> str:
    out: list[str] = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        out.append(f"# {module_name}")
        for name in sorted(module.__all__):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                out += _class(name, obj)
            elif callable(obj):
                out.append(f"def {name}{_signature(obj)}")
            else:
                out.append(f"{name}: {type(obj).__name__}")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            sys.stderr.write(
                f"{OUT} differs from the SDK's public surface: if the change is meant, run "
                "`python scripts/gen_public_api.py` and commit the diff\n"
            )
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
