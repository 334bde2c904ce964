"""Running the user's code (a model spec's functions, the model's forward) and saying whose failure it was.

When a command of the toolkit runs code the user wrote, an exception from that code is neither bad input nor a
failure of ours: it is the user's code failing, and the report says so, with the place in the user's files where
it happened (the innermost frame of the traceback that is not in varuna, torch, another installed library or the
standard library) and what the exception said. :class:`~varuna_core.errors.UserCodeError` carries that (exit
code 1; the original exception is its ``__cause__``, shown with ``VARUNA_DEBUG=1``).

Two ways in:

* :func:`call_user` calls one function the user gave (``ModelSpec.build``, ``batch``, ``optimizer``...). A call
  that does not fit the function's signature is told apart *before* the call, from the signature, rather than
  from a ``TypeError`` (which the body may raise too): it is bad input, a :class:`~varuna_core.errors.ConfigError`
  (exit 2). Whatever the function then raises is its own failure.
* :func:`user_code` wraps a block of our code that calls the user's (a forward through our slicing, an optimizer
  step): an exception that went through a frame of the user's files is theirs; one that did not is ours, and is
  passed on unchanged (the CLI reports it as unexpected).

A :class:`~varuna_core.errors.VarunaError` raised on the way (our own checks, called from the user's code) is
passed on as it is. No torch here: the library's own directories are found from ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UserCodeError, VarunaError

__all__ = ["call_user", "user_code", "user_error", "user_frame", "check_call", "accepts",
           "plain_signature"]

MAX_SAID = 300  # characters of the user's exception message kept in ours
_OURS = ("varuna", "varuna_core", "varuna_cli")  # packages of this project, beside varuna_core in its directory


@lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Directories whose files are not the user's: this project's packages, the Python installation (standard
    library, site-packages) and torch (wherever it was installed from)."""
    here = Path(__file__).resolve().parents[2]  # the directory holding varuna_core
    roots = {str(here / name) for name in _OURS}
    paths = sysconfig.get_paths()
    roots.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k))
    with contextlib.suppress(AttributeError):
        roots.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        roots.add(site.getusersitepackages())
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        roots.add(str(Path(torch_file).resolve().parent))
    return tuple(os.path.realpath(r) + os.sep for r in roots)


@lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    real = os.path.realpath(filename)
    return not any(real.startswith(root) for root in _library_roots())


def user_frame(tb: types.TracebackType | None) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the innermost frame of ``tb`` in a file of the user's, or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_user_file(code.co_filename):
            found = (code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


def _shown_file(filename: str) -> str:
    """``filename`` relative to the working directory when it is below it (shorter, and what the user typed)."""
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            return relative
    return filename


def user_error(what: str, exc: BaseException, where: tuple[str, int, str] | None = None) -> UserCodeError:
    """The :class:`UserCodeError` saying that ``what`` raised ``exc`` (at ``where``, default: the innermost user
    frame of its traceback). Raise it ``from exc``."""
    where = where if where is not None else user_frame(exc.__traceback__)
    said = " ".join(str(exc).split())
    said = said if len(said) <= MAX_SAID else said[: MAX_SAID - 3] + "..."
    place = f" at {_shown_file(where[0])}:{where[1]}" + (f" (in {where[2]})" if where[2] != "<module>" else "") \
        if where else ""
    error = UserCodeError(f"{what} raised {type(exc).__name__}{place}" + (f": {said}" if said else ""),
                          hint="the error is in that code, not in varuna; set VARUNA_DEBUG=1 for the whole traceback")
    error.where = where
    return error


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s own signature: a decorator's wrapper (``functools.wraps``) is read as itself, not as the function
    it wraps, since it may take what the wrapped one does not (a renamed keyword, say)."""
    return inspect.signature(fn, follow_wrapped=False)


def accepts(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool | None:
    """Whether ``fn``'s signature takes these arguments; None when it cannot be read (some built-ins)."""
    try:
        signature = _signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def plain_signature(fn: Callable[..., Any]) -> str:
    """``fn``'s signature without annotations, e.g. ``(idx, targets)``: the names are what a message needs."""
    signature = _signature(fn)
    return str(signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                             for p in signature.parameters.values()],
                                 return_annotation=inspect.Signature.empty))


def check_call(fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, *, what: str,
               hint: str = "see ModelSpec's documentation for the arguments each function gets") -> None:
    """Refuse a call of ``fn`` that its signature does not take (bad input: a :class:`ConfigError`). A function
    whose signature cannot be read is let through: the call itself will tell."""
    if accepts(fn, *args, **(kwargs or {})) is not False:
        return
    try:
        _signature(fn).bind(*args, **(kwargs or {}))
    except TypeError as exc:
        raise ConfigError(f"{what} cannot be called so: {exc} (its signature is {plain_signature(fn)})",
                          hint=hint) from None


def call_user(fn: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for a function the user gave; ``what`` names the call in messages (e.g. ``"the
    model spec's build()"``).

    Raises:
        ConfigError: the arguments do not fit ``fn``'s signature (checked before calling).
        UserCodeError: ``fn`` raised (an exception that is not a :class:`VarunaError`), from that exception.
    """
    check_call(fn, args, kwargs, what=what)
    try:
        return fn(*args, **kwargs)
    except VarunaError:
        raise
    except Exception as exc:  # the user's code may raise anything: reported as theirs
        raise user_error(what, exc) from exc


@contextlib.contextmanager
def user_code(what: str, *, keep: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Report an exception of the block as the user's (a :class:`UserCodeError`) when it went through a frame in
    the user's files; pass it on unchanged when it did not (ours), when it is a :class:`VarunaError`, or one of
    ``keep`` (e.g. an out-of-memory error the caller handles)."""
    try:
        yield
    except VarunaError:
        raise
    except Exception as exc:
        if isinstance(exc, keep):
            raise
        where = user_frame(exc.__traceback__)
        if where is None:
            raise
        raise user_error(what, exc, where) from exc
