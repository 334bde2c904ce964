"""Floor L4 — the JSON Schemas in ``schemas/``, generated from the artifact models (a test keeps the two in
sync). It sits on top because it names models of two floors: plans and profiles (``planning``), and checkpoint
manifests and ``PART`` markers (``checkpoint``).

Regenerate after changing a model: ``python -m varuna_core.schemas [DIR]`` (default: the repository's
``schemas/``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from .checkpoint.manifest import Manifest
from .checkpoint.part import PartMarker
from .planning.artifacts import Plan, Profile
from .util.versioned_io import schema_text

__all__ = ["SCHEMAS", "write_schemas"]

SCHEMAS: dict[str, type[BaseModel]] = {
    "profile.schema.json": Profile,
    "plan.schema.json": Plan,
    "manifest.schema.json": Manifest,
    "part.schema.json": PartMarker,
}


def write_schemas(directory: str | Path) -> list[Path]:
    """(Re)generate every schema file in ``directory``."""
    written = []
    for name, model in SCHEMAS.items():
        path = Path(directory) / name
        path.write_text(schema_text(model))
        written.append(path)
    return written


if __name__ == "__main__":  # python -m varuna_core.schemas [DIR]: regenerate schemas/
    import sys

    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "schemas"):
        print(p)  # noqa: T201 - a command-line entry point
