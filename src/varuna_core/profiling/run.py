"""``varuna profile``: measure each segment's compute and memory per micro-batch size, and the network.

Each segment is built apart: the model is built from its :class:`ModelSpec` and sliced so that the segment is a
stage of its own (:class:`varuna_core.model.stage.StageSlice`), fed a random activation of the recorded shape at
its incoming cut; a process times its block of segments in sequence, as a stage holding them runs ([Note: segments
timed in sequence]), each segment's part on its own, for

* ``forward``: a forward without autograd (the ``varuna`` schedule's F), from the segment's incoming cut on: what
  the forward of a segment other than the first runs before its cut (the earlier segments' code, on placeholders)
  is its ``prefix``, kept apart because a stage runs it once per forward however many segments it holds (timed
  into each segment, it was counted once per segment: the example GPT's stage of three segments summed to 1.9×
  its forward),
* ``recompute``: a forward that records the graph (1F1B/GPipe's F and varuna's R); the bytes autograd keeps for
  the backward are counted by saved-tensor hooks in a forward of their own, untimed (the hooks' Python calls
  would be timed as compute the runtime does not do),
* ``backward``: from a random output gradient (or the loss) to the input gradient and weight gradients,
* for the schedules that split the backward (``zb``, ``varuna-zb``), after a forward under
  :func:`~varuna_core.model.split.splitting` as the runtime runs it: ``split_backward`` (``B``: the split modules'
  input gradients and the other modules' whole backward), ``weight`` (``W``: the
  :class:`~varuna_core.model.split.WeightGrads` run) and ``weight_bytes`` (what the store keeps alive from ``B`` to
  ``W``),

with warm-up runs first and the median and spread of the timed repeats kept. Segments are spread over
``nproc`` local processes that measure in parallel (the original needed exactly one process per segment and
crashed with more). Micro-batch sizes run from small to large; the first size that exceeds the memory limit
(or runs out of device memory) on any segment ends the sweep for all of them, and is recorded.

With two or more processes the network is measured too: point-to-point one-way time and all-reduce time
against message size, each fitted to ``latency + bytes / bandwidth``. The first process also times its segments'
forward right after waits of 0.5-20 ms against a tight loop (the profile's ``idle_penalty``: on some machines work
after a wait runs slower, which a pipeline stage meets and a tight loop does not; [Note: idle penalty] in
:mod:`varuna_core.planning.simulate`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, UserCodeError, VarunaError
from ..ir.partition import Partition
from ..model.discovery import Structure, discover, make_batch_fn
from ..model.lazy_values import ValueSource
from ..model.payload import TensorSpec, flatten
from ..model.precision import autocast, wire_dtype
from ..model.spec import ModelSpec, load_spec
from ..model.split import SplitRoute, WeightGrads, splitting
from ..model.stage import StageSlice, find_tie_sets, weight_groups
from ..planning.artifacts import (
    CommCurve,
    Environment,
    IdlePenalty,
    LinearFit,
    Profile,
    SegmentMeasure,
    SegmentProfile,
    Stat,
    StopReason,
    TiedWeight,
)
from ..util.procs import JobOutcome, run_workers
from ..util.usercode import user_code
from .options import DEFAULT_MICROBATCH_SIZES, ProfileOptions

__all__ = ["profile", "profile_with", "profile_in_job", "ProfileOptions", "DEFAULT_MICROBATCH_SIZES", "P2P_SIZES"]

log = logging.getLogger(__name__)

P2P_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)  # 1 KiB .. 16 MiB
Progress = Callable[[int, int, str], None]


class _LimitReached(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def profile(
    spec: ModelSpec | str,
    *,
    microbatch_sizes: list[int] | None = None,
    nproc: int = 1,
    precision: str = "fp32",
    device: str = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    memory_limit: int | None = None,
    progress: Progress | None = None,
    timeout: float = 600.0,
) -> Profile:
    """Measure ``spec`` and return its :class:`Profile`: :func:`profile_with` of these
    :class:`~varuna_core.profiling.options.ProfileOptions` (their fields say what each argument means;
    ``microbatch_sizes=None`` measures the default sizes).

    Args:
        spec: a :class:`ModelSpec` or a reference ``module:attr`` / ``file.py:attr`` (required for ``nproc > 1``).
        progress: called with ``(done, total, what)`` as measurements complete.
    """
    options = ProfileOptions(microbatch_sizes=tuple(microbatch_sizes or DEFAULT_MICROBATCH_SIZES), nproc=nproc,
                             precision=precision, device=device, repeats=repeats, warmup=warmup,
                             memory_limit=memory_limit, timeout=timeout)
    return profile_with(spec, options, progress=progress)


def profile_with(spec: ModelSpec | str, options: ProfileOptions, *, progress: Progress | None = None) -> Profile:
    """Measure ``spec`` as ``options`` say and return its :class:`Profile` (see :func:`profile`).

    Raises:
        ConfigError: the devices asked for are not on this machine, or the spec cannot be loaded.
    """
    nproc, device, precision = options.nproc, options.device, options.precision
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda asked for, but CUDA is not available", hint="use cpu")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(f"device cuda puts process i on cuda:i, but {nproc} processes are asked for and this "
                          f"machine has {torch.cuda.device_count()} GPU(s)", hint="use fewer processes")
    measuring = options.measuring()
    if nproc == 1:
        model_spec = load_spec(spec)
        structure = _structure(model_spec, precision)
        return _measure_alone(model_spec, structure, progress=progress, **measuring)
    if not isinstance(spec, str):
        raise ConfigError("profiling with several processes needs the spec as a reference ('module:attr')",
                          hint="pass the string the spec is importable by, or use nproc=1")
    model_spec = load_spec(spec)  # fail fast, in this process, on a bad reference or model
    structure = _structure(model_spec, precision)
    if nproc > structure.num_segments:
        log.info("%d processes for %d segments: the extra processes only take part in the network measurement",
                 nproc, structure.num_segments)
    return _spawn(spec, nproc, measuring, progress, options.timeout)


# ----------------------------------------------------------------------------------------------------------
# One process


def _structure(spec: ModelSpec, precision: str) -> Structure:
    """The model's structure, from a dry run of its forward. Everything the user wrote runs here first (build,
    batch, init, forward): an exception from it is reported as the user's code failing (see
    :mod:`varuna_core.util.usercode`), with its place in their files."""
    model = spec.make()
    batch_fn, dims = make_batch_fn(spec.inputs, None)
    _check_batch(spec.inputs, dims, 2)
    with user_code("the model's code (dry run of its forward at 1 and 2 examples)"):
        return discover(model, batch_fn, dims, precision=precision, values=ValueSource(seed=0, init=spec.init))


def _check_batch(batch_fn: Callable[[int], dict], dims: dict, n: int) -> dict:
    """Call the spec's batch function and check it returned ``n`` examples in every batched input."""
    inputs = dict(batch_fn(n))
    for name, dim in dims.items():
        value = inputs.get(name)
        if dim is None or not isinstance(value, torch.Tensor):
            continue
        if value.dim() <= dim or value.shape[dim] != n:
            have = value.shape[dim] if value.dim() > dim else "no"
            raise ConfigError(
                f"the spec's batch({n}) returned input {name!r} with {have} examples along dim {dim} "
                f"(shape {list(value.shape)})",
                hint="batch(n) must return n examples in every batched input",
            )
    return inputs


def _segments_of(rank: int, world: int, num_segments: int) -> list[int]:
    """Contiguous, count-balanced blocks of segments per process (extra processes get none)."""
    base, extra = divmod(num_segments, world)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def _stat(samples: list[float]) -> Stat:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]  # noqa: E731
    return Stat(median=statistics.median(ordered), p10=pick(0.1), p90=pick(0.9), repeats=len(ordered))


def _random_like(spec: TensorSpec, n: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    shape = spec.shape_for(n)
    if spec.is_float:
        return torch.randn(shape, generator=generator).to(device=device, dtype=spec.torch_dtype)
    return torch.zeros(shape, dtype=spec.torch_dtype, device=device)


class _SegmentBench:
    """One segment built as a stage of its own, ready to be timed."""

    def __init__(self, spec: ModelSpec, structure: Structure, segment: int, device: torch.device,
                 precision: str) -> None:
        n = structure.num_segments
        partition = Partition.from_ranges([(i, i + 1) for i in range(n)], n)
        model = spec.make()
        ties = find_tie_sets(model, structure, partition, weight_groups(model, list(spec.shared_weights or [])))
        # a segment per stage: a tie's stages are the segments that use it (sizes from the slots, meta or not)
        slots = dict(model.named_parameters(remove_duplicate=False))
        self.ties = [TiedWeight(name=t.canonical, segments=list(t.stages),
                                grad_bytes=slots[t.canonical].numel() * slots[t.canonical].element_size())
                     for t in ties if len(t.stages) > 1 and slots[t.canonical].requires_grad]
        with user_code(f"the model's code (building segment {segment})"):  # a meta model's init runs here
            self.stage = StageSlice(model, structure, partition, segment, ties, device,
                                    placeholders="real" if spec.cutpoints == "auto" else "meta",
                                    values=ValueSource(seed=0, init=spec.init),  # used if built on meta
                                    state_checks=False)  # a segment timed alone: what state it reads is moot
        self.model = model
        self.structure = structure
        self.segment = segment
        self.device = device
        self.precision = precision
        self.params = [p for _, p in self.stage.param_names]
        self.optimizer = None
        if self.params:
            self.optimizer = spec.make_optimizer(self.params) or torch.optim.AdamW(self.params, lr=1e-3)
        self.generator = torch.Generator().manual_seed(segment)
        # when the last forward reached the incoming cut (perf_counter; None: not reached, or the first segment):
        # what came before it is the prefix, the earlier segments' code on placeholders (see SegmentMeasure.prefix)
        self.cut_reached: float | None = None
        self.stage.on_incoming = self._reached

    def _reached(self) -> None:
        _sync(self.device)
        self.cut_reached = time.perf_counter()

    def incoming(self, n: int) -> tuple[Any, list[torch.Tensor]]:
        spec = self.stage.incoming_spec
        if spec is None:
            return None, []
        tensors = [_random_like(leaf, n, self.device, self.generator) for _, leaf in spec.tensor_leaves]
        return spec.assemble(tensors), tensors

    def run(self, inputs: dict, n: int, incoming: tuple[Any, list[torch.Tensor]], *, grad: bool,
            saved: list[int] | None = None):
        """One forward of the segment on ``incoming`` (made by :meth:`incoming` outside the timed region)."""
        value, tensors = incoming
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_(grad)
        hooks: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if saved is not None:
            seen: set[tuple[int, int]] = set()
            static = self.static_storages()

            def pack(t: torch.Tensor):
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key not in seen and t.device.type != "meta" and key[0] not in static:
                    seen.add(key)
                    saved[0] += t.untyped_storage().nbytes()
                return t

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.set_grad_enabled(grad), autocast(self.precision, self.device), hooks:
            out = self.stage.forward(inputs, value, n)
        return out

    def static_storages(self) -> set[int]:
        """Where the model's real parameters and buffers live. Autograd saves views of them (a ``Linear`` on a
        3-D input saves its transposed weight, a split bias saves the pieces), which are not ``Parameter``
        objects; counted as activations, the weights of a segment would be charged once more for every
        micro-batch a schedule keeps, while they exist once, in the static bytes."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}

    def output_grads(self, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The output leaves to back-propagate from and random gradients for them (made outside the timing)."""
        if self.stage.is_last:
            return [out.float()], []
        leaves = [t for t in flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        return leaves, [torch.randn(t.shape, generator=self.generator).to(t) for t in leaves]

    @staticmethod
    def backward(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        if roots:
            torch.autograd.backward(roots, grads or None)

    def output_bytes(self, out: Any) -> int:
        if self.stage.is_last:
            return 0
        return sum(t.numel() * t.element_size() for t in flatten(out)[0] if isinstance(t, torch.Tensor))

    def wire16_bytes(self, out: Any) -> int:
        """:meth:`output_bytes` on a 2-byte wire (``wire_dtype`` bf16 or fp16: both narrow the same leaves to the
        same size, see [Note: wire dtype])."""
        if self.stage.is_last:
            return 0
        return sum(t.numel() * wire_dtype(t.dtype, torch.bfloat16).itemsize
                   for t in flatten(out)[0] if isinstance(t, torch.Tensor))

    def skip_bytes(self, out: Any) -> int:
        """Of :meth:`output_bytes`, the skipped tensors (they follow the cut's value, see
        :mod:`varuna_core.model.skips`)."""
        count = 0 if self.stage.is_last else len(self.structure.skips_across(self.segment))
        if not count:
            return 0
        tensors = [t for t in flatten(out)[0] if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors[-count:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _time_forward(bench: _SegmentBench, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(time after the incoming cut, time before it, result)`` of one forward of ``bench``."""
    bench.cut_reached = None
    _sync(bench.device)
    start = time.perf_counter()
    result = fn()
    _sync(bench.device)
    end = time.perf_counter()
    cut = bench.cut_reached if bench.cut_reached is not None else start
    return end - cut, cut - start, result


# [Note: segments timed in sequence] A process times its block of segments the way a stage holding them runs:
# each repeat runs every segment's forward in order, then (with graphs) every forward again and the backwards in
# reverse order, then the split forwards, B and W likewise, each segment's part timed on its own. Timed one
# segment at a time in a tight loop instead, a segment found its weights and activations still in the cache from
# its previous repeat, which a stage never does (between two forwards of a segment it runs the others' forwards
# and backwards): the example GPT's forward with graph summed to 3.0-3.1 ms over its five segments at micro-batch
# 4 where a one-stage run measured 3.7 ms per micro-batch, in sequence to 3.6-3.7 ms (its backward 5.0-5.3 ms,
# 5.2-5.3 and 5.2-5.6). The block holds the graphs of its segments at once, as a stage holding them does.


class _Timings:
    """One segment's samples in :func:`_measure_block`."""

    def __init__(self) -> None:
        self.forward: list[float] = []
        self.recompute: list[float] = []
        self.prefix: list[float] = []
        self.backward: list[float] = []
        self.split_backward: list[float] = []
        self.weight: list[float] = []
        self.weight_bytes = 0


def _measure_block(benches: list[_SegmentBench], inputs: dict, n: int, *, repeats: int, warmup: int,
                   memory_limit: int | None, static_bytes: dict[int, int], at: list[int]) -> list[SegmentMeasure]:
    """Time a process's block of segments at micro-batch ``n`` in sequence ([Note: segments timed in sequence]);
    one :class:`SegmentMeasure` per bench. ``at[0]`` is kept at the segment under way, for the caller to name
    when something fails (:class:`_LimitReached`, out of memory)."""
    device = benches[0].device
    saved, peaks = {}, {}
    for bench in benches:
        # what autograd keeps for the backward, counted once per size by saved-tensor hooks in a forward of its
        # own, untimed: a Python hook for every saved tensor (and the walk over the parameters that tells theirs
        # apart) made the timed forward with graph 64% slower than the runtime's (the example GPT's R: 3.0 ms
        # against 1.83 ms measured in training). The segment's peak memory alone is read in the same pass.
        at[0] = bench.segment
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        counter = [0]
        with _user(bench, n):
            out = bench.run(inputs, n, bench.incoming(n), grad=True, saved=counter)
        saved[bench.segment] = counter[0]
        if memory_limit is not None and static_bytes[bench.segment] + counter[0] > memory_limit:
            raise _LimitReached(f"segment {bench.segment} needs {static_bytes[bench.segment] + counter[0]:,} bytes "
                                f"at micro-batch {n} (limit {memory_limit:,})")
        roots, grads = bench.output_grads(out)
        with _user(bench, n):
            bench.backward(roots, grads)
        del out, roots, grads
        _clear_grads(bench)
        peaks[bench.segment] = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    timings = {bench.segment: _Timings() for bench in benches}
    outputs: dict[int, Any] = {}
    for i in range(warmup + repeats):
        timed = i >= warmup
        for bench in benches:  # the varuna schedule's F: no graph
            at[0], got = bench.segment, timings[bench.segment]
            incoming = bench.incoming(n)
            with torch.no_grad(), _user(bench, n):
                t_f, p_f, _ = _time_forward(bench, functools.partial(bench.run, inputs, n, incoming, grad=False))
            if timed:
                got.forward.append(t_f)
                got.prefix.append(p_f)
        for bench in benches:  # with the graph: 1F1B's F, varuna's R
            at[0], got = bench.segment, timings[bench.segment]
            incoming = bench.incoming(n)
            with _user(bench, n):
                t_r, p_r, outputs[bench.segment] = _time_forward(
                    bench, functools.partial(bench.run, inputs, n, incoming, grad=True))
            if timed:
                got.recompute.append(t_r)
                got.prefix.append(p_r)
        for bench in reversed(benches):
            at[0] = bench.segment
            roots, grads = bench.output_grads(outputs[bench.segment])
            with _user(bench, n):
                t_b, _ = _time(functools.partial(bench.backward, roots, grads), device)
            del roots, grads
            if timed:
                timings[bench.segment].backward.append(t_b)
        for bench in benches:
            _clear_grads(bench)
        _split_block(benches, inputs, n, timings if timed else None, at)
    measures = []
    for bench in benches:
        got = timings[bench.segment]
        measures.append(SegmentMeasure(
            microbatch_size=n, forward=_stat(got.forward), recompute=_stat(got.recompute), prefix=_stat(got.prefix),
            backward=_stat(got.backward), split_backward=_stat(got.split_backward), weight=_stat(got.weight),
            weight_bytes=got.weight_bytes, output_bytes=bench.output_bytes(outputs[bench.segment]),
            saved_bytes=saved[bench.segment], skip_bytes=bench.skip_bytes(outputs[bench.segment]),
            wire16_bytes=bench.wire16_bytes(outputs[bench.segment]), peak_bytes=peaks[bench.segment]))
    return measures


def _split_block(benches: list[_SegmentBench], inputs: dict, n: int, timings: dict[int, _Timings] | None,
                 at: list[int]) -> None:
    """The backward split as the runtime splits it under ``zb`` and ``varuna-zb``, in sequence over the block:
    every forward under :func:`~varuna_core.model.split.splitting` (not timed: the schedules' ``F`` or ``R``), then
    every ``B`` (a plain backward of that graph) in reverse order with the bytes its store keeps to ``W``, then every
    ``W``; into ``timings`` (None: a warm-up)."""
    device = benches[0].device
    stores, outputs = {}, {}
    for bench in benches:
        at[0] = bench.segment
        stores[bench.segment] = store = WeightGrads()
        incoming = bench.incoming(n)
        with splitting(store, SplitRoute()), _user(bench, n):  # the executor's way ([Note: hooked linear])
            outputs[bench.segment] = bench.run(inputs, n, incoming, grad=True)
    for bench in reversed(benches):
        at[0] = bench.segment
        roots, grads = bench.output_grads(outputs.pop(bench.segment))
        with _user(bench, n):
            t_b, _ = _time(functools.partial(bench.backward, roots, grads), device)
        del roots, grads
        if timings is not None:
            timings[bench.segment].split_backward.append(t_b)
            timings[bench.segment].weight_bytes = stores[bench.segment].nbytes
    for bench in reversed(benches):
        at[0] = bench.segment
        with _user(bench, n):
            t_w, _ = _time(stores[bench.segment].run, device)
        if timings is not None:
            timings[bench.segment].weight.append(t_w)
        _clear_grads(bench)


def _user(bench: _SegmentBench, n: int) -> contextlib.AbstractContextManager[None]:
    """The user's code runs inside: its errors name the segment and size (out of memory passes through)."""
    return user_code(f"the model's code (segment {bench.segment}, micro-batch {n})", keep=(torch.OutOfMemoryError,))


def _clear_grads(bench: _SegmentBench) -> None:
    for p in bench.params:
        p.grad = None


def _static_sizes(bench: _SegmentBench, repeats: int = 5) -> tuple[int, int, int, int, float]:
    """(param count, param bytes, grad bytes, optimizer-state bytes, optimizer step time) of a segment."""
    params = bench.params
    count = sum(p.numel() for p in params)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    gbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    obytes = 0
    step_time = 0.0
    if bench.optimizer is not None and gbytes:
        times = []
        for _ in range(1 + repeats):
            for p in params:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            times.append(_time(bench.optimizer.step, bench.device)[0])
        step_time = statistics.median(times[1:])
        bench.optimizer.zero_grad(set_to_none=True)
        for state in bench.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    obytes += value.numel() * value.element_size()
    return count, pbytes, gbytes, obytes, step_time


def _measure(spec: ModelSpec, structure: Structure, *, rank: int, world: int, microbatch_sizes: list[int],
             precision: str, device: str, repeats: int, warmup: int, memory_limit: int | None,
             progress: Progress | None, group: Any = None, turn: int | None = None,
             turns: int | None = None) -> tuple[list[SegmentProfile], list[int], StopReason | None, list[TiedWeight],
                                      IdlePenalty | None]:
    """Measure this process's segments: ``(segments, the sizes measured, why it stopped before the largest, the
    weights several segments use, on rank 0 how much slower its forward runs after a wait)``.

    ``turn`` of ``turns``: processes that share a host's CPU cores measure one after another, each size in
    ``turns`` rounds (a barrier between them), this process in round ``turn``. Measured at once they shared more
    than their cores: the cache, the memory bandwidth and, on a VM, physical cores its vCPUs stand for. On the
    2-core VM of benchmarks/README.md each segment of the example GPT read 1.5–2.4× its time alone (1.66 ms
    against 0.91 ms), and the planner then chose by the noise. ``None``: all at once (one device each)."""
    dev = _device(device, rank)
    mine = _segments_of(rank, world, structure.num_segments)
    benches = {k: _SegmentBench(spec, structure, k, dev, precision) for k in mine}
    with user_code("the optimizer's step"):
        statics = {k: _static_sizes(b) for k, b in benches.items()}
    measures: dict[int, list[SegmentMeasure]] = {k: [] for k in mine}
    _, dims = make_batch_fn(spec.inputs, None)
    done_sizes: list[int] = []
    stopped: StopReason | None = None
    total = len(mine) * len(microbatch_sizes)
    done = 0
    for n in microbatch_sizes:
        inputs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                  for k, v in _check_batch(spec.inputs, dims, n).items()}
        failure: tuple[int, str] | None = None
        for round_ in range(turns or 1):
            if turns is not None and round_ != turn:
                dist.barrier(group=group)
                continue
            at = [mine[0] if mine else -1]  # the segment under way, named if it fails
            static = {k: statics[k][1] + statics[k][2] + statics[k][3] for k in mine}
            try:
                block = _measure_block([benches[k] for k in mine], inputs, n, repeats=repeats, warmup=warmup,
                                       memory_limit=memory_limit, static_bytes=static, at=at) if mine else []
            except _LimitReached as exc:
                failure = (at[0], exc.reason)
            except torch.OutOfMemoryError as exc:
                failure = (at[0], f"out of memory: {str(exc).splitlines()[0]}")
            else:
                for k, measure in zip(mine, block, strict=True):
                    measures[k].append(measure)
                done += len(mine)
                if progress and mine:
                    progress(done, total, f"segments {mine[0]}-{mine[-1]}, micro-batch {n}")
            if turns is not None:
                dist.barrier(group=group)
        failure = _agree_failure(failure, world, dev, group)
        if failure is not None:
            stopped = StopReason(microbatch_size=n, segment=failure[0], reason=failure[1])
            for k in mine:
                measures[k] = [m for m in measures[k] if m.microbatch_size != n]
            break
        done_sizes.append(n)
    if not done_sizes and stopped is not None:
        raise ConfigError(
            f"micro-batch size {stopped.microbatch_size} already exceeds the memory of segment {stopped.segment}: "
            f"{stopped.reason}", hint="raise the memory limit, use smaller micro-batches, or add CutPoints")
    segments = [
        SegmentProfile(index=k, input_cut=structure.cut_names[k - 1] if k > 0 else None,
                       output_cut=structure.cut_names[k] if k < len(structure.cut_names) else None,
                       param_count=statics[k][0], param_bytes=statics[k][1], grad_bytes=statics[k][2],
                       optimizer_bytes=statics[k][3], optimizer_time=statics[k][4], measures=measures[k],
                       skips=[skip.describe() for skip in structure.skips_across(k)]
                       if k < len(structure.cut_names) else [])
        for k in mine
    ]
    ties = next(iter(benches.values())).ties if benches else []
    idle = None
    if rank == 0 and done_sizes:
        first = done_sizes[0]
        inputs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                  for k, v in _check_batch(spec.inputs, dims, first).items()}
        # a stage-like action of a few ms: the penalty saturates (a longer action pays what this one pays)
        chosen: list[int] = []
        forward_s = 0.0
        for k in mine:
            if chosen and forward_s + measures[k][0].forward.median > IDLE_ACTION_S:
                break
            chosen.append(k)
            forward_s += measures[k][0].forward.median
        with user_code(f"the model's code (segments {chosen[0]}-{chosen[-1]}, micro-batch {first})"):
            idle = _idle_penalty([benches[k] for k in chosen], inputs, first,
                                 3 if forward_s > 2 * IDLE_ACTION_S else min(max(repeats, 5), 10))
    return segments, done_sizes, stopped, ties, idle


IDLE_GAPS = (0.0005, 0.002, 0.005, 0.02)  # seconds: the waits of a stage between its actions, short to long
IDLE_ACTION_S = 0.005  # the idle penalty is timed on this process's first segments, up to this much forward


def _wait_for_event(seconds: float) -> None:
    """Block this thread on an event another thread sets ``seconds`` later, as a receive's wait is woken."""
    event = threading.Event()
    timer = threading.Timer(seconds, event.set)
    timer.start()
    event.wait()
    timer.join()


def _idle_penalty(benches: list[_SegmentBench], inputs: dict, n: int, repeats: int) -> IdlePenalty | None:
    """How much slower the forward of ``benches`` (one after another, without autograd: one action, as a stage's
    ``F``) runs right after a wait of each of :data:`IDLE_GAPS` than in a tight loop ([Note: idle penalty] in
    :mod:`varuna_core.planning.simulate`). The gaps take turns within each repeat, so a drift of the machine
    touches all of them alike; medians over ``repeats``. ``None`` when the action takes no measurable time."""
    device = benches[0].device
    incoming = [bench.incoming(n) for bench in benches]

    def action() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for bench, value in zip(benches, incoming, strict=True):
                bench.run(inputs, n, value, grad=False)
        _sync(device)
        return time.perf_counter() - start

    for _ in range(3):
        action()
    samples: dict[float, list[float]] = {gap: [] for gap in (0.0, *IDLE_GAPS)}
    for _ in range(repeats):
        for gap, times in samples.items():
            if gap:
                _wait_for_event(gap)
            times.append(action())
    base = statistics.median(samples[0.0])
    if not base > 0:
        return None
    fractions = [min(10.0, max(0.0, statistics.median(samples[gap]) / base - 1)) for gap in IDLE_GAPS]
    return IdlePenalty(gaps_s=list(IDLE_GAPS), fractions=fractions, action_s=base)


def _measure_alone(spec: ModelSpec, structure: Structure, *, progress: Progress | None, **options: Any) -> Profile:
    """The profile of every segment, measured in this one process (``options``: :func:`_measure`'s)."""
    segments, sizes, stopped, ties, idle = _measure(spec, structure, rank=0, world=1, progress=progress, **options)
    return _assemble(spec, structure, segments, sizes, stopped, [], nproc=1, precision=options["precision"],
                     device=_device(options["device"], 0), ties=ties, idle=idle)


def _device(device: str, rank: int) -> torch.device:
    """Where process ``rank`` measures: its own GPU for ``cuda``."""
    return torch.device(device, rank) if device == "cuda" else torch.device("cpu")


def _agree_failure(failure, world: int, device: torch.device, group) -> tuple[int, str] | None:
    """Every process learns whether any segment hit the limit at this size (and which, lowest first)."""
    if world == 1:
        return failure
    gathered: list = [None] * world
    dist.all_gather_object(gathered, failure, group=group)
    hits = [f for f in gathered if f is not None]
    return min(hits) if hits else None


def _cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, which a container or ``taskset`` narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _assemble(spec, structure, segments, sizes, stopped, comm, *, nproc, precision, device,
              ties: list[TiedWeight], idle: IdlePenalty | None = None) -> Profile:
    devices = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if device.type == "cuda" else [platform.processor() or platform.machine()])
    env = Environment(torch_version=torch.__version__, python_version=platform.python_version(),
                      device_type=device.type, devices=devices, threads=torch.get_num_threads(),
                      hosts=[socket.gethostname()], nproc=nproc, precision=precision, cpu_cores=_cpu_cores())
    return Profile(model=spec.name or "model", structure_hash=structure.key, num_segments=structure.num_segments,
                   cut_names=list(structure.cut_names), microbatch_sizes=sizes, stopped=stopped,
                   segments=sorted(segments, key=lambda s: s.index), comm=comm, ties=ties, idle_penalty=idle,
                   environment=env,
                   created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# ----------------------------------------------------------------------------------------------------------
# Network


def fit_linear(sizes: list[int], times: list[float]) -> LinearFit:
    """``time = latency + size / bandwidth`` minimising the *relative* squared error (small messages count as
    much as large ones), latency clamped at ≥ 0; returns the fit with its RMS relative error."""
    w = [1.0 / (y * y) if y > 0 else 0.0 for y in times]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes, strict=True))
    sy = sum(wi * y for wi, y in zip(w, times, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    latency = (sy - slope * sx) / sw if sw else 0.0
    if latency < 0:  # refit through the origin
        latency, slope = 0.0, sxy / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    rel = [((latency + slope * x) - y) / y for x, y in zip(sizes, times, strict=True) if y > 0]
    err = (sum(r * r for r in rel) / len(rel)) ** 0.5 if rel else 0.0
    return LinearFit(latency=latency, bandwidth=1.0 / slope, rel_error=err)


def _p2p_curve(rank: int, device: torch.device, repeats: int, link: str) -> CommCurve | None:
    """One-way time between ranks 0 and 1 by ping-pong (half the round trip)."""
    times = []
    for size in P2P_SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        samples = []
        for i in range(repeats + 2):
            _sync(device)
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            _sync(device)
            if i >= 2:
                samples.append((time.perf_counter() - start) / 2)
        times.append(statistics.median(samples))
    if rank != 0:
        return None
    sizes = list(P2P_SIZES)
    return CommCurve(op="p2p", link=link, group_size=2, sizes=sizes, times=times, fit=fit_linear(sizes, times))


def _allreduce_curves(rank: int, world: int, device: torch.device, repeats: int, link: str) -> list[CommCurve]:
    curves = []
    for g in range(2, world + 1):
        group = dist.new_group(list(range(g)))
        times = []
        for size in P2P_SIZES:
            buf = torch.ones(size // 4, dtype=torch.float32, device=device)
            samples = []
            for i in range(repeats + 2):
                dist.barrier(group=group) if rank < g else None
                start = time.perf_counter()
                if rank < g:
                    dist.all_reduce(buf, group=group)
                    _sync(device)
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples))
        if rank == 0:
            sizes = list(P2P_SIZES)
            curves.append(CommCurve(op="allreduce", link=link, group_size=g, sizes=sizes, times=times,
                                    fit=fit_linear(sizes, times)))
    return curves


# ----------------------------------------------------------------------------------------------------------
# Several processes


def _spawn(reference: str, nproc: int, options: dict, progress: Progress | None, timeout: float) -> Profile:
    with tempfile.TemporaryDirectory(prefix="varuna-profile-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"spec": reference, "nproc": nproc, "options": options}))
        outcome = run_workers(
            [sys.executable, "-m", "varuna_core.profiling.run", str(job), tmp], nproc, log_dir=tmp, timeout=timeout,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, stdout_to_log=False, poll=0.2,
            on_poll=_progress_reporter(progress, nproc) if progress else None)
        if outcome.timed_out:
            raise VarunaError(f"profiling did not finish within {timeout:g}s",
                              hint="raise the timeout or measure fewer micro-batch sizes")
        if not outcome.ok:
            _raise_worker_error(Path(tmp), outcome)
        return Profile.model_validate_json((Path(tmp) / "profile.json").read_text())


def _progress_reporter(progress: Progress, nproc: int) -> Callable[[Any], None]:
    """Reads the workers' counters from the job's store and reports them."""
    total = [0]

    def report(store) -> None:
        done = sum(int(store.add(f"done/{r}", 0)) for r in range(nproc))
        total[0] = total[0] or int(store.add("total", 0))
        if total[0]:
            progress(done, total[0], "measuring segments" if done < total[0] else "measuring the network")

    return report


def _raise_worker_error(tmp: Path, outcome: JobOutcome) -> None:
    """The error of the rank that failed (its error file, else the end of its log) as a Varuna error."""
    rank, code = outcome.failed or next((r, c) for r, c in enumerate(outcome.returncodes) if c != 0)
    text = tmp / f"error{rank}.txt"
    detail = text.read_text() if text.exists() else (tmp / f"rank{rank}.log").read_text()[-2000:]
    err = json.loads(detail) if text.exists() else {"message": (detail.strip().splitlines()[-1:] or ["?"])[0]}
    if err.get("config"):
        raise ConfigError(err["message"], hint=err.get("hint"))
    if err.get("user"):  # the user's code failed in that process: said as it was said there
        raise UserCodeError(f"in profiling process {rank}, {err['message']}", hint=err.get("hint"))
    raise VarunaError(f"profiling process {rank} failed (exit {code}): {err['message']}", hint=err.get("hint"))


def profile_in_job(spec: ModelSpec, options: dict, progress: Progress | None = None,
                   on_total: Callable[[int], None] | None = None) -> Profile | None:
    """Every rank of a running job (the default process group): measure this rank's share of the segments, then,
    with two ranks or more, the network between them; rank 0 returns the whole :class:`Profile`, the others None.

    ``options``: :func:`profile`'s ``microbatch_sizes`` (a sorted list), ``precision``, ``device``, ``repeats``,
    ``warmup`` and ``memory_limit``; ``on_total(measurements of the whole job)`` is called on rank 0 once the
    structure is known. Collective: every rank calls it with the same options."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    structure = _structure(spec, options["precision"])
    if rank == 0 and on_total is not None:
        on_total(structure.num_segments * len(options["microbatch_sizes"]))
    if world == 1:
        return _measure_alone(spec, structure, progress=progress, **options)
    dev = _device(options["device"], rank)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    turn = turns = None
    if dev.type == "cpu":  # the processes of a host measure one after another (see _measure)
        turn = hosts[:rank].count(hosts[rank])
        turns = max(hosts.count(h) for h in hosts)
    segments, sizes, stopped, ties, idle = _measure(spec, structure, rank=rank, world=world, progress=progress,
                                                    turn=turn, turns=turns, **options)
    link = "inter" if len(set(hosts)) > 1 else "intra"
    p2p = _p2p_curve(rank, dev, 5, link)
    allreduce = _allreduce_curves(rank, world, dev, 5, link)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (segments, ties))
    result = None
    if rank == 0:
        all_segments = [s for segs, _ in gathered for s in segs]
        # the weights several segments use: the same on every rank that built a segment
        found: list[TiedWeight] = next((t for segs, t in gathered if segs), [])
        result = _assemble(spec, structure, all_segments, sizes, stopped, [p2p, *allreduce], nproc=world,
                           precision=options["precision"], device=dev, ties=found, idle=idle)
        result.environment.hosts = sorted(set(hosts))
    dist.barrier()
    return result


def _worker(job_path: str, out_dir: str) -> None:
    """Entry point of one profiling process (``python -m varuna_core.profiling.run JOB DIR``)."""
    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    try:
        options = job["options"]
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        store = dist.distributed_c10d._get_default_store()
        spec = load_spec(job["spec"])

        def step(done: int, total: int, what: str) -> None:
            store.add(f"done/{rank}", 1)

        def on_total(total: int) -> None:
            store.add("total", total)

        result = profile_in_job(spec, options, progress=step, on_total=on_total)
        if result is not None:
            (Path(out_dir) / "profile.json").write_text(result.model_dump_json())
        dist.destroy_process_group()
    except VarunaError as exc:
        Path(out_dir, f"error{rank}.txt").write_text(json.dumps(
            {"message": exc.message, "hint": exc.hint, "config": exc.exit_code == 2,
             "user": isinstance(exc, UserCodeError)}))
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
