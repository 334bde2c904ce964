"""Error hierarchy of the library.

Every error a user can cause is a :class:`VarunaError` whose message states the observed values and whose
``hint`` says what to change. The CLI maps these to one line on stderr and an exit code; library users catch
them by class. No ``assert`` guards user input anywhere in the library.
"""

from __future__ import annotations

__all__ = [
    "VarunaError",
    "ConfigError",
    "FieldError",
    "TopologyError",
    "PartitionError",
    "ScheduleError",
    "CutPointError",
    "ShapeMismatchError",
    "WireRangeError",
    "CommTimeoutError",
    "CheckpointError",
    "HandoverError",
    "ShelfFullError",
    "UserCodeError",
    "InternalError",
    "format_error",
    "EXIT_CHECKPOINTED",
    "EXIT_LEFT",
    "EXIT_BAD_CHECKPOINT",
]

# Exit codes of a worker that the launcher reads (the CLI's own: 0 ok, 1 failed, 2 bad input, 130 interrupted).
EXIT_CHECKPOINTED = 75  # checkpointed on demand and stopped (EX_TEMPFAIL)
EXIT_BAD_CHECKPOINT = 76  # the checkpoint to resume from was refused: resume from an earlier one
EXIT_LEFT = 77  # left the job at a regroup: its replica lost a stage (worker.regroup), not a crash


class VarunaError(Exception):
    """Base class of every error the library raises on purpose.

    Args:
        message: what went wrong, with the observed values.
        hint: what the user can do about it (optional).
    """

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class ConfigError(VarunaError):
    """Bad user input: arguments, sizes, files. Exit code 2 in the CLI."""

    exit_code = 2


class FieldError(ConfigError):
    """A bad value of one named field (an argument, an option, a request's attribute): ``field`` names it and
    ``problem`` says what is wrong with the value, so that a front end can name the field its own way (the CLI
    names the option that sets it) without reading the message.

    Args:
        field: the field's name, e.g. ``"gpus"``.
        problem: the rest of the message, e.g. ``"must be in 1..65536, got 0"`` (or ``": why"``, which follows
            the field without a space).
    """

    def __init__(self, field: str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{field}{'' if problem.startswith(':') else ' '}{problem}", hint=hint)
        self.field = field
        self.problem = problem

    def renamed(self, name: str) -> FieldError:
        """The same error about the same value, with the field called ``name``."""
        return type(self)(name, self.problem, hint=self.hint)

    def __reduce__(self) -> tuple[type[FieldError], tuple[str, str], dict[str, object]]:
        return type(self), (self.field, self.problem), self.__dict__


class TopologyError(ConfigError):
    """A ``stage_to_rank_map`` that does not describe the running world."""


class PartitionError(ConfigError):
    """A partition that does not cover the segments contiguously, or cannot be built."""


class ScheduleError(VarunaError):
    """A schedule that deadlocks, misses or repeats actions."""


class CutPointError(ConfigError):
    """A model whose CutPoints cannot be used as written (called twice, no batch dim, skip across a cut...)."""


class ShapeMismatchError(VarunaError):
    """A tensor crossing a cut whose shape or dtype differs from what discovery recorded."""


class WireRangeError(ConfigError):
    """A value crossing a cut overflowed the wire dtype the run was given (``wire_dtype="fp16"``: a finite value
    beyond fp16's range became inf), in a precision without loss scaling to skip the step. Raised on every rank,
    naming the cut and the direction."""


class CommTimeoutError(VarunaError):
    """A point-to-point or collective wait that did not finish within the timeout, or whose connection failed
    before it (``peer_lost``: the peer died or closed it)."""

    peer_lost = False


def format_error(exc: VarunaError) -> str:
    """One line (plus a hint line) for a user-facing report."""
    text = f"error: {exc.message}"
    if exc.hint:
        text += f"\nhint: {exc.hint}"
    return text


class CheckpointError(VarunaError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model."""


class HandoverError(VarunaError):
    """Training state could not be handed over through host memory (a blob missing or damaged on a shelf, a peer
    that refused, stalled, or sent other bytes than it announced): the message names the blob and the peer."""


class ShelfFullError(HandoverError):
    """State that does not fit in host memory (a shelf's byte budget or its file system's free space): the caller
    goes through the checkpoint store instead."""


class UserCodeError(VarunaError):
    """The user's own code (a model spec's function, the model's forward, an optimizer) raised while a command
    of the toolkit ran it: not bad input, and not a failure of ours. The message says which call raised, where
    (``file:line`` of the innermost frame in the user's files) and what it said; the original exception is the
    ``__cause__``. Exit code 1 in the CLI. See :mod:`varuna_core.util.usercode`."""

    exit_code = 1
    where: tuple[str, int, str] | None = None  # (file, line, function) in the user's code, if known


class InternalError(VarunaError):
    """An invariant of the toolkit that no input can break did not hold: a defect of the toolkit, not bad input
    (exit code 1, never 2). The message says what was found and says that it is ours; the hint asks for a
    report with what is needed to reproduce it."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(f"internal error (a defect of varuna, not of your input): {message}",
                         hint=hint or "please report it with this message, the command or script that ran, and the "
                                      "output of `varuna env`")
        self.detail = message

    def __reduce__(self) -> tuple[type[InternalError], tuple[str], dict[str, object]]:
        return type(self), (self.detail,), self.__dict__
