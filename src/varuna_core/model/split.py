"""Split a backward into B (the input gradient) and W (the weights' gradients), for zero-bubble schedules.

A forward run under :func:`splitting` builds, for every eligible ``F.linear`` and ``F.embedding`` call, an
autograd node whose backward computes only the gradient of the op's input and queues what the weights' gradients
need (the op's input and its output gradient) in a :class:`WeightGrads`; :meth:`WeightGrads.run` computes those
gradients later and accumulates them. Every other op keeps its whole backward in B. The executor runs::

    F (or R):  with splitting(store_k): out = stage.forward(...)   # one WeightGrads per micro-batch
    B:         torch.autograd.backward(roots, grads)               # input grads, other modules' whole grads
    W:         store_k.run()                                       # the split ops' weight and bias grads

[Note: split backward]

*How the calls are found.* A ``TorchFunctionMode`` sees every torch call of the forward (also ``F.linear(x,
wte.weight)`` in user code, which module hooks would miss). A mode entered inside the block (the stage's
``_PlaceholderWins`` before its incoming cut) sees each call first and passes it on here; calls with ``meta``
tensors are never split. A mode entered outside the block sees the pieces a split call is made of. Nothing is
intercepted while gradients are off (a forward under ``no_grad`` for a later recompute, ``inference_mode``),
outside the block, or for tensor subclasses. The price: one Python call per torch call of the forward (a few µs),
which matters for tiny layers only (``benchmarks/split_cost.py`` measures it).

*Exactness.* Gradients equal an unsplit backward's bit for bit (on this machine's kernels; NaN payloads aside),
because every value is made by the call autograd would make, on the same tensors, with the same layouts:

* The forward runs torch's own op: ``F.linear`` takes ``addmm`` for 2-D input with a bias, a flattened ``addmm``
  for contiguous N-D input with a bias, else ``matmul`` folded to ``mm`` (a reshape; the weight requires
  gradients, so torch always folds) and ``add_`` of the bias. The reshapes, views and the bias add are done
  here with autograd, as torch does them inside ``linear``; only the ``addmm``/``mm`` is the split node.
* B computes the input gradient with torch's ``mm_mat1_backward`` (the column-major case included); W the
  weight's with ``mm_mat2_backward`` and the bias's with ``sum_to`` (what the engine does to a broadcast bias).
  ``F.embedding``'s whole backward is its weight's: W calls ``aten::embedding_backward`` as autograd does
  (``padding_idx`` and ``scale_grad_by_freq`` included).
* Under autocast the op receives what autocast would give it: an input cast with ``.to`` (as autocast casts a
  non-leaf), and for a leaf fp32 weight or bias *autocast's own cached cast*, which all uses of the weight in the
  autocast region share (two linears of one weight sum their bf16 gradients before the cast back, as in the
  unsplit graph). That cast is obtained through an op autocast casts: ``addmm(w, empty, empty, beta=1, alpha=0)``
  for a weight (a copy of the cast, whose backward passes the gradient on unchanged), ``prelu(b, 1)`` for a bias
  (its backward multiplies by one). A leaf fp32 *input* that requires gradients (autocast caches its cast too)
  falls back to the plain op.
* W accumulates through autograd: ``torch.autograd.backward`` over the tensors the ops received (as gradient
  edges, so no weight-sized tensor is kept alive), so autocast's cast back, tensor hooks, post-accumulate hooks
  and ``AccumulateGrad`` behave as in an unsplit backward: an existing ``.grad`` (a view into a flat buffer) is
  added to in place and keeps its identity. Weights that share no leaf share engine runs (up to 32 MiB of
  gradients each: one run per weight would cost tens of µs each, all of them at once the stage's size). The
  contributions of one weight are handed over in the order the split nodes ran in B, which is the order the
  unsplit engine sums them in (each op's transposed-weight node runs right after the op's node, as it does in a
  chain of modules). With one or two contributions per weight (one use; a tied embedding and head) the order
  does not matter; a weight used three or more times in one forward in graph branches that the engine
  interleaves may be summed in another order (last-bit differences).
* Split nodes have no edge to their weight, so in B the weight's ``AccumulateGrad`` does not run at all (no
  hook sees a ``None`` gradient); W runs it once with the full gradient. A hooked linear's bias ([Note: hooked
  linear]) takes its gradient in B.

*A weight used by other ops too.* Per forward (one ``splitting`` block), the first use of a leaf that requires
gradients decides: a split op makes it *deferred*, any other op *direct*. A direct weight's later linear or
embedding calls run unsplit (their gradient arrives in B with the other use's, as without splitting). A
deferred weight given to any other op (under gradients; metadata such as ``.shape`` aside) is replaced there by
an alias whose backward queues that op's contribution for W too, in B's order, so the sum is formed as in the
unsplit backward. Under autocast, an op that autocast runs in low precision (``matmul``, ``mm``, ``conv``…) gets
an alias of the cached cast, so its contribution is summed with the split ones before the cast back, as in the
unsplit graph; an op missing from that list (:data:`_LOW_PRECISION`) would sum in fp32 (last-bit differences).

*Memory.* After B the graph is freed as usual. A :class:`WeightGrads` keeps per split call the op's input (as the
matmul saw it: flattened, cast) and its output gradient, per alias the gradient: :attr:`WeightGrads.nbytes`.
Under autocast a split weight's cast exists twice until the forward leaves autocast (autocast's cached copy and
the stand-in the split node saves, which B frees as the unsplit node frees the cast it saves).

*Backwards.* Only a plain ``backward`` over the graph (no ``inputs=``) defers: ``autograd.grad`` or
``backward(inputs=...)`` through a split node computes the input gradient and queues nothing (a split weight is
then not reachable by such a call: differentiate it without splitting). Each backward's contributions are
accumulated separately, in order, as separate backwards would accumulate them.

[Note: split route] The mode costs every torch call of the forward a Python call (~5 µs here: 0.6 ms of a 3.1 ms
forward of the example GPT, 133 calls) and its bookkeeping more (2 ms in all). It is needed only to see what the
``nn.Linear`` and ``nn.Embedding`` forwards cannot: ``F.linear`` and ``F.embedding`` called from elsewhere, and other
ops given a split weight (aliases, a weight used first by another op, a weight as an input). So the class
attributes ``nn.Linear.forward`` and ``nn.Embedding.forward`` are patched for every block, and a
:class:`SplitRoute` remembers what the first block of a stage's step saw under the mode: if every split call came
from those forwards and nothing needed the mode, the later blocks run without it, the two forwards calling the same
split logic with the same arguments, so they build the same nodes and W sums as under the mode, bit for bit. A
stage's forward that changes between its micro-batches (a data-dependent branch that reaches a weight through
another op) would be split on the module route without that op's alias: still the right gradients, summed in
another order (last bits), with a hook on that weight seeing two parts. The executor makes a new route each step.
The route also keeps each leaf's gradient edge for the step's blocks (finding it makes a view: ~10 µs per weight
and bias of every split call); holding the edge holds the leaf's accumulator, so autograd's own is that same node.

[Note: hooked linear] Under a route (the executor's blocks, whose B is always a plain backward), a split linear
that has a bias taking gradients, an input in the weight's dtype that torch's linear flattens into one ``addmm``
(2-D, or contiguous), and no autocast, is not a node of this module: it is torch's own ``linear`` on the weight
detached, and a pre-hook on the ``addmm``'s node queues the weight's work for W with the gradient that node
receives. So B runs torch's C++ backward for the input and the bias (the bias's gradient is accumulated in B, as
it would be unsplit), and the forward pays a pre-hook (~3 µs) instead of a Python autograd function (~20 µs, and
~10 µs more in B). W computes the weight's gradient exactly as the split node's piece does (the ``addmm``'s
``mm_mat2_backward`` on the flattened input, ``.t()``), so the bits are the same. Why these conditions: the
bias's accumulator is what tells a plain backward (it is in the graph) from one that wants only inputs (it is
not executed), so nothing is queued there, as for the split node; the hook sits on the ``addmm``'s node and not
on the output's, because an in-place change of an N-D output (a view) replaces the view's node but not the
``addmm``'s, and because a node's pre-hooks run after the tensor hooks on its output, so W sees the gradient
those hooks gave the op. A linear without a bias (a witness would cost an extra node) and every other case
keep the split node.

*Who must run W.* Until :meth:`WeightGrads.run`, the split weights' ``.grad`` lack this micro-batch's part. The
executor runs every micro-batch's W action (the schedule validator checks that each B has its W after it) before
the gradients are reduced and the optimizer steps; ``run()`` on an empty or already run store does nothing. A
store dropped with work in it logs a warning (its gradients are lost). Runs in an order other than B's sum each
micro-batch's part exactly, but add the parts to ``.grad`` in W's order (as an unsplit run of the micro-batches
in that order would); in B's order the result equals the unsplit one bit for bit.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..errors import ConfigError, InternalError

__all__ = ["SplitRoute", "WeightGrads", "splitting"]

log = logging.getLogger(__name__)

_LINEAR = torch._C._nn.linear  # what F.linear is
_EMBEDDING = F.embedding
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)  # tensor subclasses (DTensor, fakes, ...) are never split
_SPLIT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# Calls that read a tensor's metadata, detach it or make a new tensor like it: not a use gradients flow through
# (the stage's placeholder watch makes ``empty_like`` copies of real tensors on meta, for instance).
_METADATA_FUNCS: frozenset = frozenset(
    [getattr(torch.Tensor, name) for name in (
        "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
        "is_floating_point", "is_complex", "element_size", "data_ptr", "untyped_storage", "get_device",
        "detach", "__len__", "__hash__", "__format__", "__repr__", "__bool__", "new_empty", "new_zeros",
        "new_ones", "new_full", "new_tensor",
    ) if hasattr(torch.Tensor, name)]
    + [torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like])
_METADATA_PROPS: frozenset = frozenset(
    getattr(torch._C.TensorBase, name).__get__ for name in (
        "shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad", "grad_fn", "data", "ndim",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "_version",
        "output_nr", "itemsize", "nbytes", "_base",
    ) if hasattr(torch._C.TensorBase, name))

# Calls that autocast runs in low precision (casting a leaf fp32 weight through its cache): a deferred weight
# given to one of them is replaced by an alias of the cached cast ([Note: split backward]).
_LOW_PRECISION: frozenset = frozenset(
    f for f in (
        _LINEAR, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
        torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm,
        torch.baddbmm, torch.Tensor.baddbmm, torch.addbmm, torch.Tensor.addbmm, torch.linalg.vecdot,
        torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
        torch.conv_transpose3d, torch.conv_tbc, torch.prelu, F.prelu, F.scaled_dot_product_attention,
    ))

_DEFERRED, _DIRECT = "deferred", "direct"
_BATCH_BYTES = 32 << 20  # W hands autograd the gradients of several weights at once, up to this many bytes


def _will_execute(node: Any) -> bool:
    """Whether the running backward executes ``node`` (``True`` for a plain ``backward`` over the graph)."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    return True if check is None else bool(check(node))


def _graph_task() -> int:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


# ----------------------------------------------------------------------------------------------------------
# What W runs


class _Work(abc.ABC):
    """One deferred piece of W: the gradients it hands to autograd, and the tensors it keeps until then."""

    kind = "call"

    def __init__(self, task: int, keys: tuple[int, ...], kept: tuple[torch.Tensor, ...]) -> None:
        self.task = task  # the backward (graph task) that queued it
        self.keys = keys  # ids of the leaves its gradients end in (pieces sharing one are accumulated together)
        self.kept = kept
        self.versions = tuple(t._version for t in kept)

    def check(self) -> None:
        """Refuse a kept tensor changed in place since B (W would compute from other values than the unsplit
        backward did)."""
        for tensor, version in zip(self.kept, self.versions, strict=True):
            if tensor._version != version:
                raise InternalError(f"a tensor kept for the weight gradients of a split {self.kind} (shape "
                                    f"{list(tensor.shape)}) was modified in place between B and W")

    @abc.abstractmethod
    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        """``(where the gradient goes, the gradient)`` pairs W hands to autograd, in B's order."""


class _LinearWork(_Work):
    kind = "linear"

    def __init__(self, task: int, site: _LinearSite, x: torch.Tensor, grad: torch.Tensor) -> None:
        super().__init__(task, site.keys, (x, grad))  # the matmul's input (2-D, cast) and output gradient
        self.site = site.work_view()

    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        (x, grad), site = self.kept, self.site
        out = [(site.weight, _mat2_grad(grad, x, site.weight_t_col_major).t())]  # TBackward: .t()
        if site.bias is not None:  # addmm's gradient of its bias, reduced to it as the engine reduces it
            assert site.bias_shape is not None
            out.append((site.bias, grad.sum_to_size(site.bias_shape)))
        return out


class _HookedLinearWork(_Work):
    kind = "linear"

    def __init__(self, task: int, hook: _LinearHook, grad: torch.Tensor) -> None:
        super().__init__(task, hook.keys, (hook.x, grad))  # the linear's input and output gradient, as given
        self.weight, self.weight_t_col_major = hook.weight, hook.weight_t_col_major

    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        x, grad = self.kept  # grad: the addmm's output gradient (2-D)
        if x.dim() != 2:  # _flatten_nd_linear's reshape of the input
            x = x.reshape(-1, x.size(-1))
        return [(self.weight, _mat2_grad(grad, x, self.weight_t_col_major).t())]  # TBackward: .t()


class _EmbeddingWork(_Work):
    kind = "embedding"

    def __init__(self, task: int, site: _EmbeddingSite, indices: torch.Tensor, grad: torch.Tensor) -> None:
        super().__init__(task, (site.key,), (indices, grad))
        self.site = site.work_view()

    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        (indices, grad), site = self.kept, self.site
        weight_grad = torch.ops.aten.embedding_backward(grad, indices, site.num_weights, site.padding_idx,
                                                        site.scale_grad_by_freq, False)
        return [(site.weight, weight_grad)]


class _AliasWork(_Work):
    kind = "use of a deferred weight"

    def __init__(self, task: int, key: int, target: GradientEdge, grad: torch.Tensor) -> None:
        super().__init__(task, (key,), (grad,))  # what another op gave a deferred weight, in B
        self.target = target

    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        return [(self.target, self.kept[0])]


def _mat1_grad(grad: torch.Tensor, mat2: torch.Tensor, mat1_col_major: bool) -> torch.Tensor:
    """torch's ``mm_mat1_backward`` (strided, alpha 1): the gradient of ``mat1`` in ``mat1 @ mat2``."""
    return mat2.mm(grad.t()).t() if mat1_col_major else grad.mm(mat2.t())


def _mat2_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2_col_major: bool) -> torch.Tensor:
    """torch's ``mm_mat2_backward`` (strided, alpha 1): the gradient of ``mat2`` in ``mat1 @ mat2``."""
    return grad.t().mm(mat1).t() if mat2_col_major else mat1.t().mm(grad)


def _col_major(t: torch.Tensor) -> bool:
    """The test mm's backward makes on a matrix's strides ("if input was column-major")."""
    return t.stride(0) == 1 and t.stride(1) == t.size(0)


class WeightGrads:
    """The weight-gradient work that one micro-batch's backward deferred: what its W action runs.

    Filled during B by the nodes a forward under :func:`splitting` built; see [Note: split backward] for what is
    kept, the order of accumulation and who must call :meth:`run`.
    """

    def __init__(self) -> None:
        self._work: list[_Work] = []

    def __len__(self) -> int:
        """Deferred entries (one per split call, or per other use of a deferred weight, that B reached)."""
        return len(self._work)

    def __repr__(self) -> str:
        return f"WeightGrads({len(self)} entries, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Bytes the entries keep alive: the saved inputs and output gradients, each storage counted once (a view
        keeps its whole storage)."""
        storages: dict[tuple[torch.device, int], int] = {}
        for work in self._work:
            for tensor in work.kept:
                storage = tensor.untyped_storage()
                storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
        return sum(storages.values())

    def leaf_ids(self) -> frozenset[int]:
        """``id`` of every leaf (parameter) :meth:`run` will accumulate a gradient into: until it runs, their
        ``.grad`` lack this micro-batch's part (no other leaf's ``.grad`` changes in :meth:`run`)."""
        return frozenset(key for work in self._work for key in work.keys)

    def run(self) -> None:
        """Compute every deferred weight and bias gradient and accumulate it into the parameters exactly as the
        unsplit backward would have; then drop the entries. A second call (or one on an empty store) does
        nothing. If a hook raises, the entries are gone all the same (nothing is accumulated twice)."""
        work, self._work = self._work, []
        if not work:
            return
        for piece in work:
            piece.check()
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        size, task = 0, None
        with _autocast_off(work):
            for group in _groups(work):  # per backward of B, the pieces ending in the same leaves together
                with torch.no_grad():
                    pairs = [pair for piece in group for pair in piece.gradients()]
                for piece in group:
                    piece.kept = ()  # computed from: its memory goes as W proceeds
                added = sum(g.numel() * g.element_size() for _, g in pairs)
                if edges and (group[0].task != task or size + added > _BATCH_BYTES):
                    _accumulate(edges, grads)  # groups touch disjoint leaves: they share engine runs
                    edges, grads, size = [], [], 0
                edges += [edge for edge, _ in pairs]
                grads += [grad for _, grad in pairs]
                size, task = size + added, group[0].task
                del pairs
            if edges:
                _accumulate(edges, grads)

    def _add(self, work: _Work) -> None:
        self._work.append(work)

    def __del__(self) -> None:
        try:
            if self._work:
                log.warning("a WeightGrads was dropped with %d deferred entries and no run(): the weight gradients "
                            "of that micro-batch are lost", len(self._work))
        except Exception:  # noqa: BLE001 - interpreter shutdown: logging may be gone already
            pass


def _groups(work: list[_Work]) -> list[list[_Work]]:
    """``work`` cut into groups that W hands to autograd whole: per backward of B (in order), the pieces whose
    gradients end in the same leaves (joined transitively), each group in B's order. Different groups of one
    backward touch disjoint leaves, so they may share an engine run in any order."""
    parent: dict[int, int] = {}

    def find(key: int) -> int:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for piece in work:
        first = piece.keys[0]
        for key in piece.keys[1:]:
            parent[find(key)] = find(first)
    groups: dict[tuple[int, int], list[_Work]] = {}
    for piece in work:
        groups.setdefault((piece.task, find(piece.keys[0])), []).append(piece)
    return list(groups.values())


def _accumulate(edges: list[GradientEdge], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(edges, grads)`` without its Python checks of each gradient against its edge
    (~6 µs a gradient; W made each one with its edge's shape and dtype): the engine run it ends in."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None or torch._C._are_functorch_transforms_active():
        torch.autograd.backward(edges, grads)
        return
    run(tuple(edges), tuple(grads), False, False, (), True, True)  # keep_graph, create_graph, inputs, ...


def _autocast_off(work: Sequence[_Work]) -> contextlib.AbstractContextManager:
    """W's matmuls run in the dtypes B saved, whatever autocast region ``run()`` is called in."""
    devices = {t.device.type for piece in work for t in piece.kept}
    stack = contextlib.ExitStack()
    for device in devices:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


# ----------------------------------------------------------------------------------------------------------
# The forward side: one region per `splitting` block


class _Region:
    """One :func:`splitting` block: its store, the state of each leaf it saw, and the anchor that makes split
    nodes require gradients (they have no edge to their weights) and tells a plain backward from a partial one."""

    def __init__(self, store: WeightGrads, leaf_edges: dict[int, tuple[torch.Tensor, GradientEdge]] | None = None
                 ) -> None:
        self.store = store
        # the route's cache of leaves' gradient edges, shared by the step's blocks ([Note: split route])
        self.leaf_edges = leaf_edges
        self.routed = leaf_edges is not None  # the executor's blocks: B is a plain backward ([Note: hooked linear])
        self.state: dict[int, str] = {}  # id(leaf) -> _DEFERRED or _DIRECT
        self.kept: dict[int, torch.Tensor] = {}  # the leaves of `state`, alive while the ids are used
        self.casts: dict[int, tuple[torch.Tensor, Any]] = {}  # id(leaf) -> (cached-cast stand-in, autocast's node)
        self.edges: dict[int, tuple[torch.Tensor, GradientEdge]] = {}  # id(t) -> (t, its gradient edge)
        self.anchor = torch.empty(0, requires_grad=True)
        self.anchor_node = get_gradient_edge(self.anchor).node
        # What the module path must reproduce ([Note: split route]): split calls made by nn.Linear/nn.Embedding
        # forwards, split calls made elsewhere, and the decisions that needed the mode's view of every call.
        self.splitter: _SplitMode | None = None  # the calls' logic (also on the module route, where no mode runs)
        self.mode: _SplitMode | None = None  # the mode, when this block runs under it
        self.in_module = 0  # > 0 while an nn.Linear or nn.Embedding forward runs (the mode route counts them)
        self.module_splits = 0
        self.other_splits = 0
        self.needs_mode = False

    def count_split(self) -> None:
        if self.in_module:
            self.module_splits += 1
        else:
            self.other_splits += 1

    def mark(self, leaf: torch.Tensor, state: str) -> str:
        """The leaf's state, set to ``state`` if it has none yet."""
        key = id(leaf)
        current = self.state.get(key)
        if current is None:
            self.state[key] = current = state
            self.kept[key] = leaf
        return current

    def edge(self, t: torch.Tensor) -> GradientEdge:
        """``get_gradient_edge(t)``, once per tensor of the block (for a leaf it makes a view to find the
        accumulator: µs that every linear call would pay); a leaf's once per step, where the route keeps them
        (the edge holds the leaf's accumulator, so autograd accumulates through that same node meanwhile)."""
        key = id(t)
        cache = self.leaf_edges if self.leaf_edges is not None and t.is_leaf else self.edges
        known = cache.get(key)
        if known is None or known[0] is not t:
            known = cache[key] = (t, get_gradient_edge(t))
        return known[1]

    def deferring(self) -> bool:
        """In a split node's backward: whether this backward is one that W completes (a plain one)."""
        return _will_execute(self.anchor_node)

    def cast(self, leaf: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A stand-in for autocast's cached cast of ``leaf`` (``make`` reaches it through an op autocast casts):
        one per cast, so that the uses of one cast hand their gradients to one node, in B's order."""
        fresh = make(leaf)
        node = fresh.grad_fn.next_functions[0][0] if fresh.grad_fn is not None else None
        known = self.casts.get(id(leaf))
        if known is not None and node is not None and known[1] is node:
            return known[0]
        self.casts[id(leaf)] = (fresh, node)
        self.kept[id(leaf)] = leaf
        return fresh


def _cached_weight_cast(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through autocast's cache: an ``addmm`` of no products copies the cast (its backward returns the
    gradient unchanged: beta is 1)."""
    rows, cols = weight.shape
    empty_a = torch.empty((rows, 0), dtype=weight.dtype, device=weight.device)
    empty_b = torch.empty((0, cols), dtype=weight.dtype, device=weight.device)
    return torch.addmm(weight, empty_a, empty_b, beta=1, alpha=0)


def _cached_vector_cast(vector: torch.Tensor) -> torch.Tensor:
    """A 1-D leaf through autocast's cache: ``prelu`` with slope one (its backward multiplies by one)."""
    return torch.prelu(vector, torch.ones(1, dtype=vector.dtype, device=vector.device))


def _cache_eligible(t: torch.Tensor) -> bool:
    """Whether autocast casts ``t`` through its cache (``cached_cast`` in torch's autocast_mode.cpp)."""
    return (t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
            and torch.is_autocast_cache_enabled())


def _autocast_target(device: torch.device) -> torch.dtype | None:
    """The low-precision dtype autocast casts to on ``device`` now, or None when it is off there."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return torch.get_autocast_dtype(kind)
    except RuntimeError:  # a device type autocast does not know
        return None


def _needs_cast(t: torch.Tensor, target: torch.dtype) -> bool:
    return t.is_floating_point() and t.dtype not in (torch.float64, target)


class _SplitMatmul(torch.autograd.Function):
    """``addmm(bias, x, weight.t())`` or ``mm(x, weight.t())`` whose backward computes the input's (and a
    non-deferred bias's) gradient and queues the weight's (and a deferred bias's) for W. ``weight_t`` and a
    deferred ``bias`` come detached: the node has no edge to them."""

    @staticmethod
    def forward(ctx: Any, site: _LinearSite, anchor: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.site = site
        ctx.x_col_major = _col_major(x)
        ctx.save_for_backward(x, weight_t)
        ctx.set_materialize_grads(False)
        return torch.addmm(bias, x, weight_t) if bias is not None else torch.mm(x, weight_t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if grad is None:
            return None, None, None, None, None
        x, weight_t = ctx.saved_tensors
        site: _LinearSite = ctx.site
        grad_x = _mat1_grad(grad, weight_t, ctx.x_col_major) if ctx.needs_input_grad[2] else None
        grad_bias = grad if ctx.needs_input_grad[4] else None  # a bias not deferred: the engine reduces it
        region = site.region
        assert region is not None
        if region.deferring():
            region.store._add(_LinearWork(_graph_task(), site, x.detach(), grad))
        return None, None, grad_x, None, grad_bias


class _SplitEmbedding(torch.autograd.Function):
    """``embedding(weight, indices, ...)`` whose backward (all of it the weight's) is queued for W."""

    @staticmethod
    def forward(ctx: Any, site: _EmbeddingSite, anchor: torch.Tensor, weight: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        ctx.site = site
        ctx.save_for_backward(indices)
        ctx.set_materialize_grads(False)
        return torch.embedding(weight, indices, site.padding_idx, site.scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, ...]:
        site: _EmbeddingSite = ctx.site
        region = site.region
        assert region is not None
        if grad is not None and region.deferring():
            (indices,) = ctx.saved_tensors
            region.store._add(_EmbeddingWork(_graph_task(), site, indices.detach(), grad))
        return None, None, None, None


class _Alias(torch.autograd.Function):
    """A deferred weight as another op sees it: the same values, and a backward that queues the op's
    contribution for W (``value`` comes detached: the node has no edge to the weight)."""

    @staticmethod
    def forward(ctx: Any, site: _AliasSite, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.site = site
        ctx.set_materialize_grads(False)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, ...]:
        site: _AliasSite = ctx.site
        if grad is not None and site.region.deferring():
            site.region.store._add(_AliasWork(_graph_task(), site.key, site.target, grad))
        return None, None, None


@dataclasses.dataclass(eq=False)
class _LinearSite:
    """A split ``F.linear`` call, as its node and its W piece know it."""

    region: _Region | None
    keys: tuple[int, ...]
    weight: GradientEdge  # where the weight's gradient goes (the leaf, or autocast's cast of it)
    weight_t_col_major: bool  # mm_mat2_backward's test on mat2 = weight.t()
    bias: GradientEdge | None  # where a deferred bias's gradient goes
    bias_shape: torch.Size | None

    def work_view(self) -> _LinearSite:
        """The site without its region (W must not keep the forward's leaves and casts alive)."""
        return _LinearSite(None, self.keys, self.weight, self.weight_t_col_major, self.bias, self.bias_shape)


class _LinearHook:
    """A hooked linear's pre-hook on its ``addmm`` node ([Note: hooked linear]): in a plain backward it queues
    the weight's gradient work, with the gradient the node receives, for W."""

    __slots__ = ("bias_node", "keys", "region", "weight", "weight_t_col_major", "x")

    def __init__(self, region: _Region, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.region = region
        self.x = x  # the linear's input, as given (W flattens it as the op did)
        self.keys = (id(weight),)
        self.weight = region.edge(weight)
        # mm_mat2_backward's test on mat2 = weight.t() (_col_major), read off the weight's strides without a view
        self.weight_t_col_major = weight.stride(1) == 1 and weight.stride(0) == weight.size(1)
        self.bias_node = region.edge(bias).node

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        grad = grad_outputs[0]
        # the bias's accumulator runs in a plain backward (it is in the graph) and in none that wants only inputs
        if grad is not None and _will_execute(self.bias_node):
            self.region.store._add(_HookedLinearWork(_graph_task(), self, grad))


@dataclasses.dataclass(eq=False)
class _EmbeddingSite:
    """A split ``F.embedding`` call."""

    region: _Region | None
    key: int
    weight: GradientEdge
    num_weights: int
    padding_idx: int
    scale_grad_by_freq: bool

    def work_view(self) -> _EmbeddingSite:
        return _EmbeddingSite(None, self.key, self.weight, self.num_weights, self.padding_idx, self.scale_grad_by_freq)


@dataclasses.dataclass(eq=False)
class _AliasSite:
    """A deferred weight handed to another op."""

    region: _Region
    key: int
    target: GradientEdge


_PLAIN = object()  # "run the call unsplit"


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list | None:
    """Positional and keyword arguments as one list in ``names`` order (None if they do not fit)."""
    if len(args) > len(names):
        return None
    values = list(args) + list(defaults[len(args):])
    for key, value in kwargs.items():
        if key not in names or names.index(key) < len(args):
            return None
        values[names.index(key)] = value
    return values


def _is_plain(t: Any) -> bool:
    return type(t) in _PLAIN_TYPES and t.layout == torch.strided and not t.is_meta


class _SplitMode(TorchFunctionMode):
    """The mode of a :func:`splitting` block."""

    def __init__(self, region: _Region) -> None:
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if func is _LINEAR:
            out = self._linear(args, kwargs)
            if out is not _PLAIN:
                return out
        elif func is _EMBEDDING:
            out = self._embedding(args, kwargs)
            if out is not _PLAIN:
                return out
        return self._other(func, args, kwargs)

    # -- any other call, and a split call that runs plain ------------------------------------------------------

    def _other(self, func, args: tuple, kwargs: dict):
        leaves = _grad_leaves(args, kwargs)
        if leaves is None or func in _METADATA_FUNCS or func in _METADATA_PROPS:
            return func(*args, **kwargs)
        region = self.region
        deferred = {id(t) for t in leaves if region.mark(t, _DIRECT) == _DEFERRED}
        if not deferred:
            return func(*args, **kwargs)
        low_precision = func in _LOW_PRECISION
        aliases: dict[int, torch.Tensor] = {}

        def alias(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if id(value) not in deferred:
                    return value
                if id(value) not in aliases:
                    aliases[id(value)] = self._alias(value, self._as_autocast_gives(value, low_precision))
                return aliases[id(value)]
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and id(v) in deferred
                                                        for v in value):
                return type(value)([alias(v) for v in value])
            return value

        return func(*tuple(alias(a) for a in args), **{k: alias(v) for k, v in kwargs.items()})

    def _as_autocast_gives(self, leaf: torch.Tensor, low_precision: bool) -> torch.Tensor:
        """What a call gets for ``leaf``: under autocast, a call that autocast runs in low precision gets its
        cached cast (the stand-in of :meth:`_Region.cast`), so its gradient joins the split ones' before the
        cast back; any other call gets the leaf itself."""
        target = _autocast_target(leaf.device) if low_precision else None
        if target is None or not _needs_cast(leaf, target) or not _cache_eligible(leaf) or leaf.dim() not in (1, 2):
            return leaf
        cast = self.region.cast(leaf, _cached_weight_cast if leaf.dim() == 2 else _cached_vector_cast)
        return cast if cast.dtype == target else leaf

    def _alias(self, leaf: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``source`` (``leaf``, deferred, or what autocast made of it) as an alias whose backward queues the
        gradient it receives for W, to ``source``'s gradient edge."""
        self.region.needs_mode = True
        site = _AliasSite(self.region, id(leaf), self.region.edge(source))
        return _Alias.apply(site, self.region.anchor, source.detach())

    # -- F.linear ------------------------------------------------------------------------------------------

    def _linear(self, args: tuple, kwargs: dict) -> Any:
        if len(args) == 3 and not kwargs:  # as nn.Linear calls it
            x, weight, bias = args
        else:
            bound = _bind(args, kwargs, ("input", "weight", "bias"), (None, None, None))
            if bound is None:
                return _PLAIN
            x, weight, bias = bound
        if not (_is_plain(x) and _is_plain(weight) and (bias is None or _is_plain(bias))):
            return _PLAIN
        if not (weight.is_leaf and weight.requires_grad and weight.dim() == 2 and weight.dtype in _SPLIT_DTYPES
                and x.dim() >= 2 and x.numel() > 0 and x.is_floating_point()):
            return _PLAIN
        if x is weight or bias is weight or (bias is not None and (x is bias or bias.dim() != 1)):
            return _PLAIN
        device = weight.device
        if x.device != device or (bias is not None and bias.device != device):
            return _PLAIN
        if x.size(-1) != weight.size(1) or (bias is not None and bias.size(0) != weight.size(0)):
            return _PLAIN  # the plain op raises its own error
        region = self.region
        if x.requires_grad and x.is_leaf and region.state.get(id(x)) == _DEFERRED:
            region.needs_mode = True
            return _PLAIN  # a deferred weight as an input: the plain call gets its alias
        if region.state.get(id(weight)) == _DIRECT:
            region.needs_mode = True
            return _PLAIN  # used by another op first: its gradients arrive in B together, as without splitting
        x_c, weight_c, bias_c = x, weight, bias
        target = _autocast_target(device)
        if target is None and region.routed and _hookable(region, x, weight, bias):
            return self._hooked_linear(x, weight, bias)
        if target is not None:  # what autocast hands aten's linear
            if _needs_cast(x, target):
                if _cache_eligible(x):
                    return _PLAIN  # autocast's cached cast of an input cannot be reached here
                x_c = x.to(target)
            if _needs_cast(weight, target):
                weight_c = region.cast(weight, _cached_weight_cast) if _cache_eligible(weight) else weight.to(target)
            if bias is not None and _needs_cast(bias, target):
                bias_c = region.cast(bias, _cached_vector_cast) if _cache_eligible(bias) else bias.to(target)
        if x_c.dtype != weight_c.dtype or (bias_c is not None and bias_c.dtype != weight_c.dtype):
            return _PLAIN
        region.mark(weight, _DEFERRED)
        if x.requires_grad and x.is_leaf:
            region.mark(x, _DIRECT)
        region.count_split()
        # aten's linear: addmm for 2-D input with a bias, a flattened addmm for contiguous N-D input with a bias,
        # else matmul (folded to mm: the weight requires gradients) and add_ of the bias
        fused = bias is not None and (x_c.dim() == 2 or x_c.is_contiguous())
        bias_deferred = False
        core_bias = None
        if bias_c is not None:
            assert bias is not None
            leaf_bias = bias.requires_grad and bias.is_leaf
            state = region.mark(bias, _DEFERRED if fused else _DIRECT) if leaf_bias else None
            if fused:
                bias_deferred = state == _DEFERRED
                core_bias = bias_c.detach() if bias_deferred else bias_c
            elif state == _DEFERRED:  # added outside the split node: through an alias, like any other use
                bias_c = self._alias(bias, bias_c)
        weight_t = weight_c.detach().t()
        site = _LinearSite(region, (id(weight), id(bias)) if bias_deferred else (id(weight),),
                           region.edge(weight_c), _col_major(weight_t),
                           region.edge(bias_c) if bias_deferred else None,
                           bias.shape if bias_deferred and bias is not None else None)
        if x_c.dim() == 2:  # addmm(bias, input, weight.t()) or mm(input, weight.t())
            return _SplitMatmul.apply(site, region.anchor, x_c, weight_t, core_bias)
        lead = x_c.shape[:-1]
        rows = 1
        for size in lead:
            rows *= size
        x2 = x_c.reshape(rows, x_c.size(-1))
        out = _SplitMatmul.apply(site, region.anchor, x2, weight_t, core_bias)
        if fused:  # _flatten_nd_linear
            return out.view(*lead, out.size(1))
        out = torch.ops.aten._unsafe_view(out, [*lead, out.size(1)])  # matmul's fold
        if bias_c is not None:
            out.add_(bias_c)
        return out

    def _hooked_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """torch's own linear with the weight detached, and a pre-hook that hands W the output's gradient
        ([Note: hooked linear])."""
        region = self.region
        region.mark(weight, _DEFERRED)
        if x.requires_grad and x.is_leaf:
            region.mark(x, _DIRECT)
        region.mark(bias, _DIRECT)
        region.count_split()
        out = _LINEAR(x, weight.detach(), bias)
        # the addmm's node: the output's own (2-D input) or, N-D, the one behind the view of its result (which an
        # in-place change of the view replaces, not the addmm's); its pre-hook runs after the output's hooks
        node = out.grad_fn
        if node is not None and x.dim() != 2:
            node = node.next_functions[0][0]
        if node is None or node.name() != "AddmmBackward0":
            raise InternalError(f"torch's linear of a {x.dim()}-D contiguous input with a bias made "
                                f"{node.name() if node is not None else None}, not an addmm")
        node.register_prehook(_LinearHook(region, x, weight, bias))
        return out

    # -- F.embedding ---------------------------------------------------------------------------------------

    def _embedding(self, args: tuple, kwargs: dict) -> Any:
        bound = _bind(args, kwargs, ("input", "weight", "padding_idx", "max_norm", "norm_type",
                                     "scale_grad_by_freq", "sparse"), (None, None, None, None, 2.0, False, False))
        if bound is None:
            return _PLAIN
        indices, weight, padding_idx, max_norm, _, scale_grad_by_freq, sparse = bound
        if max_norm is not None or sparse or not (_is_plain(indices) and _is_plain(weight)):
            return _PLAIN  # max_norm renormalises the weight in place; sparse gradients are not split
        if not (weight.is_leaf and weight.requires_grad and weight.dim() == 2 and weight.dtype in _SPLIT_DTYPES
                and indices.dtype in (torch.int64, torch.int32) and indices.device == weight.device):
            return _PLAIN
        rows = weight.size(0)
        if padding_idx is None:
            padding_idx = -1
        elif not -rows <= padding_idx < rows:
            return _PLAIN  # F.embedding raises its own error
        elif padding_idx < 0:
            padding_idx += rows
        if self.region.mark(weight, _DEFERRED) != _DEFERRED:
            self.region.needs_mode = True
            return _PLAIN
        self.region.count_split()
        site = _EmbeddingSite(self.region, id(weight), self.region.edge(weight), rows, int(padding_idx),
                              bool(scale_grad_by_freq))
        return _SplitEmbedding.apply(site, self.region.anchor, weight.detach(), indices)


def _hookable(region: _Region, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a split linear may take the hooked form ([Note: hooked linear]): torch's fused path (a bias, and a
    2-D or contiguous input: one ``addmm``), a bias that is a leaf taking gradients in B (its accumulator tells a
    plain backward), one dtype."""
    return (bias is not None and bias.is_leaf and bias.requires_grad and region.state.get(id(bias)) != _DEFERRED
            and x.dtype == weight.dtype == bias.dtype and (x.dim() == 2 or x.is_contiguous()))


def _grad_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The leaves that require gradients among the arguments, also inside lists and tuples (None: none). Called
    for every torch call of the forward: kept cheap."""
    found = None
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value.is_leaf:
                found = [value] if found is None else [*found, value]
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and item.requires_grad and item.is_leaf:
                    found = [item] if found is None else [*found, item]
    return found


class SplitRoute:
    """How the forwards of one stage are split ([Note: split route]): the first block under the mode, which sees
    every torch call; the later ones through the ``nn.Linear`` and ``nn.Embedding`` forwards alone, when the first
    showed that the mode's view of the other calls changed nothing. One per stage and step (the executor makes a
    new one each step, so each step checks again)."""

    def __init__(self) -> None:
        self.modules_only: bool | None = None  # None: not known yet (the next block runs under the mode)
        self.leaf_edges: dict[int, tuple[torch.Tensor, GradientEdge]] = {}  # id(leaf) -> (leaf, its edge)

    def __repr__(self) -> str:
        state = {None: "unknown", True: "modules", False: "mode"}[self.modules_only]
        return f"SplitRoute({state})"


_ACTIVE: list[_Region] = []  # the region of the running splitting() block (blocks do not nest)


def _module_forward(original: Callable, split: Callable[[_SplitMode, Any, torch.Tensor], Any]) -> Callable:
    """``original`` (``nn.Linear.forward`` or ``nn.Embedding.forward``) while a :func:`splitting` block runs: on
    the module route the split call (or the plain one where ``split`` declines), under the mode the plain call,
    counted as coming from the module ([Note: split route])."""

    def forward(module: Any, input: torch.Tensor) -> torch.Tensor:
        region = _ACTIVE[-1] if _ACTIVE else None
        if region is None:  # another thread's call while a block runs
            return original(module, input)
        if region.mode is not None or not torch.is_grad_enabled():
            region.in_module += 1
            try:
                return original(module, input)
            finally:
                region.in_module -= 1
        assert region.splitter is not None
        out = split(region.splitter, module, input)
        return original(module, input) if out is _PLAIN else out

    return forward


_ORIGINAL_LINEAR_FORWARD = nn.Linear.forward
_ORIGINAL_EMBEDDING_FORWARD = nn.Embedding.forward
_linear_forward = _module_forward(
    _ORIGINAL_LINEAR_FORWARD, lambda splitter, m, x: splitter._linear((x, m.weight, m.bias), {}))
_embedding_forward = _module_forward(
    _ORIGINAL_EMBEDDING_FORWARD, lambda splitter, m, x: splitter._embedding(
        (x, m.weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse), {}))


@contextlib.contextmanager
def _modules_patched() -> Iterator[None]:
    """``nn.Linear`` and ``nn.Embedding`` (the classes, not their subclasses' overrides) forward through the
    running region for the block."""
    nn.Linear.forward = _linear_forward  # type: ignore[method-assign]
    nn.Embedding.forward = _embedding_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.forward = _ORIGINAL_LINEAR_FORWARD  # type: ignore[method-assign]
        nn.Embedding.forward = _ORIGINAL_EMBEDDING_FORWARD  # type: ignore[method-assign]


@contextlib.contextmanager
def splitting(into: WeightGrads, route: SplitRoute | None = None) -> Iterator[None]:
    """Run a forward WITH autograd under this: every eligible op builds a node whose backward computes only the
    input gradient and appends its weight-gradient work to ``into`` (so one :class:`WeightGrads` per
    micro-batch). See [Note: split backward]. ``route``: the stage's :class:`SplitRoute`, so that its later
    blocks may skip the mode ([Note: split route]); without one every block runs under the mode.

    Raises:
        ConfigError: ``into`` is not a :class:`WeightGrads`, or the block is nested in another ``splitting``.
    """
    if not isinstance(into, WeightGrads):
        raise ConfigError(f"splitting() takes a WeightGrads, got {type(into).__name__}")
    if _ACTIVE or any(isinstance(mode, _SplitMode) for mode in _get_current_function_mode_stack()):
        raise ConfigError("splitting() blocks do not nest",
                          hint="run each micro-batch's forward under one splitting(store) of its own")
    region = _Region(into, route.leaf_edges if route is not None else None)
    region.splitter = _SplitMode(region)
    modules_only = route is not None and route.modules_only is True
    region.mode = None if modules_only else region.splitter
    _ACTIVE.append(region)
    try:
        with _modules_patched(), (contextlib.nullcontext() if modules_only else region.splitter):
            yield
    finally:
        _ACTIVE.pop()
        region.splitter = region.mode = None  # the two refer to each other: no cycle keeps the store alive
    if route is not None and route.modules_only is None:
        route.modules_only = not region.needs_mode and not region.other_splits
