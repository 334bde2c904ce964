"""Floor L0 — what every artifact file shares: the pydantic bases, bounded JSON/YAML loading, atomic writing.

Plans, profiles and checkpoint manifests are files people copy, edit and pass around (their models are in
:mod:`varuna_core.planning.artifacts` and :mod:`varuna_core.checkpoint.manifest`). Loading one must refuse a
bad file with one line naming the file and the field, and never take more than seconds to do so, whatever the
file holds:

* **The file itself.** A regular file (never a FIFO, which would block, or a directory) of bounded size, UTF-8
  (:func:`read_artifact`).
* **JSON** is read by the standard parser, whose recursion limit bounds nesting, refusing duplicate keys
  (:func:`parse_json`).
* **YAML** is read by a safe loader that refuses anchors and aliases (an artifact never needs them; a "billion
  laughs" file expands a few hundred bytes into billions of nodes), duplicate keys, deep nesting and too many
  nodes, each as soon as it is seen (:func:`parse_yaml`).

Errors are :class:`~varuna_core.errors.ConfigError` throughout. Imports: errors and util only (pydantic, and
yaml lazily).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ConfigError
from .fs import atomic_write, read_text
from .text import short_repr

if TYPE_CHECKING:
    import yaml  # imported when a YAML file is read

__all__ = [
    "ArtifactModel", "CheckedModel", "check_document", "check_writable", "first_problem", "parse_json", "parse_yaml",
    "read_artifact", "save_artifact", "schema_text", "short_repr", "unique_keys", "validate", "write_output",
]

ModelT = TypeVar("ModelT", bound=BaseModel)


class ArtifactModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class CheckedModel(ArtifactModel):
    """Base of the plan and profile models: no NaN or infinity anywhere."""

    model_config = ConfigDict(allow_inf_nan=False)


# ----------------------------------------------------------------------------------------------------------
# Writing


def check_writable(path: str | Path, what: str = "output") -> None:
    """Fail before any work if ``path`` could not be written: it is a directory, or its directory is missing or
    not writable."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory", hint="give a file name")
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"cannot write {what} {path}: {parent} {problem}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {what} {path}: permission denied in {parent}")


def write_output(path: str | Path, text: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically (a crash leaves the old file or the new one); ConfigError if not."""
    try:
        atomic_write(path, text)
    except OSError as exc:
        raise ConfigError(f"cannot write {what} {path}: {exc.strerror or exc}") from None


def save_artifact(model: BaseModel, path: str | Path) -> None:
    """Write ``model`` as indented JSON, atomically (a crash leaves the old file or the new one)."""
    write_output(path, model.model_dump_json(indent=2) + "\n", "output")


def schema_text(model: type[BaseModel]) -> str:
    """The JSON Schema of ``model`` as the files in ``schemas/`` hold it (sorted keys, so diffs are stable)."""
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Reading


def first_problem(exc: ValidationError) -> str:
    """The first problem of a validation error in one line: the field, what is wrong, the value found."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    text = first["msg"].removeprefix("Value error, ")
    if where:
        text = f"{where}: {text}"
        value = first.get("input")
        if first["type"] not in ("missing", "value_error") and not isinstance(value, (dict, list)):
            text += f" (got {short_repr(value)})"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text


def read_artifact(path: str | Path, limit: int, what: str, hint: str) -> str:
    """The text of an artifact file: a regular UTF-8 file of at most ``limit`` bytes."""
    if not os.path.lexists(path):
        raise ConfigError(f"{what} {path} does not exist", hint=hint)
    return read_text(path, limit, what=what)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads` that refuses a key given twice (JSON allows it; the last
    would silently win)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def parse_json(text: str, path: str | Path, what: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply to be a {what}") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not a valid {what}: not JSON: {exc}") from None


def check_document(data: Any, path: str | Path, what: str, remake: str) -> dict[str, Any]:
    """``data`` as the mapping of fields an artifact is, of format version 1."""
    if not isinstance(data, dict):
        found = "is empty" if data is None else f"holds {short_repr(data, 40)}, not a mapping of fields"
        raise ConfigError(f"{path} is not a valid {what}: it {found}", hint="is it the right file?")
    version = data.get("schema_version")
    if version is not None and (isinstance(version, bool) or version != 1):
        raise ConfigError(f"{path} has {what} format version {short_repr(version)}; this release reads version 1",
                          hint=f"re-create it with this release's {remake}")
    return data


def validate(model: type[ModelT], data: dict[str, Any], path: str | Path, what: str, hint: str) -> ModelT:
    """``model`` validated from ``data``, or a one-line ConfigError naming the first wrong field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path} is not a valid {what}: {first_problem(exc)}", hint=hint) from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply to be a {what}") from None


# ----------------------------------------------------------------------------------------------------------
# YAML


@functools.cache
def _yaml_loader() -> type[yaml.SafeLoader]:
    """The safe YAML loader: libyaml's where it is installed (the pure-Python one is ten times slower),
    refusing duplicate keys. Built on first use: yaml is imported only when a YAML file is read."""
    import yaml
    from yaml.constructor import ConstructorError

    # libyaml's loader where it is installed: a base chosen at run time
    class UniqueKeySafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise ConstructorError(None, None, f"key {key.value!r} appears twice in one mapping",
                                               key.start_mark)
                    seen.add(key.value)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep)
            return mapping

    return UniqueKeySafeLoader


def _check_events(text: str, loader: type[yaml.SafeLoader], what: str, max_events: int, max_nesting: int) -> None:
    """Read the YAML event stream once, lazily, before building anything: refuse anchors and aliases, nesting
    deeper than ``max_nesting`` and more than ``max_events`` nodes, each as soon as it is seen. (libyaml's
    composer recurses on the C stack: a deeply nested file must never reach it.)"""
    import yaml

    depth = 0
    for count, event in enumerate(yaml.parse(text, Loader=loader)):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _refused(f"anchors and aliases (&name, *name) are not allowed in a {what}", event)
        if count >= max_events:
            raise _refused(f"more than {max_events:,} values", event)
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > max_nesting:
                raise _refused(f"nested more than {max_nesting} levels deep", event)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _refused(problem: str, event: yaml.Event) -> yaml.MarkedYAMLError:
    """The error of a document refused at ``event``, marked where the event starts."""
    from yaml.composer import ComposerError

    # libyaml's events carry its own Mark class, which the stubs do not take for one
    return ComposerError(None, None, problem, event.start_mark)  # type: ignore[arg-type]


def parse_yaml(text: str, path: str | Path, what: str, *, max_events: int, max_nesting: int) -> Any:
    """The value of the YAML document ``text`` (safe types only), read within the bounds above."""
    import yaml

    loader = _yaml_loader()
    try:
        _check_events(text, loader, what, max_events, max_nesting)
        return yaml.load(text, Loader=loader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = exc.problem or exc.context
        if problem and "maximum nesting depth" in problem:  # PyYAML >= 6.0.4's own limit (deeper than ours) hit
            problem = f"nested more than {max_nesting} levels deep"  # first, while its scanner read ahead
        raise ConfigError(f"{path} is not a valid {what}: {problem}{where}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        detail = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path} is not a valid {what}: {detail}") from None
