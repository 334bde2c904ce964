"""Pretrained weights, read per stage: each rank reads only the tensors its stage holds.

[Note: reading weights per stage] A model too large for one process is built on ``meta`` and each rank
materialises only its stage (:mod:`.materialize`). Loading pretrained weights must keep that property: a rank
must neither build the whole ``state_dict`` nor read the shards of other stages. :class:`WeightSource` therefore
opens each ``safetensors`` file lazily with ``safe_open`` (memory-mapped: a tensor's bytes are read when it is
copied, and only then), opens a shard only when one of its tensors is asked for, and keeps it open for the next
one. :func:`load_into` copies tensor by tensor into the model's own (already allocated) tensors, so at most one
source tensor is held at a time.

Accepted layouts:

* a ``.safetensors`` file -- also what ``varuna ckpt merge`` writes: the model's own names (parameters and
  persistent buffers) with every name of a tied group present as a copy, metadata ``format``, ``step``, ``tied``...;
* a directory holding ``model.safetensors`` (``save_pretrained`` of a small model);
* a directory holding ``model.safetensors.index.json`` (``save_pretrained`` of a sharded model): a JSON object whose
  ``weight_map`` maps each tensor name to a shard file in the same directory.

The files are somebody else's (downloaded, shared), so they are read as every loader of this project reads:
the index with a bounded read, shard names that are plain file names (a ``weight_map`` naming ``../x`` or
``/etc/passwd`` must not read it), regular files opened without blocking (a FIFO would hang ``safe_open``),
symbolic links only where they stay in the directory -- or, in the Hugging Face hub cache layout
(``models--org--name/snapshots/<rev>/``), in that cache repository (its ``blobs/``), also when a snapshot's file is
named directly; a link that leads elsewhere is refused, naming it, before its target is opened. A malformed file
is one line naming it (``safetensors``' own errors are wrapped), never a traceback from a lower library.

Names are those of ``model.named_parameters()`` / ``named_buffers()`` (all names of a tied weight: a Hugging
Face checkpoint stores ``lm_head.weight`` or only ``transformer.wte.weight``, either is accepted).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError, VarunaError
from ..util.fs import MiB, describe_mode, open_regular, read_text

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is new in Python 3.11

__all__ = ["INDEX_NAME", "SINGLE_NAME", "LoadReport", "WeightSource", "load_into", "load_weights", "castable",
           "check_dtype"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
INDEX_LIMIT = 64 * MiB  # a 100k-tensor index is ~10 MB

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    **{k: getattr(torch, v) for k, v in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                                         ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                                         ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"))
       if hasattr(torch, v)},
}


def castable(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a stored tensor of dtype ``source`` may be loaded into a model tensor of dtype ``target``.

    Allowed: the same dtype; floating point to floating point of any width (fp32 weights into a bf16 model and
    back: the normal conversion of pretrained weights, rounding included); complex to complex; an integer to an
    integer type that holds every value of the source type (``int32`` position ids into an ``int64`` buffer).
    Refused, because a cast would silently change what the values mean: bool or integer to floating point (a
    mask or ids where weights belong), floating point to integer or bool (truncated), complex to real (the
    imaginary part dropped) and back, and an integer to a narrower one (wrapped around).
    """
    if source == target:
        return True
    if source.is_floating_point and target.is_floating_point:
        return True
    if source.is_complex and target.is_complex:
        return True
    if source == torch.bool or target == torch.bool or source.is_floating_point or target.is_floating_point \
            or source.is_complex or target.is_complex:
        return False
    try:
        have, want = torch.iinfo(source), torch.iinfo(target)
    except TypeError:  # an integer type torch gives no range of: only the same one is safe
        return False
    return want.min <= have.min and have.max <= want.max


def _short(exc: BaseException) -> str:
    """First line of a lower library's error, with its class: enough to act on, no traceback."""
    if isinstance(exc, VarunaError):
        return exc.message
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# ----------------------------------------------------------------------------------------------------------
# finding the files


def _hub_repo(directory: Path) -> Path | None:
    """The cache repository ``.../models--org--name`` if ``directory`` (as given, or where it leads) is one of its
    snapshots ``.../models--org--name/snapshots/<rev>``: its files are links into that repository's ``blobs``,
    and refusing them would refuse every downloaded model."""
    for candidate in (directory, Path(os.path.realpath(directory))):
        parent = candidate.parent
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return parent.parent
    return None


def _file_in(directory: Path, name: str, what: str) -> Path:
    """The path of the plain file ``name`` in ``directory``, with a link resolved if it may be followed.

    A link may lead anywhere inside ``directory`` or, for a snapshot of a Hugging Face cache, anywhere inside that
    cache repository (its ``blobs``); where it ends is found without opening anything, so a link out of there
    (to ``/etc/passwd``, to another directory, through a ``blobs`` that is itself a link) is refused before its
    target is opened.

    Raises:
        ConfigError: ``name`` is not a plain file name, is missing, is not a regular file, or is a link that
            leads out of ``directory`` (out of the cache repository, for a snapshot).
    """
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise ConfigError(f"{what} name {name!r} in {directory} is not a plain file name",
                          hint="shards must be files in the model directory itself (no '/', no '..')")
    path = directory / name
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"{what} {path} does not exist" if isinstance(exc, FileNotFoundError)
                          else f"cannot read {what} {path}: {exc.strerror or exc}",
                          hint="is the download complete?") from None
    if stat.S_ISLNK(info.st_mode):
        target = Path(os.path.realpath(path))
        repo = _hub_repo(directory)
        root = Path(os.path.realpath(repo if repo is not None else directory))
        if not target.is_relative_to(root):
            if repo is not None:
                raise ConfigError(f"{what} {path} is a symbolic link to {target}, outside the cache repository "
                                  f"{root}", hint="a Hugging Face cache links its snapshots into the repository's "
                                                  "own blobs/; download the model again")
            raise ConfigError(f"{what} {path} is a symbolic link to {target}, outside {directory}",
                              hint="copy the file into the model directory; a link could point anywhere")
        path = target
        try:
            info = os.lstat(path)
        except OSError:
            raise ConfigError(f"{what} {directory / name} is a dangling symbolic link") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is {describe_mode(info.st_mode)}, not a regular file")
    return path


class _Object(dict):
    """A JSON object that remembers the keys it holds more than once (``json`` keeps the last silently):
    ``repeated`` lists ``(key, first value, later value)``."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.repeated: list[tuple[str, Any, Any]] = []
        for key, value in pairs:
            if key in self:
                self.repeated.append((key, self[key], value))
            else:
                self[key] = value


def _read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face index, checked: ``{tensor name: shard file name}``, each name once (a
    name given twice, in two shards that may hold different values, would load whichever came last)."""
    text = read_text(path, INDEX_LIMIT, what="weights index", error=ConfigError)
    try:
        data = json.loads(text, object_pairs_hook=_Object)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = f"line {exc.lineno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else "nested too deep"
        raise ConfigError(f"weights index {path} is not JSON ({detail})", hint="is the download complete?") from None
    if not isinstance(data, _Object):
        raise ConfigError(f"weights index {path} holds a JSON {type(data).__name__}, not an object",
                          hint='expected {"metadata": {...}, "weight_map": {"name": "shard file"}}')
    if any(key == "weight_map" for key, _, _ in data.repeated):
        raise ConfigError(f"weights index {path} holds 'weight_map' twice", hint="is it the right file?")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, _Object) or not weight_map:
        raise ConfigError(f"weights index {path} has no (non-empty object) 'weight_map'",
                          hint='expected {"metadata": {...}, "weight_map": {"name": "shard file"}}')
    for name, first, later in weight_map.repeated:
        raise ConfigError(f"weights index {path} names tensor {name!r} twice: in {first!r} and in {later!r}",
                          hint="each tensor must be in one shard; is the index from one model?")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ConfigError(f"weights index {path} maps {name!r} to {shard!r}, not a file name")
    return dict(weight_map)


# ----------------------------------------------------------------------------------------------------------
# WeightSource


class WeightSource:
    """Read-only, lazy view of pretrained weights in one or several ``safetensors`` files.

    Build with :meth:`open`. Names come from the index (or the single file's header) without reading data;
    :meth:`shape`/:meth:`dtype` read only the header of the shard holding the name; :meth:`read` maps the
    tensor. Each shard is opened once, on first use, and stays open until :meth:`close` (or the ``with`` block
    ends). ``opened`` lists the shard files opened so far, so a caller can check that a stage read only its own.
    """

    def __init__(self, origin: Path, shards: dict[str, Path], where: dict[str, str], indexed: bool) -> None:
        self.origin = origin
        self._shards = shards  # shard file name -> checked path
        self._where = where  # tensor name -> shard file name
        self._indexed = indexed  # names from an index, which a shard's header may contradict
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self.opened: list[str] = []

    @classmethod
    def open(cls, path: str | os.PathLike) -> WeightSource:
        """A source for ``path``: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory
        holding ``model.safetensors`` (preferred, as Hugging Face does) or ``model.safetensors.index.json``.

        Raises:
            ConfigError: nothing loadable there, or a malformed index or file (named).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"weights must be a path, got {type(path).__name__} {path!r}")
        p = Path(path)
        if p.is_dir():
            if os.path.lexists(p / SINGLE_NAME):
                return cls._single(_file_in(p, SINGLE_NAME, "weights file"), p)
            if os.path.lexists(p / INDEX_NAME):
                return cls._sharded(p, _file_in(p, INDEX_NAME, "weights index"))
            raise ConfigError(f"weights directory {p} holds neither {SINGLE_NAME} nor {INDEX_NAME}",
                              hint="pass a .safetensors file (e.g. the output of `varuna ckpt merge`) or a "
                                   "Hugging Face model directory saved with safetensors")
        if not os.path.lexists(p):
            raise ConfigError(f"weights {p} does not exist")
        hub = _hub_repo(p.parent) is not None  # a file of a cache snapshot: its link must stay in the cache
        if p.name.endswith(".index.json"):
            return cls._sharded(p.parent, _file_in(p.parent, p.name, "weights index") if hub else p)
        if hub:
            return cls._single(_file_in(p.parent, p.name, "weights file"), p)
        return cls._single(Path(os.path.realpath(p)), p)  # a path the user names may be a link: follow it

    @classmethod
    def _single(cls, file: Path, origin: Path) -> WeightSource:
        source = cls(origin, {file.name: file}, {}, indexed=False)
        # the header is the name list: read it now, so a bad file fails here
        source._where = dict.fromkeys(source._handle(file.name).keys(), file.name)
        return source

    @classmethod
    def _sharded(cls, directory: Path, index: Path) -> WeightSource:
        weight_map = _read_index(index)
        shards = {name: _file_in(directory, name, "weights shard") for name in sorted(set(weight_map.values()))}
        return cls(directory, shards, dict(weight_map), indexed=True)

    # -- names and headers

    def names(self) -> list[str]:
        """Every tensor name, in the source's order."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def is_open(self, name: str) -> bool:
        """Whether the shard holding ``name`` is open already (reading it opens no new file)."""
        return self._where.get(name) in self._handles

    def shard_of(self, name: str) -> str:
        """The file name of the shard holding ``name``."""
        if name not in self._where:
            raise self._missing(name)
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape, from its shard's header (no data read)."""
        return tuple(self._call(name, lambda h: h.get_slice(name).get_shape()))

    def dtype(self, name: str) -> torch.dtype:
        """``name``'s dtype, from its shard's header (no data read)."""
        code = self._call(name, lambda h: h.get_slice(name).get_dtype())
        if code not in _DTYPES:
            raise ConfigError(f"tensor {name!r} in {self._shard_path(name)} has dtype {code}, which this torch "
                              f"cannot hold")
        return _DTYPES[code]

    def read(self, name: str) -> torch.Tensor:
        """``name`` as a CPU tensor, memory-mapped from its shard (its bytes are read when it is used)."""
        return self._call(name, lambda h: h.get_tensor(name))

    def metadata(self) -> dict[str, str]:
        """The first shard's ``__metadata__`` (``varuna ckpt merge`` writes ``step``, ``tied``... there)."""
        return dict(self._handle(next(iter(self._shards))).metadata() or {})

    # -- files

    def _shard_path(self, name: str) -> Path:
        return self._shards[self.shard_of(name)]

    def _call(self, name: str, fn: Any) -> Any:
        shard = self.shard_of(name)
        handle = self._handle(shard)
        if self._indexed and name not in self._keys[shard]:
            raise ConfigError(f"weights index {self.origin / INDEX_NAME} puts {name!r} in {shard}, which does not "
                              f"hold it", hint="is the download complete, the index from the same model?")
        try:
            return fn(handle)
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors, wrapped into one line
            raise ConfigError(f"cannot read tensor {name!r} from {self._shards[shard]}: {_short(exc)}",
                              hint="is the file complete?") from None

    def _handle(self, shard: str) -> Any:
        """The open ``safe_open`` handle of ``shard``, opening it (once) if needed."""
        handle = self._handles.get(shard)
        if handle is not None:
            return handle
        from safetensors import safe_open

        path = self._shards[shard]
        # Check the file on a descriptor opened without blocking (a FIFO would hang safe_open), then let
        # safe_open map that very file through /proc (no window for it to be swapped) where there is /proc.
        fd = open_regular(path, what="weights file", follow=False, error=ConfigError)
        try:
            proc = f"/proc/self/fd/{fd}"
            target = proc if os.path.exists(proc) else str(path)
            try:
                handle = safe_open(target, framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"weights file {path} is not a readable safetensors file: {_short(exc)}",
                                  hint="is the download complete? is it the right file?") from None
        finally:
            os.close(fd)
        keys = set(handle.keys())
        self._check_unique(shard, keys)
        self._handles[shard] = handle
        self._keys[shard] = keys
        self.opened.append(shard)
        return handle

    def _check_unique(self, shard: str, keys: set[str]) -> None:
        """Refuse a shard that holds a tensor the index puts in another shard: two files, possibly with
        different values, for one name. Found as shards are opened (a stage opens only its own), so every
        duplicate between the shards a load reads is refused before it is used."""
        if not self._indexed:
            return
        for name in sorted(keys):
            other = self._where.get(name)
            if other is not None and other != shard:
                raise ConfigError(f"weights {self.origin}: tensor {name!r} is in shard {shard} and in shard "
                                  f"{other} (where the index puts it)",
                                  hint="each tensor must be in one shard; are the files from one model?")

    def _missing(self, name: str) -> ConfigError:
        close = difflib.get_close_matches(name, self.names(), n=3)
        return ConfigError(f"weights {self.origin} hold no tensor {name!r}",
                           hint=f"closest names there: {close}" if close else None)

    def close(self) -> None:
        """Drop the open shards (their memory maps are released once no tensor read from them is alive)."""
        self._handles.clear()
        self._keys.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightSource({str(self.origin)!r}, shards={len(self._shards)}, opened={len(self.opened)})"


# ----------------------------------------------------------------------------------------------------------
# load_into


@dataclass
class LoadReport:
    """What :func:`load_into` did. ``tied``: ``'name <- read name'`` for each other name of a tied weight (not
    read again); ``missing_buffers``: persistent buffers the source does not hold (left as they were);
    ``ignored``: source tensors matching no model name that ``ignore`` allowed."""

    loaded: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    missing_buffers: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    shards_opened: list[str] = field(default_factory=list)


@dataclass
class _Group:
    """One tensor object of the model and every name it has (several for a tied weight)."""

    tensor: torch.Tensor
    names: list[str]
    is_param: bool


def _groups(model: nn.Module) -> dict[int, _Group]:
    """``{id(tensor): group}`` over parameters and persistent buffers, all names (``remove_duplicate=False``),
    in ``named_modules`` order."""
    groups: dict[int, _Group] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(module, kind).items():
                if t is None or (kind == "_buffers" and key in skip):
                    continue
                name = f"{prefix}.{key}" if prefix else key
                group = groups.setdefault(id(t), _Group(t, [], kind == "_parameters"))
                if name not in group.names:
                    group.names.append(name)
    return groups


def _compile_ignore(ignore: str | Iterable[str]) -> list[re.Pattern[str]]:
    patterns = [ignore] if isinstance(ignore, str) else list(ignore)
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as exc:
            raise ConfigError(f"ignore pattern {p!r} is not a regular expression: {exc}") from None
    return out


def _selected(model: nn.Module, groups: dict[int, _Group], names: Collection[str] | None) -> list[_Group]:
    """The groups to load: every group not on meta, or those of ``names`` (each must be real)."""
    if names is None:
        return [g for g in groups.values() if not g.tensor.is_meta]
    if isinstance(names, (str, bytes)) or not isinstance(names, Collection):
        raise ConfigError(f"names must be a collection of parameter/buffer names, got {names!r}")
    by_name = {n: g for g in groups.values() for n in g.names}
    chosen: dict[int, _Group] = {}
    for n in names:
        if n not in by_name:
            close = difflib.get_close_matches(str(n), list(by_name), n=3)
            raise ConfigError(f"{n!r} is not a parameter or persistent buffer of {type(model).__name__}",
                              hint=f"closest: {close}" if close else "use names from model.named_parameters()")
        g = by_name[n]
        if g.tensor.is_meta:
            raise ConfigError(f"{n!r} of {type(model).__name__} is on meta: there is nothing to load it into",
                              hint="materialize(model, modules=...) the modules you load first")
        chosen[id(g.tensor)] = g
    return list(chosen.values())


def _check_extras(model: nn.Module, source: WeightSource, groups: dict[int, _Group],
                  ignore: list[re.Pattern[str]], report: LoadReport) -> None:
    """With a full strict load, a source tensor that no model name matches is an error naming it."""
    known = {n for g in groups.values() for n in g.names}
    extras = [n for n in source.names() if n not in known]
    report.ignored = [n for n in extras if any(p.search(n) for p in ignore)]
    left = [n for n in extras if n not in set(report.ignored)]
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        close = difflib.get_close_matches(left[0], list(known), n=3)
        raise ConfigError(f"weights {source.origin} hold {left[0]!r}{more}, which is not a parameter or persistent "
                          f"buffer of {type(model).__name__}" + (f" (closest: {close})" if close else ""),
                          hint="is it the right model or config? known extras can be skipped with ignore=REGEX, "
                               "or pass strict=False")


def _pick(source: WeightSource, group: _Group, also: Mapping[str, Collection[str]]) -> str | None:
    """The name to read ``group`` under: one in an already open shard if any, else the first the source has
    (its own names first, then those ``also`` gives them)."""
    names = list(group.names) + [a for n in group.names for a in also.get(n, ()) if a not in group.names]
    present = [n for n in names if n in source]
    return next((n for n in present if source.is_open(n)), present[0] if present else None)


def load_into(model: nn.Module, source: WeightSource, *, names: Collection[str] | None = None,
              strict: bool = True, ignore: str | Iterable[str] = (),
              also: Mapping[str, Collection[str]] | None = None) -> LoadReport:
    """Copy pretrained tensors from ``source`` into ``model``'s own tensors, in place, one at a time.

    The model's tensors must be real already (allocated by :func:`.materialize` or built normally): loading
    writes into them and allocates nothing model-sized, so a stage that materialised only its modules loads
    only its tensors, from only its shards. Values are converted to each tensor's dtype and device where the
    conversion keeps their meaning (:func:`castable`: floating point to floating point of any width, an integer
    to a wider integer); any other pair of dtypes is refused before anything is copied.

    Args:
        names: parameter/buffer names to load (a tied weight is loaded once, under any of its names). Default:
            every parameter and persistent buffer not on ``meta``.
        strict: with ``names=None``, a source tensor matching no model name is an error (one may be on meta:
            it still counts as a model name). Ignored when ``names`` is given (a stage sees part of the source).
        ignore: regular expression(s) (``re.search``) of source names allowed to match nothing, e.g. GPT-2's
            ``attn.masked_bias``.
        also: per model name, other names its value may be read under (a declared tied weight whose copies are
            distinct tensors, as on a pipeline stage that holds one of them: the source may hold the other).

    Returns:
        A :class:`LoadReport`.

    Raises:
        ConfigError: a selected parameter missing from the source (named, with the closest source names), a
            shape mismatch (both shapes), a dtype that cannot be the tensor's (both dtypes), an extra source
            tensor (strict), an unreadable file or tensor.
    """
    if not isinstance(source, WeightSource):
        raise ConfigError(f"source must be a WeightSource, got {type(source).__name__}",
                          hint="use WeightSource.open(path), or load_weights(model, path)")
    groups = _groups(model)
    patterns = _compile_ignore(ignore)
    report = LoadReport()
    if strict and names is None:
        _check_extras(model, source, groups, patterns, report)
    plan = []  # checked from the headers first: a missing name or a wrong shape leaves the model untouched
    for group in _selected(model, groups, names):
        name = _pick(source, group, also or {})
        if name is None:
            if not group.is_param:
                report.missing_buffers.append(group.names[0])
                continue
            raise _not_in_source(model, source, group)
        shape = source.shape(name)
        if shape != tuple(group.tensor.shape):
            raise ConfigError(f"{name!r} has shape {list(shape)} in {source.shard_of(name)}, but "
                              f"{type(model).__name__} has {list(group.tensor.shape)}",
                              hint="is it the right model or config?")
        check_dtype(source, name, group.tensor.dtype,
                    f"the {'parameter' if group.is_param else 'buffer'} of {type(model).__name__}")
        plan.append((name, group))
    with torch.no_grad():
        for name, group in plan:  # one source tensor at a time: mapped, copied, dropped
            group.tensor.copy_(source.read(name))
            report.loaded.append(name)
            report.tied.extend(f"{other} <- {name}" for other in group.names if other != name)
    report.shards_opened = list(source.opened)
    return report


def check_dtype(source: WeightSource, name: str, target: torch.dtype, holder: str) -> None:
    """Refuse to load ``name`` into a tensor of dtype ``target`` unless :func:`castable` allows it (from the
    header: no data read). ``holder`` names that tensor in the message, e.g. ``"the parameter of GPT"``."""
    dtype = source.dtype(name)
    if not castable(dtype, target):
        raise ConfigError(f"{name!r} is {_dtype_name(dtype)} in {source.shard_of(name)}, but {holder} is "
                          f"{_dtype_name(target)}: loading it would change what its values mean",
                          hint="is it the right model or file? floating point loads into floating point of any "
                               "width, an integer into an integer type that holds all its values")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _not_in_source(model: nn.Module, source: WeightSource, group: _Group) -> ConfigError:
    also = f" (nor under {group.names[1:]})" if len(group.names) > 1 else ""
    close = difflib.get_close_matches(group.names[0], source.names(), n=3)
    return ConfigError(f"parameter {group.names[0]!r}{also} of {type(model).__name__} is not in weights "
                       f"{source.origin}" + (f" (closest there: {close})" if close else ""),
                       hint="is it the right checkpoint for this model and config?")


def load_weights(model: nn.Module, path: str | os.PathLike, *, names: Collection[str] | None = None,
                 strict: bool = True, ignore: str | Iterable[str] = (),
                 also: Mapping[str, Collection[str]] | None = None) -> LoadReport:
    """Open ``path`` (see :meth:`WeightSource.open`), :func:`load_into` ``model``, and close it again.

    Typical use: build under :func:`.meta_init`, :func:`.materialize` the modules a rank holds, then
    ``load_weights(model, path)``: only the real tensors are loaded and only their shards are read.
    """
    with WeightSource.open(path) as source:
        return load_into(model, source, names=names, strict=strict, ignore=ignore, also=also)
