"""One line instead of a traceback when a worker dies of a VarunaError."""

from __future__ import annotations

import os
import sys
from types import TracebackType

from ..env import debug
from ..errors import VarunaError, format_error

__all__ = ["install_excepthook"]


def install_excepthook() -> None:
    """Report an uncaught :class:`VarunaError` in a worker as one line and exit with its code.

    Training scripts usually let errors propagate; a traceback through the runtime then hides the one line
    that matters. With ``VARUNA_DEBUG=1`` the traceback is printed as usual. Other exceptions are untouched.
    Installed by ``Varuna(...)``; idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_varuna", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, VarunaError) and not debug():
            rank = os.environ.get("RANK")
            prefix = f"[rank {rank}] " if rank is not None else ""
            sys.stdout.flush()
            # the real stderr: torch.distributed wraps this hook and points sys.stderr at a buffer it prints
            # only after the hook returns, which os._exit prevents
            err = sys.__stderr__ or sys.stderr
            err.write("".join(prefix + line + "\n" for line in format_error(value).splitlines()))
            err.flush()
            os._exit(value.exit_code)
        previous(kind, value, tb)

    hook._varuna = True  # type: ignore[attr-defined]
    sys.excepthook = hook
