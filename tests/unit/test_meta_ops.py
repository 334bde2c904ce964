"""The memo of ops on placeholders ([Note: meta op memo]) and the walk that finds where an op's tensors are: a
memoised result is exactly what the op returns (shape, strides, dtype), fresh each time, and what a fresh tensor
could not be (an in-place result, a view, autograd history) is never memoised."""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.nn.functional as F

from varuna_core.model.meta_ops import MetaResults, has_meta, tensor_devices


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_meta and b.is_meta and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.requires_grad == b.requires_grad)


# -- where the tensors are ----------------------------------------------------------------------------------


def test_tensor_devices_walks_nested_and_registered_containers():
    m, r = meta(2), torch.zeros(2)
    Pair = collections.namedtuple("Pair", "a b")
    assert tensor_devices((m, 1), {}) == (True, False)
    assert tensor_devices((r,), {"x": None}) == (False, True)
    assert tensor_devices(([1, (m,)],), {"k": {"deep": [r]}}) == (True, True)
    assert tensor_devices((Pair(1, m),), {}) == (True, False)
    assert tensor_devices((collections.OrderedDict(a=r),), {}) == (False, True)
    assert tensor_devices((collections.deque([m]),), {}) == (True, False)  # a registered container, not a list
    assert tensor_devices(("text", 3.0, torch.float32, None), {}) == (False, False)
    assert has_meta((), {"x": [m]}) and not has_meta((r,), {})


# -- memoised results equal the op's ------------------------------------------------------------------------


CASES = {
    "broadcast add": (torch.add, lambda: (meta(4, 8, 8), meta(8, 8)), {}),
    "mul by a python float": (torch.mul, lambda: (meta(3, 5), 0.5), {}),
    "gelu": (F.gelu, lambda: (meta(2, 3, 16),), {"approximate": "tanh"}),
    "layer_norm": (F.layer_norm, lambda: (meta(2, 3, 16), (16,)), {}),
    "softmax": (torch.softmax, lambda: (meta(2, 7),), {"dim": -1}),
    "matmul": (torch.matmul, lambda: (meta(2, 3, 4), meta(4, 5)), {}),
    "non-contiguous input": (torch.neg, lambda: (meta(4, 6).t(),), {}),
    "cat of a list": (torch.cat, lambda: ([meta(2, 3), meta(4, 3)],), {"dim": 0}),
    "integer promotion": (torch.add, lambda: (meta(3, dtype=torch.int64), 1.5), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_memoised_result_is_what_the_op_returns_and_fresh_each_time(name):
    func, make_args, kwargs = CASES[name]
    results = MetaResults()
    expected = func(*make_args(), **kwargs)
    first = results.call(func, make_args(), dict(kwargs))
    assert results.hits == 0 and len(results) == 1
    second = results.call(func, make_args(), dict(kwargs))
    third = results.call(func, make_args(), dict(kwargs))
    assert results.hits == 2
    for got in (first, second, third):
        assert same_meta(got, expected)
    assert second is not third  # a fresh tensor each time: nothing shared between calls


def test_split_returns_a_tuple_of_fresh_tensors():
    results = MetaResults()
    a = meta(6, 4)
    expected = torch.split(a, 2)
    results.call(torch.split, (meta(6, 4), 2), {})
    # the pieces of split are views of their input: a fresh tensor would lose that, so it is not memoised
    assert len(results) == 0
    got = results.call(torch.split, (meta(6, 4), 2), {})
    assert type(got) is tuple and all(same_meta(g, e) for g, e in zip(got, expected, strict=True))


def test_a_tuple_of_new_tensors_is_memoised():
    results = MetaResults()
    expected = torch.var_mean(meta(3, 5), dim=1)
    results.call(torch.var_mean, (meta(3, 5),), {"dim": 1})
    got = results.call(torch.var_mean, (meta(3, 5),), {"dim": 1})
    assert results.hits == 1 and type(got) is tuple
    assert all(same_meta(g, e) for g, e in zip(got, expected, strict=True))
    results.call(torch.sort, (meta(3, 5),), {"dim": 1})  # a named tuple of torch's: not rebuilt, run each time
    results.call(torch.sort, (meta(3, 5),), {"dim": 1})
    assert results.hits == 1


def test_keys_tell_apart_types_values_and_global_state():
    results = MetaResults()
    ints = meta(3, dtype=torch.int64)
    by_int = results.call(torch.add, (ints, 1), {})
    by_float = results.call(torch.add, (ints, 1.0), {})
    by_bool = results.call(torch.add, (ints, True), {})
    assert (by_int.dtype, by_float.dtype, by_bool.dtype) == (torch.int64, torch.float32, torch.int64)
    assert len(results) == 3
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert results.call(torch.add, (ints, 1.0), {}).dtype == torch.float64  # not the memo's float32
    finally:
        torch.set_default_dtype(before)
    assert results.call(torch.add, (ints, 1.0), {}).dtype == torch.float32
    assert results.call(torch.sum, (meta(4, 5),), {"dim": 0}).shape == (5,)
    assert results.call(torch.sum, (meta(4, 5),), {"dim": 1}).shape == (4,)
    assert results.call(torch.sum, (meta(4, 6),), {"dim": 1}).shape == (4,)
    assert results.call(torch.sum, (meta(4, 6),), {"dim": 1, "keepdim": True}).shape == (4, 1)


# -- what is never memoised --------------------------------------------------------------------------------


def test_in_place_results_views_and_autograd_history_are_not_memoised():
    results = MetaResults()
    a = meta(4, 4)
    assert results.call(torch.Tensor.add_, (a, meta(4)), {}) is a
    assert results.call(torch.Tensor.add_, (a, meta(4)), {}) is a  # still the argument: the op ran again
    out = meta(4, 4)
    assert results.call(torch.add, (a, a), {"out": out}) is out
    assert results.call(torch.Tensor.transpose, (a, 0, 1), {})._is_view()
    assert results.call(torch.Tensor.__getitem__, (a, (slice(1, None), 0)), {})._is_view()
    assert len(results) == 0
    w = meta(4, 4).requires_grad_()
    with torch.enable_grad():
        y = results.call(torch.mul, (w, 2.0), {})
    assert y.requires_grad and y.grad_fn is not None and len(results) == 0
    with torch.no_grad():  # no history without grad mode: memoised, as the op would return it
        z = results.call(torch.mul, (w, 2.0), {})
        z2 = results.call(torch.mul, (w, 2.0), {})
    assert same_meta(z, z2) and not z2.requires_grad and results.hits == 1


def test_arguments_it_cannot_key_run_the_op():
    results = MetaResults()
    g = torch.Generator()
    assert results.call(torch.rand_like, (meta(3),), {"generator": None}).shape == (3,)
    assert results.call(F.dropout, (meta(3, 3),), {"p": 0.5, "training": False}).shape == (3, 3)
    hits = results.hits
    out = results.call(lambda x, gen: x * 2, (meta(2),), {"gen": g})  # a generator: no key
    assert out.shape == (2,) and results.hits == hits

    class Custom(torch.Tensor):
        pass

    sub = meta(2).as_subclass(Custom)
    results.call(torch.neg, (sub,), {})
    results.call(torch.neg, (sub,), {})
    assert results.hits == hits  # a tensor subclass may dispatch as it likes: never memoised


def test_a_nan_argument_and_the_bound_keep_the_memo_small():
    results = MetaResults(limit=8)
    for _ in range(50):
        assert results.call(torch.add, (meta(2), math.nan), {}).shape == (2,)
    for i in range(50):
        results.call(torch.add, (meta(i + 1), 1.0), {})
    assert len(results) <= 8
    off = MetaResults(limit=0)
    off.call(torch.add, (meta(2), 1.0), {})
    off.call(torch.add, (meta(2), 1.0), {})
    assert len(off) == 0 and off.hits == 0


def test_an_op_that_fails_on_meta_still_fails():
    results = MetaResults()
    with pytest.raises(RuntimeError):
        results.call(torch.add, (meta(3), meta(4)), {})
    with pytest.raises((RuntimeError, NotImplementedError)):
        results.call(torch.Tensor.item, (meta(1),), {})
    assert len(results) == 0
