"""Build a model on ``meta``, then give real memory and values to only the part a rank needs.

[Note: layout-independent initialisation] A model too large for one process is built without storage (its
parameters on the ``meta`` device), and each rank allocates only its stage's tensors. The values must not depend
on the layout: a tensor gets the same bits whatever pp, dp and partition, and the same as a single process
gets from ``materialize(model, seed=s)``. So no tensor's value may depend on how many other tensors were drawn
before it from one random stream. :func:`materialize` therefore works per *owner*: the module that holds the
tensor directly (the first such module in ``named_modules()`` order for a tensor held by several, i.e. a tied
weight). For each owner ``M`` it allocates all of ``M``'s own tensors, then runs the initialiser of ``M`` and of
each of its ancestors, children before parents (as ``nn.Module.apply`` and Hugging Face's ``initialize_weights``
do, so a parent that re-initialises a child's weight -- GPT-2's scaled ``c_proj`` -- wins). Each call draws from
a generator seeded with a stable hash of ``(seed, the initialised module's name, the owner's name)``, and while
it runs only ``M``'s tensors are real: writes to other tensors land on ``meta`` and do nothing, and draw nothing.

[Note: buffers on meta] A non-persistent buffer computed in ``__init__`` (a rotary ``inv_freq``, a causal mask)
has no initialiser of its own in most models: built under ``torch.device("meta")`` its values are gone. Build
under :func:`meta_init` instead, which puts parameters on ``meta`` and keeps buffers real. A meta buffer that no
initialiser restores is an error naming it (Hugging Face's ``_init_weights`` restores rotary tables itself).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import math
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError
from ..util import checks
from ..util.heap import release_free_memory
from .devices import check_device
from .rng import MASK64
from .weights import check_dtype

__all__ = ["materialize", "meta_init", "has_meta", "ValuePlan", "value_plan", "owner_values"]

Init = Callable[[nn.Module], Any]
Selection = Callable[[str], bool] | Collection[str] | None

_Slot = tuple[nn.Module, str, str]  # (module, "_parameters" | "_buffers", key)


# ----------------------------------------------------------------------------------------------------------
# meta_init


_patch_lock = threading.Lock()
_patch_depth = 0
_saved_register: Any = None


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules with their parameters on ``meta`` (no memory) and their buffers real.

    Use it instead of ``with torch.device("meta"):`` so that buffers computed in ``__init__`` (rotary tables,
    causal masks) keep their values; :func:`materialize` then allocates and initialises the parameters. This is
    accelerate's ``init_empty_weights(include_buffers=False)``: ``nn.Module.register_parameter`` is patched for
    the duration, so a parameter is created where its code creates it and moved to ``meta`` on registration
    (tensors computed before registration, e.g. ``nn.Parameter(torch.randn(n))``, exist briefly).

    While the context is open, initialisers that write only to meta tensors (``nn.init.*_``, ``normal_``,
    ``uniform_``, ``fill_``, ...) are skipped in the entering thread: on meta they compute nothing, yet a first
    ``normal_`` on meta imports torch's Python meta kernels (about 800 modules, 67 MB per process), and
    :func:`materialize` runs the initialisers again where values are real.

    Thread safety: the patch is process-wide. Modules that another thread constructs while the context is open
    are built on ``meta`` too. Nesting and entering from several threads is safe (the patch is installed by the
    first entry and removed by the last exit), but build models for real and on meta from different threads at
    the same time only if the real ones are built outside any such window.
    """
    global _patch_depth, _saved_register
    with _patch_lock:
        if _patch_depth == 0:
            _saved_register = nn.Module.register_parameter
            original = _saved_register

            def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
                original(self, name, param)
                if param is not None and param.device.type != "meta":
                    self._parameters[name] = _as_meta(param)

            nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        _patch_depth += 1
    try:
        with _SkipMetaWrites():
            yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            outermost = _patch_depth == 0
            if outermost:
                nn.Module.register_parameter = _saved_register  # type: ignore[method-assign]
                _saved_register = None
        if outermost:  # the parameters created before their move to meta are freed, but glibc keeps the pages
            release_free_memory(collect=False)


# In-place writes of values only (no shape, stride or flag changes): on meta tensors they do nothing.
_VALUE_WRITES = frozenset(
    "normal_ uniform_ trunc_normal_ constant_ ones_ zeros_ eye_ dirac_ xavier_uniform_ xavier_normal_ "
    "kaiming_uniform_ kaiming_normal_ orthogonal_ sparse_ fill_ zero_ random_ bernoulli_ exponential_ cauchy_ "
    "log_normal_ geometric_ erfinv_ clamp_ clamp_min_ clamp_max_ mul_ div_ add_ sub_ copy_ fill_diagonal_ "
    "masked_fill_ index_fill_ abs_ neg_ sqrt_ exp_ log_ addcmul_ addcdiv_".split()
)


class _SkipMetaWrites(TorchFunctionMode):
    """Skips the value writes of :data:`_VALUE_WRITES` whose tensor arguments are all on meta (returns the
    written tensor, as the op would)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _VALUE_WRITES:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if tensors and all(t.is_meta for t in tensors):  # the written tensor: first, positional or not
                return args[0] if args and isinstance(args[0], torch.Tensor) else tensors[0]
        return func(*args, **kwargs)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (a parameter stays a parameter of its class, with its attributes)."""
    if tensor.device == device:
        return tensor
    data = tensor.detach().to(device)
    return _new_param(tensor, data) if isinstance(tensor, nn.Parameter) else data


def _as_meta(param: nn.Parameter) -> nn.Parameter:
    """``param`` on ``meta``, same class and attributes."""
    return _new_param(param, param.detach().to("meta"))


def _new_param(old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter of ``old``'s class (plain ``nn.Parameter`` if that class cannot be built so) around
    ``data``, with ``old``'s ``requires_grad`` and Python attributes."""
    try:
        new = type(old)(data, requires_grad=old.requires_grad)
    except TypeError:
        new = nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    # Hugging Face marks tensors loaded from a checkpoint so that its initialisers skip them; fresh storage
    # holds no values, so the mark would be a lie (and would leave the tensor uninitialised).
    new.__dict__.pop("_is_hf_initialized", None)
    return new


# ----------------------------------------------------------------------------------------------------------
# materialize


def materialize(model: nn.Module, *, seed: int, init: Init | None = None, device: Any = "cpu",
                modules: Selection = None, park: Any = None) -> nn.Module:
    """Allocate every ``meta`` parameter and buffer of the selected modules on ``device`` and initialise it,
    with values that depend only on ``seed`` and the tensor's owner, not on which other modules are
    materialised, in which order, or in which process. Returns ``model`` (changed in place).

    Args:
        model: built on meta, best under :func:`meta_init`. Tensors that are already real are never touched, so
            an initialised or loaded model comes back unchanged (no re-initialisation: that would silently
            overwrite trained or loaded values) and a half-materialised one gets only its missing parts.
        seed: an unsigned 64-bit integer.
        init: ``init(module)`` initialises the module's tensors in place (write with ``torch.nn.init`` or
            in-place ops). Default: if ``model`` is a Hugging Face ``PreTrainedModel``, its ``_init_weights``
            (the nearest such model's, for composite models); otherwise the module's ``reset_parameters()``
            (``_reset_parameters()`` for torch's ``MultiheadAttention`` and ``Transformer``), when it has one.
            The chosen initialiser runs on each owner and then on its ancestors (see the module docstring).
        device: where to allocate (values are bit-identical across layouts for one device type).
        modules: which modules' own tensors (not their children's) to materialise: a predicate on the
            qualified name (``""`` is the root) or a collection of names. Default: all. A tied weight held by a
            selected module is materialised (initialised by its first owner) and put in every slot that holds
            it, so both names point to one tensor, as a stage holds its tied weights.
        park: where the tensors are kept once initialised (default: ``device``). Each owner's tensors are made
            and initialised on ``device`` (so their values are ``device``'s) and moved to ``park`` at once: a warm
            worker builds its stage's values on a GPU that another process still fills, one module at a time, and
            holds them in host memory until its turn comes (:meth:`~varuna_core.model.stage.StageSlice.unpark`).

    Raises:
        ConfigError: a bad ``seed``/``init``/``device``, an unknown name in ``modules``, or a tensor that no
            initialiser wrote (named, with how to fix it).
    """
    seed = checks.integer("seed", seed, low=0, high=MASK64)
    if init is not None and not callable(init):
        raise ConfigError(f"init must be a callable init(module), got {type(init).__name__} {init!r}")
    if isinstance(device, (str, torch.device)) and str(device).partition(":")[0] == "meta":
        raise ConfigError("materialize(device='meta') would allocate nothing", hint="pass a real device, e.g. 'cpu'")
    device = check_device(device, stage=False)  # a name torch does not know, or a device this machine lacks
    named = list(model.named_modules())  # one name per module object: the first
    selected = _select(model, modules)
    slots, owner_of = _meta_slots(named)
    wanted = {id(getattr(m, kind)[key]) for m, kind, key in slots if id(m) in selected}
    owners = [(name, m) for name, m in named if any(owner_of[id(t)] is m for t in _own_meta(m) if id(t) in wanted)]
    all_modules = dict(model.named_modules(remove_duplicate=False))
    made: dict[int, torch.Tensor] = {}
    park = None if park is None else torch.device(park)
    with _forked_rng(device), torch.no_grad():
        for name, owner in owners:
            fresh = _init_owner(model, all_modules, name, owner, owner_of, seed, init, device)
            made.update(fresh if park is None or park == device else {k: _moved(v, park) for k, v in fresh.items()})
    for m, kind, key in slots:
        old = getattr(m, kind)[key]
        if id(old) in wanted:
            getattr(m, kind)[key] = made[id(old)]
    return model


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on ``meta``."""
    return any(t.is_meta for t in model.parameters()) or any(b.is_meta for b in model.buffers())


class ValuePlan:
    """What :func:`owner_values` needs to make the values of a meta model's tensors one owner at a time (see
    :mod:`varuna_core.model.lazy_values`), computed once per model.

    ``tracked``: ids of every meta tensor in the model; ``aliases`` (slot name -> canonical slot name) make a
    tensor take another's value (declared tied weights, where the canonical value wins as on the stages)."""

    def __init__(self, model: nn.Module, seed: int, init: Init | None, device: torch.device,
                 aliases: dict[str, str] | None = None) -> None:
        self.model, self.seed, self.init, self.device = model, seed, init, device
        self.named = list(model.named_modules())
        self.module_name = {id(m): n for n, m in self.named}
        self.all_modules = dict(model.named_modules(remove_duplicate=False))
        _, self.owners = _meta_slots(self.named)
        slot_tensor: dict[str, torch.Tensor] = {}
        self.names: dict[int, list[str]] = {}
        for prefix, m in self.all_modules.items():
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(m, kind).items():
                    if t is not None:
                        name = f"{prefix}.{key}" if prefix else key
                        slot_tensor[name] = t
                        if t.is_meta:
                            self.names.setdefault(id(t), []).append(name)
        self.redirect: dict[int, torch.Tensor] = {}
        for name, canonical in (aliases or {}).items():
            t, c = slot_tensor.get(name), slot_tensor.get(canonical)
            if t is not None and c is not None and t is not c and t.is_meta:
                self.redirect[id(t)] = c
                if c.is_meta:
                    self.names.setdefault(id(c), []).append(name)
        self.tracked = set(self.owners) | set(self.redirect)

    def resolve(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor whose value ``tensor`` takes (itself unless aliased)."""
        return self.redirect.get(id(tensor), tensor)


def value_plan(model: nn.Module, seed: int, init: Init | None, device: Any,
               aliases: dict[str, str] | None = None) -> ValuePlan:
    """A :class:`ValuePlan` for ``model`` (arguments checked as :func:`materialize` checks them)."""
    seed = checks.integer("seed", seed, low=0, high=MASK64)
    if init is not None and not callable(init):
        raise ConfigError(f"init must be a callable init(module), got {type(init).__name__} {init!r}")
    return ValuePlan(model, seed, init, torch.device(device), aliases)


def owner_values(plan: ValuePlan, owner: nn.Module, source: Any = None) -> dict[int, torch.Tensor]:
    """Fresh values for every meta tensor ``owner`` holds first: ``{id(meta tensor): value}``, bit-identical to
    what :func:`materialize` gives them, then overwritten by ``source``'s tensors (a
    :class:`~varuna_core.model.weights.WeightSource`) under any of their names. The model is left unchanged."""
    name = plan.module_name[id(owner)]
    with _forked_rng(plan.device), torch.no_grad(), torch.autocast(plan.device.type, enabled=False):
        made = _init_owner(plan.model, plan.all_modules, name, owner, plan.owners, plan.seed, plan.init,
                           plan.device)
        if source is not None:
            for key, value in made.items():
                _overwrite(value, plan.names.get(key, []), source)
    return made


def _overwrite(value: torch.Tensor, names: list[str], source: Any) -> None:
    """Copy ``source``'s tensor under the first of ``names`` it holds into ``value`` (shape and dtype checked, as
    :func:`~varuna_core.model.weights.load_into` checks them)."""
    name = next((n for n in names if n in source), None)
    if name is None:
        return
    shape = source.shape(name)
    if tuple(shape) != tuple(value.shape):
        raise ConfigError(f"{name!r} has shape {list(shape)} in {source.shard_of(name)}, but the model has "
                          f"{list(value.shape)}", hint="is it the right model or config?")
    check_dtype(source, name, value.dtype, "the model's tensor")
    value.copy_(source.read(name))


def _select(model: nn.Module, modules: Selection) -> set[int]:
    """ids of the selected module objects."""
    every = list(model.named_modules(remove_duplicate=False))
    if modules is None:
        return {id(m) for _, m in every}
    if callable(modules):
        return {id(m) for name, m in every if modules(name)}
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Collection):
        raise ConfigError(f"modules must be a predicate or a collection of module names, got {modules!r}",
                          hint=f"e.g. modules={{{str(modules)!r}}}" if isinstance(modules, str) else None)
    by_name = dict(every)
    unknown = [n for n in modules if n not in by_name]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), [n for n in by_name if n], n=3)
        raise ConfigError(
            f"modules names {unknown!r}, which are not modules of {type(model).__name__}",
            hint=f"use names from model.named_modules(), e.g. {close}" if close else
            "use names from model.named_modules() ('' is the root)")
    return {id(by_name[n]) for n in modules}


def _own_meta(module: nn.Module) -> Iterator[torch.Tensor]:
    for kind in ("_parameters", "_buffers"):
        for t in getattr(module, kind).values():
            if t is not None and t.device.type == "meta":
                yield t


def _meta_slots(named: list[tuple[str, nn.Module]]) -> tuple[list[_Slot], dict[int, nn.Module]]:
    """Every slot holding a meta tensor, and the first owner (in ``named_modules`` order) of each tensor."""
    slots: list[_Slot] = []
    owner_of: dict[int, nn.Module] = {}
    for _, m in named:
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(m, kind).items():
                if t is not None and t.device.type == "meta":
                    slots.append((m, kind, key))
                    owner_of.setdefault(id(t), m)
    return slots, owner_of


def _init_owner(model: nn.Module, all_modules: dict[str, nn.Module], name: str, owner: nn.Module,
                owner_of: dict[int, nn.Module], seed: int, init: Init | None,
                device: torch.device) -> dict[int, torch.Tensor]:
    """Allocate all of ``owner``'s own meta tensors, run the initialisers of ``owner`` and its ancestors on
    them (nothing else is real meanwhile), check each was written, and put the meta originals back.
    Returns ``{id(meta original): new tensor}``."""
    mine = [(kind, key, t) for kind in ("_parameters", "_buffers") for key, t in getattr(owner, kind).items()
            if t is not None and t.device.type == "meta" and owner_of[id(t)] is owner]
    fresh: dict[str, tuple[torch.Tensor, int]] = {}
    for kind, key, old in mine:
        new = _allocate(old, device)
        getattr(owner, kind)[key] = new
        fresh[key] = (new, new._version)
    try:
        with _SkipMetaWrites():  # writes to the other (meta) tensors: nothing to compute
            ran = _run_chain(model, all_modules, name, seed, init, device)
        out: dict[int, torch.Tensor] = {}
        for kind, key, old in mine:
            new, version = fresh[key]
            now = getattr(owner, kind)[key]
            if not _written(new, version, now):
                raise _unwritten(model, name, owner, kind, key, init, ran)
            out[id(old)] = now
        return out
    finally:  # also on error: the model is left as it came, not half-allocated
        for kind, key, old in mine:
            getattr(owner, kind)[key] = old


def _run_chain(model: nn.Module, all_modules: dict[str, nn.Module], name: str, seed: int, init: Init | None,
               device: torch.device) -> list[str]:
    """Run the initialiser of the owner ``name`` and then of each ancestor, each on its own seeded stream.
    Returns what ran, for error messages."""
    ran: list[str] = []
    for i, module_name in enumerate([name] + _ancestors(name)):
        module = all_modules[module_name]
        fn = _initialiser(model, all_modules, module_name, module, init)
        if fn is None:
            continue
        _seed_generators(device, _stream_seed(seed, module_name, name) if i else _stream_seed(seed, name))
        fn()
        ran.append(f"{type(module).__name__} {module_name or '(root)'!r}")
    return ran


def _allocate(old: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage like ``old`` on ``device``; floating point filled with NaN so that an entry that
    no initialiser writes is detected, not silently left as garbage."""
    # not empty_like: from a meta tensor it runs torch's Python reference (importing sympy, ~40 MB per process)
    data = torch.empty_strided(old.size(), old.stride(), dtype=old.dtype, device=device)
    if data.is_floating_point() or data.is_complex():
        try:
            data.fill_(math.nan)
        except RuntimeError:  # a dtype without NaN (some float8 formats): rely on the version counter
            pass
    return _new_param(old, data) if isinstance(old, nn.Parameter) else data


def _written(new: torch.Tensor, version: int, now: torch.Tensor) -> bool:
    """Whether an initialiser gave the fresh tensor values: replaced it with a real one, or wrote it (no NaN
    left in floating point -- this also catches ``.data.normal_()``, which bumps no version counter -- or, for
    other dtypes, an in-place write)."""
    if now is not new:
        return now.device.type != "meta"
    if new.is_floating_point() or new.is_complex():
        try:  # a NaN left makes the sum NaN; only then look element-wise (that needs a mask as large as the tensor)
            return not bool(torch.isnan(new.sum())) or not bool(torch.isnan(new).any())
        except RuntimeError:
            pass
    return new._version != version


def _unwritten(model: nn.Module, name: str, owner: nn.Module, kind: str, key: str, init: Init | None,
               ran: list[str]) -> ConfigError:
    full = f"{name}.{key}" if name else key
    what = "parameter" if kind == "_parameters" else "buffer"
    tried = f"initialisers ran on {', '.join(ran)}" if ran else "no initialiser ran"
    if kind == "_buffers":
        hint = ("build the model under varuna_core.meta_init() instead of torch.device('meta'), so buffers "
                "computed in __init__ keep their values; or have the initialiser restore it")
    elif init is not None:
        hint = f"make init(module) initialise {type(owner).__name__}.{key} (e.g. with torch.nn.init)"
    else:
        hint = (f"pass materialize(..., init=fn) where fn(module) initialises {type(owner).__name__}.{key}, "
                f"or give {type(owner).__name__} a reset_parameters()")
    return ConfigError(f"{what} {full!r} of {type(model).__name__} is on meta and was not (fully) initialised "
                       f"({tried})", hint=hint)


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]``; the root has none."""
    if not name:
        return []
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)] + [""]


def _is_hf(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel``, recognised by its class without importing transformers: the module
    that defines the class is loaded whenever such a model exists."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def _initialiser(model: nn.Module, all_modules: dict[str, nn.Module], name: str, module: nn.Module,
                 init: Init | None) -> Callable[[], Any] | None:
    """The call that initialises ``module`` (see :func:`materialize`), or None."""
    if init is not None:
        return lambda: init(module)
    if _is_hf(model):
        for candidate in [name] + _ancestors(name):  # the nearest Hugging Face model, as its smart_apply does
            hf = all_modules[candidate]
            init_weights = getattr(hf, "_init_weights", None) if _is_hf(hf) else None
            if callable(init_weights):
                return lambda: init_weights(module)
        return None
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn
    return None


def _stream_seed(seed: int, *names: str) -> int:
    """A 64-bit seed from ``seed`` and module names: sha256, so it is the same in every process and Python run
    (``hash()`` of a str is salted per process)."""
    key = "\0".join([str(seed), *names]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")


def _seed_generators(device: torch.device, value: int) -> None:
    """Seed the generator(s) initialisers on ``device`` draw from: the CPU one always (factory code may draw
    there and copy), the device's own for an accelerator."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)
    elif device.type != "cpu":
        torch.manual_seed(value)


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """Leave the caller's random streams as they were: materialising must not shift user code's draws."""
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device.index if device.index is not None
                                            else torch.cuda.current_device()], device_type="cuda"):
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            yield
