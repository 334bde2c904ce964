"""This rank's slice of the user's model, and one forward of it on one micro-batch.

[Note: slicing] The user's own ``forward`` runs on every stage; nothing is rewritten. What changes per stage:

* Parameters and buffers of other stages live on the ``meta`` device (no memory). Tied weights are real on
  every stage that uses them.
* A module that owns parameters and runs in a segment before this stage returns a *placeholder* (meta tensors
  of its recorded output structure, batch dims scaled to the micro-batch) instead of running. Parameter-free
  modules (masks, rotary tables) run for real unless their inputs are placeholders. A module whose call spans
  cuts (a container around the blocks) runs: its children decide for themselves, and its cuts are counted.
* The cutpoints before the stage only count segments; the *incoming* cut swaps the placeholder for the
  activation received from the previous stage; the *outgoing* cut raises :class:`_StageExit` carrying the
  activation out of ``forward``, so nothing after it runs and no exception is swallowed.
* A tensor that skips over cuts (found by discovery, see [Note: skip routing]) crosses with the cut's value as
  ``(value, [skipped tensors])``: the stage that computes it captures it (a forward hook on its module, or at
  its cut), the stages in between pass it on, and the stage that reads it puts it where its placeholder
  would be. Any other value that skips a cut makes a placeholder meet a real tensor, which torch refuses;
  that error is turned into one that names the cut. Nothing silently computes on garbage.

[Note: meta failures] Whether torch refused an op *because* one of its tensors was on meta is a fact about the
op's arguments, not about the error's text. Before the incoming cut :class:`_PlaceholderWins` sees every op and
records a failing one that had a tensor on meta. After the cut no mode runs (it would cost every op of the
stage); a forward that fails there is run once more under :class:`_MetaOperands`, which records the same fact,
and only on that failure path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError, CutPointError
from ..ir.partition import Partition
from .buffer_writes import BufferWrites
from .cutpoint import CutPoint, find_cutpoints
from .discovery import Structure, extract_loss
from .lazy_values import ValueSource
from .materialize import materialize
from .meta_ops import MetaResults, has_meta, tensor_devices
from .module_state import AttributeSnapshot, check_state_crossings, stood_in_writer, written_attributes
from .rng import preserve_rng, seed_segment, segment_seed
from .skips import CUT, Skip, join_crossing, split_crossing

__all__ = ["TieSet", "find_tie_sets", "StageSlice"]

log = logging.getLogger(__name__)


class _StageExit(BaseException):
    """Carries the outgoing activation out of the user's forward (a BaseException, so ``except Exception``
    blocks in user code do not swallow it)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


@dataclasses.dataclass(frozen=True)
class TieSet:
    """Parameter slots that hold one logical weight.

    Attributes:
        names: every slot name of the weight (same object under several names, or declared ``shared_weights``).
        canonical: the name whose value wins at start-up.
        stages: the stages that hold a copy; their gradients are summed after every step.
    """

    names: tuple[str, ...]
    canonical: str
    stages: tuple[int, ...]


def weight_groups(model: nn.Module, shared_weights: list[tuple[str, str]] | None) -> list[tuple[str, tuple[str, ...]]]:
    """Every logical weight held under more than one name: ``(canonical, names)``, where the names are one
    parameter object under several names, or declared together in ``shared_weights``. The canonical name is the
    first of a declared pair, else the first name in ``named_parameters`` order: it depends on the model alone,
    never on the partition, so a checkpoint key means the same weight under every layout."""
    slot_objects = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, param in slot_objects.items():
        groups.setdefault(id(param), []).append(name)
    parent = {key: key for key in groups}

    def find(key: int) -> int:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    declared: dict[int, str] = {}
    for pair in shared_weights or []:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigError(f"shared_weights entries must be (name_a, name_b) pairs, got {pair!r}")
        for name in pair:
            if name not in slot_objects:
                close = [n for n in slot_objects if n.split(".")[-1] == name.split(".")[-1]][:5]
                raise ConfigError(
                    f"shared_weights names {name!r}, which is not a parameter of the model",
                    hint=f"use names from model.named_parameters(), e.g. {close}" if close else None,
                )
        a, b = (id(slot_objects[n]) for n in pair)
        declared.setdefault(find(a), pair[0])
        root_a, root_b = find(a), find(b)
        if root_a != root_b:
            parent[root_b] = root_a
            if root_b in declared:
                declared.setdefault(root_a, declared.pop(root_b))

    merged: dict[int, list[str]] = {}
    for key, names in groups.items():
        merged.setdefault(find(key), []).extend(names)
    return [(declared.get(root, names[0]), tuple(names)) for root, names in merged.items() if len(names) > 1]


def find_tie_sets(
    model: nn.Module, structure: Structure, partition: Partition, groups: list[tuple[str, tuple[str, ...]]]
) -> list[TieSet]:
    """The weights whose copies the pipeline must keep equal: those of ``groups`` (the model's
    :func:`weight_groups`, computed once by the caller) and single parameters held by more than one stage, or a
    weight held by more than one parameter object."""
    slot_objects = dict(model.named_parameters(remove_duplicate=False))
    groups = list(groups)
    grouped = {name for _, names in groups for name in names}
    # a weight under one name is tied too when segments of several stages read it (root code such as
    # ``h + self.pos`` computed again where a carried skip is read; see [Note: skip routing])
    groups += [(name, (name,)) for name in slot_objects if name not in grouped]
    ties = []
    for canonical, names in groups:
        segments = {seg for n in names for seg in structure.param_uses.get(n, (0,))}
        stages = tuple(sorted({partition.stage_of_segment(seg) for seg in segments}))
        objects = {id(slot_objects[n]) for n in names}
        if len(stages) > 1 or len(objects) > 1:
            ties.append(TieSet(names, canonical, stages))
    return ties


class _Context:
    """Per-forward state shared by the hooks: current segment, examples in the micro-batch, etc."""

    def __init__(self) -> None:
        self.segment = 0
        self.n = 1
        self.incoming: Any = None
        self.incoming_seen = False
        self.counters: dict[tuple[str, int], int] = {}  # stood-in module calls per (module, segment)
        self.produced: dict[tuple[str, int], int] = {}  # module calls per (module, segment) whose outputs skip
        self.carried: dict[int, torch.Tensor] = {}  # skipped tensors at hand, by index in structure.skips
        self.carried_in: dict[int, torch.Tensor] = {}  # of carried: those received with the incoming value
        self.rng: tuple[int, int, int] | None = None  # (seed, step, micro-batch) for per-segment seeding


class StageSlice:
    """The part of ``model`` that stage ``stage`` computes: not a module of its own, but the user's model with
    other stages' tensors moved to ``meta`` (in place; keeps a reference to it) and hooks that run the user's
    ``forward`` from this stage's incoming cut to its outgoing one.

    Args:
        model: the user's full model (CPU or device).
        structure: discovery result for the model.
        partition: segment ranges per stage.
        stage: this rank's stage.
        ties: tied weights (from :func:`find_tie_sets`).
        device: where this stage's parameters live.
        placeholders: ``"meta"`` (default: a value that leaks past a cut fails loudly, naming the cut) or
            ``"real"`` (NaN-filled tensors on ``device``: code before the incoming cut may inspect values, as
            Hugging Face's mask builders do; leaks are then caught by validation, see ``Varuna(validate=...)``).
        values: how this stage's tensors that are still on ``meta`` (a model built on meta) get their values:
            the modules holding them are materialised on ``device`` (:func:`.materialize`, layout-independent
            values from ``values.seed`` and ``values.init``); nothing else of the model is allocated. Pretrained
            ``values.weights`` are loaded by the caller once the stage is sliced (one read per tensor).
        state_checks: refuse module attributes read on another stage than the one writing them (default); a
            segment timed alone (the profiler) computes on random values anyway.
        written: buffer slots the forward writes besides ``structure.buffer_writes`` (those of the other mode's
            structure); with them, :attr:`buffer_writes` keeps what a recompute, an evaluation or a validation
            run must not change twice (see [Note: buffer writes]).
        park: where this stage's tensors wait until :meth:`unpark` moves them to ``device`` (default: they are
            on ``device`` from the start). A warm worker of a morph (DESIGN.md §3.8) parks its stage in host memory
            while the worker it replaces still fills the GPU; values made by ``values`` are still ``device``'s
            (each module initialised there, then moved), so the stage is the one a cold start would build.

    Raises:
        CutPointError: a module attribute that the forward writes in a segment of one stage is read in a segment
            of another ([Note: module state] in :mod:`varuna_core.model.module_state`); every rank raises it.
    """

    def __init__(
        self,
        model: nn.Module,
        structure: Structure,
        partition: Partition,
        stage: int,
        ties: list[TieSet],
        device: torch.device,
        placeholders: str = "meta",
        values: ValueSource | None = None,
        state_checks: bool = True,
        written: Iterable[str] = (),
        park: torch.device | None = None,
    ) -> None:
        # [Note: module state]; a profiler timing one segment alone has no use for the check
        relied = check_state_crossings(model, structure.module_state, partition) if state_checks else {}
        self._state_writers = relied.get(stage, set())
        self.attributes = AttributeSnapshot(written_attributes(model, structure.module_state))
        self.model = model
        self.values = values
        self.placeholder_device = torch.device("meta") if placeholders == "meta" else device
        self.structure = structure
        self.stage = stage
        self.num_stages = partition.num_stages
        seg = partition.segments(stage)
        self.first_segment, self.stop_segment = seg.start, seg.stop
        self.is_first = stage == 0
        self.is_last = stage == partition.num_stages - 1
        self.device = device
        self.park = park if park is not None and park != device else None
        self.ties = ties
        self._ctx = _Context()
        cuts = find_cutpoints(model)
        self._cuts = [cuts[name] for name in structure.cut_names]
        self.incoming_cut = structure.cut_names[self.first_segment - 1] if not self.is_first else None
        self.outgoing_cut = structure.cut_names[self.stop_segment - 1] if not self.is_last else None
        self.incoming_spec = structure.crossing(self.first_segment - 1) if not self.is_first else None
        self.outgoing_spec = structure.crossing(self.stop_segment - 1) if not self.is_last else None
        index = {skip: i for i, skip in enumerate(structure.skips)}
        self._in_skips = [index[s] for s in structure.skips_across(self.first_segment - 1)] if not self.is_first else []
        self._out_skips = [index[s] for s in structure.skips_across(self.stop_segment - 1)] if not self.is_last else []
        self.param_names = self._slice_tensors()
        self.buffer_writes = BufferWrites(model, (*structure.buffer_writes, *written))
        self._pre_cut = _PlaceholderWins() if not self.is_first else contextlib.nullcontext()
        # called when a forward reaches the incoming cut, after the code before it ran on placeholders (the
        # profiler times that part apart: a stage runs it once per forward, however many segments it has)
        self.on_incoming: Callable[[], None] | None = None
        self._install_hooks()

    # ------------------------------------------------------------------------------------------------------
    # Construction

    def _owns(self, segments: tuple[int, ...]) -> bool:
        return any(self.first_segment <= s < self.stop_segment for s in segments)

    def _slice_tensors(self) -> list[tuple[str, nn.Parameter]]:
        """Keep this stage's parameters and buffers on ``device``, move the rest to ``meta``. Returns the kept
        parameters as (name, parameter), deduplicated, each under the name it has in this stage's code."""
        model, structure = self.model, self.structure
        tie_of = {name: tie for tie in self.ties for name in tie.names}
        keep: set[str] = set()
        for name, _ in model.named_parameters(remove_duplicate=False):
            tie = tie_of.get(name)
            if tie is not None:
                if self.stage in tie.stages:
                    keep.add(name)
            elif self._owns(structure.param_uses.get(name, (0,))):
                keep.add(name)
        modules = dict(model.named_modules(remove_duplicate=False))
        param_free = {name for name, m in modules.items() if not any(True for _ in m.parameters())}
        needed_buffers: set[str] = set()
        for module_name, module in modules.items():
            for bname, buf in module._buffers.items():
                full = f"{module_name}.{bname}" if module_name else bname
                runs_here = module_name in param_free and any(
                    c.segment_start < self.stop_segment for c in structure.module_calls.get(module_name, ())
                )
                if buf is not None and (runs_here or self._owns(structure.buffer_uses.get(full, (0,)))):
                    needed_buffers.add(full)
        canonicals = {tie_of[name].canonical for name in keep if name in tie_of}
        self._materialize(keep | canonicals | needed_buffers)
        slot_objects = dict(model.named_parameters(remove_duplicate=False))
        # One object per tie set on this stage, valued as the canonical slot.
        canonical_obj = {tie.canonical: slot_objects[tie.canonical] for tie in self.ties}
        moved: dict[tuple[int, str], nn.Parameter] = {}  # (source, device type) -> its copy there
        for module_name, module in modules.items():
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                full = f"{module_name}.{pname}" if module_name else pname
                source = canonical_obj[tie_of[full].canonical] if full in tie_of else param
                target_device = self.home if full in keep else torch.device("meta")
                key = (id(source), target_device.type)
                if key not in moved:
                    data = source.detach().to(target_device)
                    moved[key] = nn.Parameter(data, requires_grad=source.requires_grad)
                module._parameters[pname] = moved[key]
        for module_name, module in modules.items():
            for bname, buf in list(module._buffers.items()):
                if buf is not None:
                    full = f"{module_name}.{bname}" if module_name else bname
                    module._buffers[bname] = buf.to(self.home if full in needed_buffers else "meta")
        names: list[tuple[str, nn.Parameter]] = []
        seen: dict[int, int] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if param.device.type == "meta":
                continue
            here = self._owns(structure.param_uses.get(name, (0,)))
            if id(param) not in seen:
                seen[id(param)] = len(names)
                names.append((name, param))
            elif here and not self._owns(structure.param_uses.get(names[seen[id(param)]][0], (0,))):
                names[seen[id(param)]] = (name, param)  # prefer the name used by this stage's code
        return names

    def _materialize(self, names: set[str]) -> None:
        """Give real values to the tensors of ``names`` that are on meta (their modules', on ``device``)."""
        tensors: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        on_meta = sorted(n for n in names if n in tensors and tensors[n].is_meta)
        if not on_meta:
            return
        if self.values is None:
            raise ConfigError(f"stage {self.stage} holds {on_meta[0]!r}, which is on the meta device, and no values "
                              f"were given for it", hint="pass seed= (and init=) for a model built on meta")
        materialize(self.model, seed=self.values.seed, init=self.values.init, device=self.device,
                    modules={n.rpartition(".")[0] for n in on_meta}, park=self.park)

    @property
    def home(self) -> torch.device:
        """Where this stage's tensors are now: ``park`` until :meth:`unpark`, then ``device``."""
        return self.park or self.device

    def unpark(self) -> bool:
        """Move a parked stage's parameters and buffers to ``device`` (parameters keep their identity: an
        optimizer built over them meanwhile still holds them). Returns whether anything was parked."""
        if self.park is None:
            return False
        with torch.no_grad():
            for param in {id(p): p for _, p in self.model.named_parameters(remove_duplicate=False)}.values():
                if param.device == self.park:
                    param.data = param.data.to(self.device)
            for module in self.model.modules():
                for bname, buf in list(module._buffers.items()):
                    if buf is not None and buf.device == self.park:
                        module._buffers[bname] = buf.to(self.device)
        self.park = None
        return True

    def _skip_tables(self) -> tuple[dict, dict, dict, dict]:
        """Where this stage puts received skipped tensors and takes the ones it sends on.

        Returns ``(received by module, received by cut, sent by module, sent by cut)``: per module name a map
        ``(segment, call index within the segment) -> [(leaf, skip index)]``, per cut index ``[(leaf, skip
        index)]``. Received: produced before this stage and read here (a stand-in call or a counted cut gives
        them back; a stage that only passes one on leaves its placeholder alone). Sent: produced here and
        crossing the outgoing cut."""
        received_mod: dict[str, dict] = {}
        received_cut: dict[int, list] = {}
        sent_mod: dict[str, dict] = {}
        sent_cut: dict[int, list] = {}
        sent = set(self._out_skips)
        for i, skip in enumerate(self.structure.skips):
            here = self.first_segment <= skip.produced < self.stop_segment
            if i in self._in_skips and skip.read_in(self.first_segment, self.stop_segment):
                mod_table, cut_table = received_mod, received_cut
            elif i in sent and here:
                mod_table, cut_table = sent_mod, sent_cut
            else:
                continue
            if skip.source == CUT:
                cut_table.setdefault(skip.call, []).append((skip.leaf, i))
            else:
                key = self._call_key(skip)
                mod_table.setdefault(skip.name, {}).setdefault(key, []).append((skip.leaf, i))
        return received_mod, received_cut, sent_mod, sent_cut

    def _call_key(self, skip: Skip) -> tuple[int, int]:
        """``(segment, index among the module's calls starting in that segment)`` of a skip's module call."""
        calls = self.structure.module_calls[skip.name]
        segment = calls[skip.call].segment_start
        return segment, sum(1 for c in calls[:skip.call] if c.segment_start == segment)

    def _install_hooks(self) -> None:
        received_mod, received_cut, sent_mod, sent_cut = self._skip_tables()
        for index, cut in enumerate(self._cuts):
            if index == self.first_segment - 1:
                cut.set_hook(self._incoming_hook if index not in sent_cut else self._capturing(
                    self._incoming_hook, sent_cut[index]))
            elif index == self.stop_segment - 1:
                cut.set_hook(self._outgoing_hook)
            elif index < self.first_segment - 1:
                cut.set_hook(self._count_hook if index not in received_cut else self._substituting(
                    received_cut[index]))
            elif index < self.stop_segment - 1:
                cut.set_hook(self._inner_hook if index not in sent_cut else self._capturing(
                    self._inner_hook, sent_cut[index]))
            else:
                cut.set_hook(None)
        modules = dict(self.model.named_modules())
        for name, table in sent_mod.items():
            modules[name].register_forward_hook(self._capture_output(name, table))
        if self.is_first:
            return
        for name, calls in self.structure.module_calls.items():
            module = modules.get(name)
            if module is None or isinstance(module, CutPoint):
                continue
            early = [c for c in calls if c.segment_start < self.first_segment]
            if not early:
                continue
            has_params = any(True for _ in module.parameters())
            by_segment: dict[int, list] = {}
            for call in calls:
                by_segment.setdefault(call.segment_start, []).append(call)
            object.__setattr__(module, "forward", self._stub(name, module.forward, by_segment, has_params,
                                                             received_mod.get(name, {})))

    def _stub(self, name: str, forward, by_segment: dict, has_params: bool, received: dict):
        ctx = self._ctx
        first = self.first_segment

        def stub(*args, **kwargs):
            segment = ctx.segment
            if segment >= first:
                return forward(*args, **kwargs)
            index = ctx.counters.get((name, segment), 0)
            ctx.counters[(name, segment)] = index + 1
            carried = received.get((segment, index)) if received else None
            if carried is None and not has_params and not has_meta(args, kwargs):
                return forward(*args, **kwargs)
            calls = by_segment.get(segment, [])
            call = calls[index] if index < len(calls) else None
            if call is not None and call.segment_end != segment:
                # a container whose call spans cuts (e.g. a transformer body around its blocks): it runs, its
                # own parameter-owning children stand in for themselves, and its cuts are counted
                return forward(*args, **kwargs)
            if call is None or call.output is None:
                raise CutPointError(
                    f"module {name!r} runs before this stage's first cut (segment {segment}) but its output "
                    f"cannot be reproduced as a placeholder",
                    hint="modules before a stage's incoming cut must return tensors (or tuples/dicts of tensors) "
                    "whose shapes depend only on the batch size",
                )
            if name in self._state_writers:  # [Note: module state]: its writes are read here
                raise stood_in_writer(self.model, name, self.stage, segment)
            with torch._C.DisableTorchFunction():  # no op of its own to watch: skip the mode's cost
                value = call.output.placeholder(ctx.n, self.placeholder_device)
            return value if carried is None else self._put_back(value, carried)

        return stub

    def _put_back(self, value: Any, carried: list[tuple[int, int]]) -> Any:
        """``value`` with the received skipped tensors at their leaves."""
        leaves, spec = pytree.tree_flatten(value)
        for leaf, i in carried:
            leaves[leaf] = self._ctx.carried[i]
        return pytree.tree_unflatten(leaves, spec)

    def _capture_output(self, name: str, table: dict):
        """A forward hook keeping the leaves of ``name``'s output that this stage sends on as skips."""
        ctx = self._ctx

        def hook(module, args, output):
            key = (ctx.segment, ctx.produced.get((name, ctx.segment), 0))
            ctx.produced[(name, ctx.segment)] = key[1] + 1
            wanted = table.get(key)
            if wanted:
                leaves = pytree.tree_leaves(output)
                for leaf, i in wanted:
                    ctx.carried[i] = leaves[leaf]

        return hook

    def _capturing(self, hook, wanted: list[tuple[int, int]]):
        """``hook`` (incoming or inner cut), then keep the leaves of the value leaving the cut that skip."""
        ctx = self._ctx

        def capture(cut: CutPoint, value: Any) -> Any:
            value = hook(cut, value)
            leaves = pytree.tree_leaves(value)
            for leaf, i in wanted:
                ctx.carried[i] = leaves[leaf]
            return value

        return capture

    def _substituting(self, carried: list[tuple[int, int]]):
        """A counted cut (before this stage) whose value holds received skipped tensors: they replace the
        placeholders there. The segment after it is seeded as its own stage seeds it (code before this stage's
        cut runs again on the carried tensors)."""
        def hook(cut: CutPoint, value: Any) -> Any:
            self._ctx.segment += 1
            self._seed()
            return self._put_back(value, carried)

        return hook

    # ------------------------------------------------------------------------------------------------------
    # Cut hooks

    def _count_hook(self, cut: CutPoint, value: Any) -> Any:
        self._ctx.segment += 1
        if self._in_skips:  # code before this stage's cut then computes on carried tensors: seed it as the owner
            self._seed()
        return value

    def _inner_hook(self, cut: CutPoint, value: Any) -> Any:
        self._ctx.segment += 1
        self._seed()
        return value

    def _incoming_hook(self, cut: CutPoint, value: Any) -> Any:
        ctx = self._ctx
        self._placeholders().leave()
        if self.on_incoming is not None:
            self.on_incoming()
        ctx.segment += 1
        ctx.incoming_seen = True
        self._seed()
        return ctx.incoming

    def _seed(self) -> None:
        ctx = self._ctx
        if ctx.rng is not None:
            seed, step, mb = ctx.rng
            seed_segment(self.device, segment_seed(seed, step, mb, ctx.segment))

    def _outgoing_hook(self, cut: CutPoint, value: Any) -> Any:
        if self._out_skips:
            carried = self._ctx.carried
            missing = [i for i in self._out_skips if i not in carried]
            if missing:
                skip = self.structure.skips[missing[0]]
                raise CutPointError(
                    f"on stage {self.stage}, {skip.describe()} must cross CutPoint {self.outgoing_cut!r} but was "
                    f"not computed in this forward",
                    hint="the forward must run the same modules and cuts for every batch")
            value = join_crossing(value, [carried[i] for i in self._out_skips])
        raise _StageExit(value)

    # ------------------------------------------------------------------------------------------------------
    # Forward

    def forward(self, inputs: dict, incoming: Any, n: int, *, rng: tuple[int, int, int] | None = None) -> Any:
        """Run the stage on one micro-batch.

        Args:
            inputs: the micro-batch's model inputs (every stage receives them).
            incoming: the value received at the incoming cut (``None`` on the first stage).
            n: examples in the micro-batch (sizes the placeholders).
            rng: ``(seed, step, micro-batch)``: seed each segment from it (see [Note: deterministic dropout])
                and leave the live random stream untouched; ``None`` uses the live stream.

        Returns:
            the value at the outgoing cut, or on the last stage the loss tensor (shape ``[]`` or ``[1]``).
        """
        ctx = self._ctx
        ctx.segment = 0
        ctx.n = n
        ctx.incoming_seen = False
        ctx.counters.clear()
        ctx.produced.clear()
        ctx.carried.clear()
        ctx.carried_in = {}
        if self._in_skips:
            incoming, carried = split_crossing(incoming, len(self._in_skips))
            ctx.carried_in = dict(zip(self._in_skips, carried, strict=True))
            ctx.carried.update(ctx.carried_in)
        ctx.incoming = incoming
        ctx.rng = rng
        if rng is None:
            return self._run(inputs)
        with preserve_rng(self.device):
            if self.is_first or self._in_skips:
                self._seed()
            return self._run(inputs)

    def _run(self, inputs: dict) -> Any:
        ctx = self._ctx
        try:
            with self._pre_cut:
                output = self.model(**inputs)
        except _StageExit as done:
            value = done.value
            if has_meta(value, {}):
                raise CutPointError(
                    f"on stage {self.stage}, the value reaching CutPoint {self.outgoing_cut!r} depends on a value "
                    f"computed on an earlier stage that did not cross CutPoint {self.incoming_cut!r}",
                    hint="values that skip over cuts are carried when tensor ops lead from them to their use; pass "
                    "this one through the CutPoint (it accepts a tuple or dict)",
                ) from None
            return value
        except CutPointError:
            raise
        except Exception as exc:
            if not self.is_first and self._failed_on_meta(exc, inputs):
                where = "after" if ctx.incoming_seen else "before"
                raise CutPointError(
                    f"on stage {self.stage}, code {where} CutPoint {self.incoming_cut!r} mixes a value computed on "
                    f"an earlier stage with this stage's tensors ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                    hint="values that skip over cuts are carried when tensor ops lead from them to their use; this "
                    "one came another way (a Python number, numpy, state kept across calls): pass it through the "
                    "CutPoint (it accepts a tuple or dict of tensors)",
                ) from exc
            raise
        finally:
            ctx.incoming = None
            ctx.carried.clear()
        if not self.is_last:
            raise CutPointError(
                f"stage {self.stage}'s forward ended without reaching its outgoing CutPoint {self.outgoing_cut!r}",
                hint="every CutPoint must be called on every forward",
            )
        if not self.is_first and not ctx.incoming_seen:
            raise CutPointError(
                f"stage {self.stage}'s forward never reached its incoming CutPoint {self.incoming_cut!r}")
        loss = extract_loss(output)
        if loss is None or loss.numel() != 1:
            raise ConfigError("the model's forward must return the loss as a scalar tensor")
        if loss.device.type == "meta":
            raise CutPointError(
                f"on the last stage the loss depends on values computed on an earlier stage that did not cross "
                f"CutPoint {self.incoming_cut!r}",
                hint="route every value the loss needs through the CutPoint",
            )
        return loss

    def _placeholders(self) -> _PlaceholderWins:
        """The watch before the incoming cut, which every stage but the first has."""
        assert isinstance(self._pre_cut, _PlaceholderWins)
        return self._pre_cut

    def _failed_on_meta(self, exc: Exception, inputs: dict) -> bool:
        """Whether the op that raised ``exc`` had a tensor on meta ([Note: meta failures]). Out of memory is
        never that, and is not worth a second run."""
        if isinstance(exc, torch.OutOfMemoryError):
            return False
        if not self._ctx.incoming_seen:
            return _raised_by(exc, self._placeholders().meta_failure)
        return self._replay_fails_on_meta(inputs)

    def _replay_fails_on_meta(self, inputs: dict) -> bool:
        """Run the failed forward again from the same state under :class:`_MetaOperands`: whether it fails, and
        because an op had a tensor on meta. Without a graph, seeded as the first run was (:meth:`forward`
        restores the live random stream when it seeds)."""
        ctx = self._ctx
        ctx.segment, ctx.incoming_seen = 0, False
        ctx.counters.clear()
        ctx.produced.clear()
        ctx.carried.clear()
        ctx.carried.update(ctx.carried_in)
        watch = _MetaOperands()
        try:
            if self._in_skips:
                self._seed()
            with torch.no_grad(), watch, self._pre_cut:
                self.model(**inputs)
        except _StageExit:
            return False
        except Exception as again:  # noqa: BLE001 - what failed, and whether the watch saw a meta operand fail
            return _raised_by(again, watch.meta_failure)
        finally:
            ctx.incoming_seen = True
        return False

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this stage holds (tied copies counted once)."""
        return sum(p.numel() * p.element_size() for _, p in self.param_names)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.param_names


class _PlaceholderWins(TorchFunctionMode):
    """Active from the start of a stage's forward to its incoming cut: an op mixing a ``meta`` tensor (a
    placeholder, or another stage's parameter) with real ones (a carried skip, a NaN placeholder, this stage's
    parameter) computes on ``meta``. The code before the cut runs only for what it leaves behind (values from
    the model's inputs, skips put back in place); what it computes from placeholders is garbage either way, and
    without this a root-level ``x + self.pos`` of another stage or ``down(h) + h`` with ``h`` carried would fail
    on the device mismatch. Left (:meth:`leave`) at the incoming cut, or when the forward ends."""

    def __init__(self) -> None:
        super().__init__()
        self._active = False
        self.meta_failure: BaseException | None = None  # the last error of an op with a tensor on meta
        self.results = MetaResults()  # [Note: meta op memo]

    def __enter__(self):
        self._active = True
        self.meta_failure = None
        return super().__enter__()

    def __exit__(self, *exc):
        if self._active:
            self._active = False
            return super().__exit__(*exc)
        return None

    def leave(self) -> None:
        self.meta_failure = None  # the cut was reached: an op that failed before it was handled
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta, real = tensor_devices(args, kwargs)
        if not meta:
            return func(*args, **kwargs)
        if real:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t if t.is_meta else torch.empty_like(t, device="meta"), (args, kwargs))
        try:
            return self.results.call(func, args, kwargs)
        except Exception as exc:  # a placeholder's .item(), bool() or copy to a real tensor: [Note: meta failures]
            self.meta_failure = exc
            raise


class _MetaOperands(TorchFunctionMode):
    """Sees every op and records the last error of one that had a tensor argument on meta ([Note: meta
    failures]); it changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.meta_failure: BaseException | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            if has_meta(args, kwargs):
                self.meta_failure = exc
            raise


def _raised_by(exc: BaseException | None, cause: BaseException | None) -> bool:
    """Whether ``exc`` is ``cause``, or was raised while handling it (user code may wrap torch's error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if exc is cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


