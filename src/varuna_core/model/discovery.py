"""Structure discovery: one dry run of the unsliced model at 1 and at 2 examples.

What it records (the :class:`Structure`):

* the execution order of the cutpoints, so cut ``i`` separates segment ``i`` from segment ``i + 1``
  (N executed cutpoints → N + 1 segments);
* what crosses each cut, with the dims that scale with the batch (:mod:`varuna_core.model.payload`);
* for every module call, the segments it starts and ends in and the structure of its output, so a stage can
  stand in a placeholder for a module that another stage owns;
* which segments touch each parameter and buffer. A ``TorchFunctionMode`` sees every tensor op, so
  ``F.linear(x, self.weight)`` and ``x @ self.head_weight`` at the model root are both seen (the original's
  ``sys.settrace`` missed parameters passed only to builtins). An object touched in two segments is a tied
  weight when those segments land on different stages.

* which buffers the forward writes (``buffer_writes``; see [Note: buffer writes] in ``model.buffer_writes``).

The run happens in the mode the model is in (training, normally: the structure recorded is the one training
computes), under ``no_grad`` and with the RNG forked; every buffer is put back afterwards, so it leaves the
model, its buffers and the user's random stream as they were. Results are cached per process and on disk under
a key that hashes the model's structure, its classes' source files, its scalar attributes (the training flag
among them) and the inputs' signature: a changed model is never served a stale entry (the original kept
unkeyed pickles in the working directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..env import CACHE_DIR
from ..errors import ConfigError, CutPointError
from ..util.heap import release_free_memory
from ..util.usercode import accepts, plain_signature
from .autocut import follow_auto_cuts, survey_auto_cuts
from .buffer_writes import WriteWatch
from .cutpoint import CutPoint, find_cutpoints
from .lazy_values import ValueSource, on_touch, reads_values
from .module_state import AttributeUse, StateWatch
from .payload import CONST_TYPES, ProbeMismatch, TensorSpec, ValueSpec, spec_from_probes
from .precision import autocast
from .skips import CUT, Provenance, Skip, crossing_spec

__all__ = ["ModuleCall", "Structure", "discover", "dry_forward", "BatchFn", "make_batch_fn", "extract_loss"]

log = logging.getLogger(__name__)

BatchFn = Callable[[int], dict]
FORMAT_VERSION = 4

@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """One call of a module during the forward: the segments it starts and ends in, and its output."""

    segment_start: int
    segment_end: int
    output: ValueSpec | None  # None: the output cannot be described (then the module cannot be stood in for)


@dataclasses.dataclass(frozen=True)
class Structure:
    """Everything the slicer needs to know about a model, independent of the partition.

    Attributes:
        key: cache key (hash of model structure and inputs' signature).
        cut_names: cutpoint names in execution order.
        cuts: what crosses each cut.
        inputs: per model input, the dim that holds the batch (``None``: passed whole to every micro-batch).
        module_calls: per module name, its calls in order.
        param_uses: per parameter slot name, the segments that touch its values.
        buffer_uses: per buffer slot name, the segments that touch its values.
        skips: tensors read in a later segment than the one computing them, besides what the cuts carry
            (see [Note: skip routing]).
        auto_carried: per automatic cut (``cutpoints="auto"``), the places of its block's flattened arguments
            it carries (see [Note: loop-carried] in :mod:`~varuna_core.model.autocut`).
        module_state: the module attributes the forward writes, where, and where they are read (see [Note:
            module state]).
        buffer_writes: buffer slot names the forward writes (in place, or by replacing the tensor), sorted.
    """

    key: str
    cut_names: tuple[str, ...]
    cuts: tuple[ValueSpec, ...]
    inputs: dict[str, int | None]
    module_calls: dict[str, tuple[ModuleCall, ...]]
    param_uses: dict[str, tuple[int, ...]]
    buffer_uses: dict[str, tuple[int, ...]]
    skips: tuple[Skip, ...] = ()
    auto_carried: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    module_state: tuple[AttributeUse, ...] = ()
    buffer_writes: tuple[str, ...] = ()

    @property
    def num_segments(self) -> int:
        return len(self.cut_names) + 1

    def skips_across(self, cut: int) -> list[Skip]:
        """The skipped tensors crossing cut ``cut``, in a fixed order (both sides of the cut agree on it)."""
        return [s for s in self.skips if s.crosses(cut)]

    def crossing(self, cut: int) -> ValueSpec:
        """What crosses cut ``cut``: the cut's value, and with skips, ``(value, [skipped tensors])``."""
        return crossing_spec(self.cuts[cut], self.skips_across(cut))

    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "key": self.key,
            "cut_names": list(self.cut_names),
            "cuts": [c.to_json() for c in self.cuts],
            "inputs": self.inputs,
            "module_calls": {
                name: [
                    [c.segment_start, c.segment_end, None if c.output is None else c.output.to_json()]
                    for c in calls
                ]
                for name, calls in self.module_calls.items()
            },
            "param_uses": {k: list(v) for k, v in self.param_uses.items()},
            "buffer_uses": {k: list(v) for k, v in self.buffer_uses.items()},
            "skips": [s.to_json() for s in self.skips],
            "auto_carried": {k: list(v) for k, v in self.auto_carried.items()},
            "module_state": [u.to_json() for u in self.module_state],
            "buffer_writes": list(self.buffer_writes),
        }

    @classmethod
    def from_json(cls, data: dict) -> Structure:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError("unknown structure format")
        return cls(
            key=data["key"],
            cut_names=tuple(data["cut_names"]),
            cuts=tuple(ValueSpec.from_json(c) for c in data["cuts"]),
            inputs=dict(data["inputs"]),
            module_calls={
                name: tuple(ModuleCall(a, b, None if o is None else ValueSpec.from_json(o)) for a, b, o in calls)
                for name, calls in data["module_calls"].items()
            },
            param_uses={k: tuple(v) for k, v in data["param_uses"].items()},
            buffer_uses={k: tuple(v) for k, v in data["buffer_uses"].items()},
            skips=tuple(Skip.from_json(s) for s in data["skips"]),
            auto_carried={str(k): _places(v) for k, v in data["auto_carried"].items()},
            module_state=tuple(AttributeUse.from_json(u) for u in data["module_state"]),
            buffer_writes=_names(data["buffer_writes"]),
        )


def _names(value: Any) -> tuple[str, ...]:
    """Slot names read from the cache: a list of strings (anything else is a corrupt entry)."""
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError("corrupt name list")
    return tuple(value)


def _places(value: Any) -> tuple[int, ...]:
    """Leaf places read from the cache: a list of non-negative integers (anything else is a corrupt entry)."""
    if not isinstance(value, list) or not all(type(i) is int and 0 <= i < 2**31 for i in value):
        raise ValueError("corrupt auto_carried entry")
    return tuple(value)


# ----------------------------------------------------------------------------------------------------------
# Inputs


def make_batch_fn(dummy_inputs: Mapping[str, Any] | BatchFn, input_batch_dims: Mapping[str, int | None] | None):
    """Return ``(batch_fn, batch_dims)``: a function ``n -> inputs for n examples`` and each input's batch dim.

    ``dummy_inputs`` is either a dict of example inputs (tensors batched along dim 0 unless
    ``input_batch_dims`` says otherwise; other values are passed unchanged) or a function ``n -> dict`` (the
    original's ``get_batch_fn``), whose batch dims are found by probing at 1 and 2 examples.
    """
    if callable(dummy_inputs):
        fn = dummy_inputs
        probe_1, probe_2 = _call_batch_fn(fn, 1), _call_batch_fn(fn, 2)
        dims: dict[str, int | None] = {}
        for name, value in probe_1.items():
            other = probe_2.get(name)
            if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
                changed = [d for d in range(value.dim()) if value.shape[d] != other.shape[d]]
                if len(changed) > 1 or (changed and other.shape[changed[0]] != 2 * value.shape[changed[0]]):
                    raise ConfigError(
                        f"input {name!r} has shape {list(value.shape)} for 1 example and {list(other.shape)} for 2",
                        hint="exactly one dim of each batched input must hold the examples",
                    )
                dims[name] = changed[0] if changed else None
                if changed and value.shape[changed[0]] != 1:
                    raise ConfigError(
                        f"the batch function returned input {name!r} with {value.shape[changed[0]]} examples along "
                        f"dim {changed[0]} when asked for 1 (shape {list(value.shape)})",
                        hint="batch(n) must return exactly n examples in every batched input",
                    )
            else:
                dims[name] = None
        if input_batch_dims:
            dims.update(input_batch_dims)
        if not any(d is not None for d in dims.values()):
            raise ConfigError(
                f"the batch function returned the same shapes for 1 and 2 examples (inputs {sorted(dims)})",
                hint="batch(n) must return n examples in every batched input",
            )
        return fn, dims

    if not isinstance(dummy_inputs, Mapping) or not dummy_inputs:
        raise ConfigError(
            f"dummy_inputs must be a non-empty dict of model inputs or a function n -> dict, got "
            f"{type(dummy_inputs).__name__}",
            hint="pass e.g. {'idx': idx, 'targets': targets} with a few examples",
        )
    sample = dict(dummy_inputs)
    dims = {name: (0 if isinstance(v, torch.Tensor) and v.dim() > 0 else None) for name, v in sample.items()}
    for name, dim in (input_batch_dims or {}).items():
        if name not in sample:
            raise ConfigError(f"input_batch_dims names {name!r}, which is not an input",
                              hint=f"inputs: {sorted(sample)}")
        dims[name] = dim
    sizes = {name: sample[name].shape[d] for name, d in dims.items() if d is not None}
    if len(set(sizes.values())) > 1:
        raise ConfigError(
            f"dummy inputs disagree on the number of examples: {sizes}",
            hint="give every batched input the same batch size, or mark the others with input_batch_dims={name: None}",
        )

    def batch_fn(n: int) -> dict:
        out = {}
        for name, value in sample.items():
            dim = dims[name]
            if dim is None:
                out[name] = value
            else:
                index = torch.arange(n, device=value.device) % value.shape[dim]
                out[name] = value.index_select(dim, index)
        return out

    return batch_fn, dims


def _call_batch_fn(fn: Callable[..., object], n: int) -> dict[str, Any]:
    """``fn(n)``, or ``fn(n, device="cpu")`` for the original's ``get_batch_fn(size, device)`` whose ``device`` is
    required. Which one is read from the signature, never guessed from a ``TypeError``: one raised inside the
    function is its own error, not a sign that it wanted other arguments."""
    if accepts(fn, n) is False:
        if not accepts(fn, n, device="cpu"):
            raise ConfigError(f"the batch function cannot be called as fn(n) (its signature is "
                              f"{plain_signature(fn)})", hint="it takes the number of examples and returns a dict "
                                                                "of model inputs")
        batch = fn(n, device="cpu")
    else:
        batch = fn(n)
    if not isinstance(batch, Mapping):
        raise ConfigError(f"the batch function returned {type(batch).__name__}, not a dict of model inputs")
    return dict(batch)


def extract_loss(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: the output itself, ``output[0]``, or ``output["loss"]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if hasattr(output, "loss") and isinstance(output.loss, torch.Tensor):
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


# ----------------------------------------------------------------------------------------------------------
# The dry run


class _UseMode(TorchFunctionMode):
    """Records, per parameter/buffer object, the segments in which a torch op reads it."""

    def __init__(self, recorder: _Recorder, tracked: dict[int, Any]) -> None:
        super().__init__()
        self.recorder = recorder
        self.tracked = tracked
        self.uses: dict[int, set[int]] = {}
        self.provenance = Provenance(set(tracked))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = reads_values(func)
        segment = self.recorder.segment
        if reads:
            for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.tracked:
                    self.uses.setdefault(id(leaf), set()).add(segment)
        out = func(*args, **kwargs)
        self.provenance.after_op(func, args, kwargs, out, segment, reads)
        return out


class _Recorder:
    """Hooks that follow one forward: the current segment, cut values and module calls."""

    def __init__(self, model: nn.Module, cuts: dict[str, CutPoint], provenance: Provenance | None = None) -> None:
        self.provenance = provenance
        self.segment = 0
        self.cut_order: list[str] = []
        self.cut_values: list[Any] = []
        self.calls: dict[str, list[list[Any]]] = {}
        self._handles: list[Any] = []
        self._cuts = cuts
        names: dict[int, str] = {}
        for name, module in model.named_modules():
            if module is model or isinstance(module, CutPoint) or id(module) in names:
                continue
            names[id(module)] = name
            has_params = any(True for _ in module.parameters())
            self._handles.append(module.register_forward_pre_hook(self._pre(name, has_params)))
            self._handles.append(module.register_forward_hook(self._post(name)))
        for cut in cuts.values():
            cut.set_hook(self._on_cut)

    def _pre(self, name: str, has_params: bool):
        def hook(module, args):
            calls = self.calls.setdefault(name, [])
            if self.provenance is not None:
                self.provenance.module_enter(name, len(calls), self.segment, has_params)
            calls.append([self.segment, None, None])

        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            for call in reversed(self.calls[name]):
                if call[1] is None:
                    call[1], call[2] = self.segment, _shadow(output)
                    break
            if self.provenance is not None:
                self.provenance.module_output(self.segment, output)

        return hook

    def _on_cut(self, cut: CutPoint, value: Any) -> Any:
        if cut.cut_name in self.cut_order:
            raise CutPointError(
                f"CutPoint {cut.cut_name!r} was called twice in one forward",
                hint="call each CutPoint exactly once per forward; create one CutPoint per boundary",
            )
        self.cut_order.append(cut.cut_name)
        self.cut_values.append(_shadow(value))
        if self.provenance is not None:
            value = self.provenance.cut_value(cut.cut_name, len(self.cut_order) - 1, value)
        self.segment += 1
        release_free_memory(collect=False)  # the segment's freed intermediates (glibc keeps them in its heap)
        return value

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        for cut in self._cuts.values():
            cut.set_hook(None)


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """Stands in for a recorded value that cannot be flattened (its spec is then ``None``; at a cut, an error)."""

    type_name: str
    error: str


def _shadow(value: Any) -> Any:
    """``value`` with each tensor replaced by a ``meta`` tensor of its shape and dtype, and any other leaf that is
    not a constant by an :class:`_Opaque`: all that the specs read.

    Recording the values themselves kept every module's output of both dry runs alive until the end (at a
    sequence of 1024, each block's attention scores: hundreds of MB on a model of 25 MB)."""
    try:
        leaves, spec = torch.utils._pytree.tree_flatten(value)
    except Exception as exc:  # noqa: BLE001 - any container pytree cannot take: undescribable, said later
        return _Opaque(type(value).__name__, str(exc))

    def shadow(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
        if isinstance(leaf, CONST_TYPES):
            return leaf
        return _Opaque(type(leaf).__name__, "neither a tensor nor a constant")

    with torch._C.DisableTorchFunction():
        return torch.utils._pytree.tree_unflatten([shadow(leaf) for leaf in leaves], spec)


def _first_opaque(value: Any) -> _Opaque | None:
    if isinstance(value, _Opaque):
        return value
    return next((x for x in torch.utils._pytree.tree_leaves(value) if isinstance(x, _Opaque)), None)


@contextlib.contextmanager
def _quiet_run(model: nn.Module):
    """No autograd, forked RNG, in the model's own mode; restores each module's training flag afterwards (a
    forward may change them). Buffers are the caller's to keep (:class:`WriteWatch`)."""
    modes = {m: m.training for m in model.modules()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        for module, mode in modes.items():
            module.training = mode


class _OneExampleNorm(TorchFunctionMode):
    """Lets the 1-example probe through batch norm in training mode, which refuses one value per channel
    (``BatchNorm1d`` over ``[1, C]``): such a call normalises the example twice over (a batch of two copies) and
    keeps the first, which has the shape, dtype and device of the real call. The probe records structure, not
    values, and the buffers it updates are put back (:class:`WriteWatch`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.batch_norm and kwargs.get("training") and args:
            x = args[0]
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() == x.shape[1]:
                return func(torch.cat([x, x]), *args[1:], **kwargs)[:1]
        return func(*args, **kwargs)


def _run(model: nn.Module, cuts: dict[str, CutPoint], inputs: dict, mode: _UseMode | None, precision: str,
         watch: Callable[[Callable[[], int]], contextlib.AbstractContextManager[None]] | None = None):
    recorder = _Recorder(model, cuts, None if mode is None else mode.provenance)
    if mode is not None:
        mode.recorder = recorder
    try:
        with _quiet_run(model), autocast(precision, torch.device("cpu")), _OneExampleNorm(), (
            mode if mode is not None else contextlib.nullcontext()
        ), (watch(lambda: recorder.segment) if watch is not None else contextlib.nullcontext()):
            output = model(**inputs)
    finally:
        recorder.close()
    return recorder, output


def discover(
    model: nn.Module,
    batch_fn: BatchFn,
    input_batch_dims: Mapping[str, int | None],
    *,
    use_cache: bool = True,
    precision: str = "fp32",
    values: ValueSource | None = None,
    require_cuts: bool = True,
) -> Structure:
    """Run the model at 1 and 2 examples and describe its cuts, module calls and parameter uses.

    ``precision`` runs the dry run under the same autocast as training, so the dtypes recorded at the cuts
    are those the stages will exchange. A model built on ``meta`` runs with the values ``values`` gives its
    tensors, made as each op reads them (:func:`~varuna_core.model.lazy_values.on_touch`): never the whole model
    at once. ``require_cuts=False`` accepts a model without cuts (one segment: ``cutpoints="auto"`` on one stage).

    Raises:
        CutPointError: no cutpoints (unless ``require_cuts`` is false); a cutpoint called twice; a cut value
            with no batched tensor (tensors without a batch dim may travel with batched ones: they cross whole
            with every micro-batch) or of a structure that cannot cross a cut; cuts executed in a different order
            at the two sizes.
        ConfigError: the model's output holds no scalar loss.
    """
    cuts = _require_cutpoints(model) if require_cuts else find_cutpoints(model)
    inputs_1, inputs_2 = _call_batch_fn(batch_fn, 1), _call_batch_fn(batch_fn, 2)
    _check_forward_takes(model, inputs_1)
    key = structure_key(model, inputs_1, inputs_2, input_batch_dims, precision)
    if use_cache:
        cached = _cache_get(key)
        if cached is not None:
            follow_auto_cuts(model, cached.auto_carried)
            return cached

    slots = _slots(model)
    mode = _UseMode(None, {id(t): t for _, t, _ in slots})  # type: ignore[arg-type]
    values = _dry_values(slots, values)
    state = StateWatch(model)  # attributes the forward writes: [Note: module state]
    try:
        with WriteWatch(model) as writes, on_touch(model, values):  # the watch outside: its copies touch no value
            auto_carried = survey_auto_cuts(model, lambda: _run(model, cuts, inputs_1, None, precision))
            rec_1, out_1 = _run(model, cuts, inputs_1, mode, precision, state.writes)
            rec_2, _ = _run(model, cuts, inputs_2, None, precision, state.reads)
    finally:
        state.restore()
    _check_loss(out_1)
    if require_cuts or rec_1.cut_order or rec_2.cut_order:
        _check_cut_order(cuts, rec_1, rec_2)
    cut_specs = _cut_specs(rec_1, rec_2)
    module_calls = _module_calls(rec_1, rec_2)
    for slot, segments in mode.provenance.slot_reads().items():
        mode.uses.setdefault(slot, set()).update(segments)
    param_uses, buffer_uses = _tensor_uses(slots, mode, module_calls)
    skips = _skips(mode.provenance, tuple(rec_1.cut_order), cut_specs, module_calls)
    structure = Structure(
        key=key,
        cut_names=tuple(rec_1.cut_order),
        cuts=cut_specs,
        inputs=dict(input_batch_dims),
        module_calls=module_calls,
        param_uses=param_uses,
        buffer_uses=buffer_uses,
        skips=skips,
        auto_carried=auto_carried,
        module_state=state.uses(lambda name: _call_segments(module_calls, name, len(rec_1.cut_order) + 1)),
        buffer_writes=writes.written,
    )
    if use_cache:
        _cache_put(structure)
    return structure


def dry_forward(model: nn.Module, batch_fn: BatchFn, *, precision: str = "fp32",
                values: ValueSource | None = None) -> Callable[[], Any]:
    """A function that runs the model's forward once at 1 example as :func:`discover` does (quietly: the model,
    its buffers, the attributes its forward writes and the random stream are left as they were; a model built on
    meta gets its values as ops read them), for :func:`~varuna_core.model.autocut.apply_auto_cutpoints` to watch
    which modules it calls."""
    def run() -> Any:
        inputs = _call_batch_fn(batch_fn, 1)
        _check_forward_takes(model, inputs)
        state = StateWatch(model)  # puts back the attributes the forward writes
        try:
            with WriteWatch(model), on_touch(model, _dry_values(_slots(model), values)), _quiet_run(model), autocast(
                    precision, torch.device("cpu")), _OneExampleNorm():
                return model(**inputs)
        finally:
            state.restore()

    return run


def _dry_values(slots: list[tuple[str, torch.Tensor, bool]], values: ValueSource | None) -> ValueSource | None:
    """The values a dry run reads: a model built on meta is given some (any values show the structure; the stages
    get theirs from their own seed), pretrained weights are not read (initial values show it too)."""
    if values is None and _has_meta_tensors(slots):
        return ValueSource(seed=0)
    if values is not None and values.weights is not None:
        return dataclasses.replace(values, weights=None)
    return values


def _check_forward_takes(model: nn.Module, inputs: dict) -> None:
    """The model's ``forward`` takes the inputs as keyword arguments: a mismatch is bad input, said from the
    signature before the forward runs (the ``TypeError`` of the call would look like one the forward raised)."""
    if accepts(model.forward, **inputs) is False:
        raise ConfigError(f"{type(model).__name__}.forward{plain_signature(model.forward)} does not take the inputs "
                          f"{sorted(inputs)} as keyword arguments",
                          hint="the batch function (or dummy_inputs) must return a dict whose keys are the names of "
                               "the forward's arguments")


def _require_cutpoints(model: nn.Module) -> dict[str, CutPoint]:
    """The model's cutpoints by name; a CutPointError when it has none."""
    cuts = find_cutpoints(model)
    if not cuts:
        raise CutPointError(
            f"{type(model).__name__} has no CutPoint, so it cannot be split into pipeline stages",
            hint="insert `x = self.cut(x)` with `self.cut = CutPoint()` between blocks (e.g. after each layer)",
        )
    return cuts


def _check_loss(output: Any) -> None:
    """The dry run's output must hold a scalar loss."""
    loss = extract_loss(output)
    if loss is None or loss.numel() != 1:
        got = type(output).__name__ if loss is None else f"a tensor of shape {list(loss.shape)}"
        raise ConfigError(
            f"the model's forward must return the loss (a scalar tensor, or a tuple/dict whose first/'loss' entry "
            f"is one); it returned {got}",
            hint="compute the loss inside forward, e.g. `return F.cross_entropy(logits, targets)`",
        )


def _check_cut_order(cuts: dict[str, CutPoint], rec_1: _Recorder, rec_2: _Recorder) -> None:
    """Some cutpoint ran, in the same order at both sizes; cutpoints never called are ignored (with a warning)."""
    if not rec_1.cut_order:
        raise CutPointError(
            f"the model has {len(cuts)} CutPoint(s) but forward called none of them",
            hint="call each CutPoint on the activation crossing the boundary: `x = self.cut(x)`",
        )
    if rec_1.cut_order != rec_2.cut_order:
        raise CutPointError(
            f"cutpoints ran in a different order at batch sizes 1 and 2: {rec_1.cut_order} vs {rec_2.cut_order}",
            hint="the order of CutPoint calls must not depend on the batch",
        )
    unused = [name for name in cuts if name not in rec_1.cut_order]
    if unused:
        log.warning("CutPoint(s) never called in forward, ignored: %s", ", ".join(unused))


def _cut_specs(rec_1: _Recorder, rec_2: _Recorder) -> tuple[ValueSpec, ...]:
    """What crosses each cut, from its values at 1 and 2 examples; at least one tensor must be batched."""
    cut_specs = []
    for name, v1, v2 in zip(rec_1.cut_order, rec_1.cut_values, rec_2.cut_values, strict=True):
        opaque = _first_opaque(v1)
        if opaque is not None:
            raise CutPointError(f"CutPoint {name!r} carries a {opaque.type_name}, which cannot cross a cut: "
                                f"{opaque.error}", hint="a cut may carry a tensor or a tuple/list/dict of tensors")
        try:
            spec = spec_from_probes(v1, v2)
        except ProbeMismatch as exc:
            raise CutPointError(f"CutPoint {name!r} carries a value that cannot cross a cut: {exc}",
                                hint="a cut may carry a tensor or a tuple/list/dict of tensors") from exc
        if not spec.tensor_leaves:
            raise CutPointError(f"CutPoint {name!r} carries no tensor", hint="call the CutPoint on an activation")
        if not any(leaf.batch_dims for _, leaf in spec.tensor_leaves):
            shapes = [list(leaf.shape) for _, leaf in spec.tensor_leaves]
            raise CutPointError(
                f"CutPoint {name!r} carries tensors of the same shape {shapes} for 1 and 2 examples: none has a "
                f"batch dim",
                hint="place cutpoints on per-example activations (e.g. [batch, seq, hidden] or [seq, batch, hidden])",
            )
        cut_specs.append(spec)
    return tuple(cut_specs)


def _module_calls(rec_1: _Recorder, rec_2: _Recorder) -> dict[str, tuple[ModuleCall, ...]]:
    """Each module's calls (segment span, and its output's spec when both sizes called it alike)."""
    module_calls: dict[str, tuple[ModuleCall, ...]] = {}
    for name, calls_1 in rec_1.calls.items():
        calls_2 = rec_2.calls.get(name, [])
        out = []
        for i, (start, end, value) in enumerate(calls_1):
            spec = None
            if i < len(calls_2) and len(calls_1) == len(calls_2):
                try:
                    spec = spec_from_probes(value, calls_2[i][2])
                except ProbeMismatch:
                    spec = None
            out.append(ModuleCall(start, end, spec))
        module_calls[name] = tuple(out)
    return module_calls


def _skips(provenance: Provenance, cut_names: tuple[str, ...], cut_specs: tuple[ValueSpec, ...],
           module_calls: dict[str, tuple[ModuleCall, ...]]) -> tuple[Skip, ...]:
    """The tensors to carry across cuts (see [Note: skip routing]), each with its spec."""
    def spec_of(origin):
        if origin.source == CUT:
            value = cut_specs[origin.call]
        else:
            calls = module_calls.get(origin.name, ())
            value = calls[origin.call].output if origin.call < len(calls) else None
        leaf = value.leaves[origin.leaf] if value is not None and origin.leaf < len(value.leaves) else None
        return leaf if isinstance(leaf, TensorSpec) else None

    return provenance.skips(cut_names, spec_of)


def _tensor_uses(slots: list[tuple[str, torch.Tensor, bool]], mode: _UseMode,
                 module_calls: dict[str, tuple[ModuleCall, ...]]
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(parameter uses, buffer uses): the segments that read each slot; one never read lives with its owner."""
    param_uses: dict[str, tuple[int, ...]] = {}
    buffer_uses: dict[str, tuple[int, ...]] = {}
    for name, tensor, is_param in slots:
        segments = mode.uses.get(id(tensor))
        if not segments:  # never read: it lives with the module that owns it
            owner = name.rpartition(".")[0]
            segments = {c.segment_start for c in module_calls.get(owner, ())} or {0}
        (param_uses if is_param else buffer_uses)[name] = tuple(sorted(segments))
    return param_uses, buffer_uses


def _call_segments(module_calls: dict[str, tuple[ModuleCall, ...]], name: str, num_segments: int) -> set[int]:
    """The segments a module's calls run in (the model itself: every segment)."""
    calls = module_calls.get(name) if name else None
    if calls is None:
        return set(range(num_segments))
    return {seg for c in calls for seg in range(c.segment_start, c.segment_end + 1)}


def _has_meta_tensors(slots: list[tuple[str, torch.Tensor, bool]]) -> bool:
    return any(t.is_meta for _, t, _ in slots)


def _slots(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Every (name, tensor, is_parameter) slot, shared objects listed under each of their names."""
    out: list[tuple[str, torch.Tensor, bool]] = [
        (n, p, True) for n, p in model.named_parameters(remove_duplicate=False)]
    out += [(n, b, False) for n, b in model.named_buffers(remove_duplicate=False) if b is not None]
    return out


# ----------------------------------------------------------------------------------------------------------
# Cache


def structure_key(
    model: nn.Module, inputs_1: dict, inputs_2: dict, batch_dims: Mapping[str, Any], precision: str = "fp32"
) -> str:
    """Hash of what determines the structure: classes and their source, tensors' names/shapes/dtypes, scalar
    attributes of every module, the inputs' signature, and the torch version."""
    h = hashlib.sha256()
    h.update(f"v{FORMAT_VERSION} torch {torch.__version__} {precision}\n".encode())
    seen_files: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        h.update(f"M {name} {cls.__module__}.{cls.__qualname__} {module.extra_repr()}\n".encode())
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None), tuple)):
                h.update(f"A {key}={value!r}\n".encode())
        for klass in cls.__mro__:
            if klass.__module__.startswith(("torch.", "builtins")):
                continue
            path = _source_file(klass)
            if path and path not in seen_files:
                seen_files.add(path)
                try:
                    h.update(hashlib.sha256(Path(path).read_bytes()).digest())
                except OSError:
                    pass
    for name, tensor in model.state_dict(keep_vars=True).items():
        h.update(f"T {name} {list(tensor.shape)} {tensor.dtype}\n".encode())
    for label, inputs in (("1", inputs_1), ("2", inputs_2)):
        for name in sorted(inputs):
            value = inputs[name]
            sig = f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)[:200]
            h.update(f"I{label} {name} {sig} {batch_dims.get(name)}\n".encode())
    return h.hexdigest()[:32]


def _source_file(klass: type) -> str | None:
    try:
        return inspect.getsourcefile(klass)
    except (TypeError, OSError):
        return None


_MEMO: dict[str, Structure] = {}


def cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "varuna"
    )
    return Path(root) / "structure"


def _cache_get(key: str) -> Structure | None:
    if key in _MEMO:
        return _MEMO[key]
    path = cache_dir() / f"{key}.json"
    try:
        structure = Structure.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError):
        return None
    if structure.key != key:
        return None
    _MEMO[key] = structure
    return structure


def _cache_put(structure: Structure) -> None:
    _MEMO[structure.key] = structure
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{structure.key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(structure.to_json()))
        os.replace(tmp, directory / f"{structure.key}.json")
    except OSError as exc:  # a read-only home must not stop training
        log.debug("structure cache not written: %s", exc)
