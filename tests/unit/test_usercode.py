"""Whose failure is it (``varuna_core.util.usercode``): the user's code raising, a call that does not fit the
user's function, or our own error. The user's place is the innermost frame in their files, never torch's or
ours; a ``TypeError`` raised inside a function is never read as a wrong call of it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import varuna_core
from varuna_core.errors import ConfigError, CutPointError, UserCodeError
from varuna_core.model.discovery import make_batch_fn
from varuna_core.util.usercode import call_user


def _here(fn) -> str:
    """``test_usercode.py:N`` of the last line of ``fn`` (where each helper below raises)."""
    lines, start = inspect.getsourcelines(fn)
    return f"test_usercode.py:{start + len(lines) - 1}"


def type_error_inside(n):
    return torch.ones(n) + "x"


def value_error_inside():
    raise ValueError("bad config\nsecond line")


def wrong_shape():
    return torch.nn.Linear(2, 2)(torch.ones(3))  # raises inside torch's own Python code


def _ours(source: str) -> dict:
    """Functions compiled as if they were a file of varuna_core: frames of ours, not the user's."""
    namespace: dict = {}
    exec(compile(source, str(Path(varuna_core.__file__).parent / "_fake_module.py"), "exec"), namespace)
    return namespace


OURS = _ours(
    "from varuna_core.util.usercode import user_code\n"
    "def run(fn, *args):\n"
    "    with user_code('the model\\'s code'):\n"
    "        return fn(*args)\n"
    "def boom():\n"
    "    raise KeyError('a bug of ours')\n"
)


def test_a_type_error_inside_is_the_users_code_not_a_wrong_call() -> None:
    with pytest.raises(UserCodeError) as info:
        call_user(type_error_inside, 2, what="the model spec's batch(2)")
    assert info.value.message.startswith("the model spec's batch(2) raised TypeError at ")
    assert _here(type_error_inside) in info.value.message and "(in type_error_inside)" in info.value.message
    assert isinstance(info.value.__cause__, TypeError) and info.value.exit_code == 1


def test_a_call_the_signature_does_not_take_is_bad_input_and_never_runs() -> None:
    calls = []

    def takes_two(a, b):
        calls.append((a, b))

    with pytest.raises(ConfigError, match=r"cannot be called so: missing a required argument: 'b' \(its signature "
                                          r"is \(a, b\)\)"):
        call_user(takes_two, 1, what="f(1)")
    assert not calls


def test_the_place_is_the_users_line_not_torchs() -> None:
    with pytest.raises(UserCodeError) as info:
        call_user(wrong_shape, what="build()")
    assert _here(wrong_shape) in info.value.message and "torch" not in info.value.message.split(":")[0]
    assert info.value.where[0] == __file__


def test_the_message_is_one_line_and_bounded() -> None:
    with pytest.raises(UserCodeError) as info:
        call_user(value_error_inside, what="build()")
    assert "bad config second line" in info.value.message and "\n" not in info.value.message
    with pytest.raises(UserCodeError) as info:
        call_user(lambda: (_ for _ in ()).throw(ValueError("x" * 10_000)), what="build()")
    assert len(info.value.message) < 500


def test_our_own_errors_pass_unchanged() -> None:
    with pytest.raises(KeyError, match="a bug of ours"):  # no frame of the user's: ours, reported as unexpected
        OURS["run"](OURS["boom"])
    with pytest.raises(CutPointError):  # a VarunaError raised under the user's code is ours on purpose

        def raises_ours():
            raise CutPointError("skip across a cut")

        OURS["run"](raises_ours)
    with pytest.raises(UserCodeError, match=r"the model's code raised TypeError at .*test_usercode\.py"):
        OURS["run"](type_error_inside, 2)


def test_a_batch_function_is_called_by_its_signature_not_retried_after_a_type_error() -> None:
    """The original's ``get_batch_fn(size, device)`` gets ``device``; a TypeError raised inside ``fn(n)`` is its
    own (it used to be retried as ``fn(n, device="cpu")``, which then blamed the call)."""
    with pytest.raises(TypeError, match="unsupported operand"):
        make_batch_fn(type_error_inside, None)
    seen = []

    def original(size, device):
        seen.append(device)
        return {"x": torch.ones(size, 2)}

    assert make_batch_fn(original, None)[1] == {"x": 0} and seen == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match=r"the batch function cannot be called as fn\(n\) \(its signature is "
                                          r"\(\)\)"):
        make_batch_fn(lambda: {"x": torch.ones(1)}, None)


def test_a_decorated_function_is_judged_by_its_wrapper() -> None:
    """A wrapper may take what the function it wraps does not (a renamed keyword): no refusal from the wrapped
    signature, and what the call then raises is the user's code failing."""
    import functools

    def renames(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "old_name" in kwargs:
                kwargs["new_name"] = kwargs.pop("old_name")
            return fn(*args, **kwargs)

        return wrapper

    @renames
    def forward(new_name):
        return new_name

    assert call_user(forward, old_name=3, what="forward") == 3
