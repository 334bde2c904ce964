"""The launcher's two wire protocols, checked the same way on both ends. No torch here: the node agent, the
launcher and ``varuna notify-preempt`` import this module.

**The node agent's protocol** (launcher ↔ :mod:`varuna_core.launch.agent`, JSON lines over the agent's stdin and
stdout, locally or through SSH). The first line the launcher writes is the node's :class:`AgentSpec`; then come
commands (:class:`SignalCommand`, :class:`StopCommand`). The agent answers with events, one JSON object per line
tagged by ``event`` (:data:`AgentEvent`): ``ready``, ``store``, ``started``, ``log``, ``exit``, ``error``,
``stopped``, ``preempt`` (the cloud announced that the node's VM goes away) and ``signalled`` (the scheduler
signalled the node). Anything else on the agent's stdout (a remote shell's banner, a stray ``42``) is not an event
(:func:`parse_event` gives None). The models are strict: no type is coerced (``"0"`` is not a rank, ``true`` is not
an int), ranks and ports are in range, and a line is bounded (:data:`MAX_SPEC`, :data:`MAX_EVENT`,
:data:`MAX_LINE`). :class:`GoneEvent` is the launcher's own (an agent whose output ended), never read from an agent.

**Heartbeat datagrams** (workers and ``varuna notify-preempt`` → the manager's
:class:`~varuna_core.launch.heartbeat.Listener`, UDP). A datagram (at most :data:`MAX_DATAGRAM` bytes) is
``{"p": PAYLOAD, "mac": HEX}``: ``PAYLOAD`` is the text of a JSON object, ``HEX`` the HMAC-SHA256 of its UTF-8
bytes keyed by the job's token (a secret made per launch, handed to the workers in their environment over SSH, to
``varuna notify-preempt`` through a 0600 file in the run directory). Everything in the payload is signed; the token
itself never crosses the network. Every payload holds ``job`` (the job id), ``kind`` and ``ts`` (the sender's
``time.time()``). Kinds of message:

* ``beat`` (worker → manager, after every step and every ``interval`` seconds; see
  :class:`varuna_core.worker.beacon.Beacon`): ``sender`` (a random id per beacon), ``seq`` (1, 2, ... per datagram
  of that sender), ``attempt`` (the worker's ``VARUNA_ATTEMPT``), ``rank``, ``host``, ``step``, ``steps``
  (``[step, loss, step time]`` of the steps finished since the previous datagram, at most :data:`MAX_STEPS`) and
  the rank's state: loss, step time, compute time (the time the rank spent in its own forward/backward work),
  samples per step, timings (see ``BEAT_FIELDS``; any other field must be a short scalar);
* ``preempt`` (notify-preempt → manager): ``id`` (random), ``host`` and ``seconds`` until it goes away;
* ``ack`` (manager → notify-preempt): the ``id`` of the notice it received.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

__all__ = [
    # the node agent's protocol
    "MAX_LINE", "MAX_EVENT", "MAX_SPEC", "WorkerSlot", "LegacyArgs", "SpotWatch", "AgentSpec", "ReadyEvent",
    "StoreEvent", "StartedEvent", "LogEvent", "ExitEvent", "ErrorEvent", "StoppedEvent", "PreemptEvent",
    "SignalledEvent", "ForkServerEvent", "GoneEvent", "AgentEvent", "MAX_NOTICE_SECONDS", "MAX_ENDPOINT",
    "SignalCommand", "StopCommand", "HandoverCommand", "ForkServerCommand", "AgentCommand", "ShelfSpec", "GO_KEY",
    "MAX_GO", "Go", "ShelfHolder",
    "encode_go", "decode_go", "Regroup", "regroup_key", "encode_regroup", "decode_regroup",
    "parse_spec", "parse_event", "parse_command", "grace_seconds",
    "describe",
    # heartbeat datagrams
    "MAX_DATAGRAM", "MAX_STEPS", "MAX_KEY", "MAX_TEXT", "BadField", "BEAT_FIELDS", "NOTICE_FIELDS",
    "check_beat_field", "check_step_record", "check_beat", "check_notice", "encode", "open_datagram", "decode",
]

MAX_RANK = 2**20  # ranks are 0 .. MAX_RANK - 1

# ----------------------------------------------------------------------------------------------------------
# The node agent's protocol

MAX_SPEC = 16 * 2**20  # bytes of the spec line
MAX_LINE = 64 * 2**10  # bytes of a worker's output line forwarded as one event (longer lines are split)
MAX_EVENT = 256 * 2**10  # bytes of one line of an agent's output (a worker's line is at most MAX_LINE before JSON)
MAX_GRACE = 3600.0
MAX_ENDPOINT = 1024  # characters of a spot watch's metadata endpoint (varuna_core.launch.spot checks it up front)
MAX_NOTICE_SECONDS = 7 * 86400.0  # a preemption announced further ahead is not a notice
MAX_GO = 4 * 2**20  # bytes of a handover's go message
GO_KEY = "varuna/handover/go"  # where node 0's agent puts the go message in the job's store

Rank = Annotated[int, Field(ge=0, lt=MAX_RANK)]
Port = Annotated[int, Field(gt=0, lt=65536)]
Name = Annotated[str, Field(min_length=1, max_length=1024)]


class _Strict(BaseModel):
    """No coercion at all: a JSON string is not a number, ``true`` is not an int."""

    model_config = ConfigDict(strict=True, extra="forbid")


class WorkerSlot(_Strict):
    """One worker of a node: its global and local rank."""

    rank: Rank
    local_rank: Rank


class LegacyArgs(_Strict):
    """The original launcher's arguments, appended to every worker's command line (``--legacy-args``)."""

    stage_to_rank_map: str
    chunk_size: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)]


class ShelfSpec(_Strict):
    """The node's shelf for a morph by handover (:mod:`varuna_core.launch.shelf`): the agent serves it to the
    job's other hosts while it runs, and clears it when it stops."""

    root: Annotated[str, Field(min_length=1, max_length=4096)]  # a tmpfs directory (default /dev/shm)
    key: Annotated[str, Field(min_length=1, max_length=256)]  # the shelf's name: the job and attempt
    budget: Annotated[int, Field(ge=0)] | None = None  # bytes it may hold on this host (None: the tmpfs's free space)
    # the checkpoint store on this host's own disk (--ckpt-local), served read only beside the shelf
    store: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


class SpotWatch(_Strict):
    """Ask the cloud's metadata service whether this node's VM goes away (:mod:`varuna_core.launch.spot`)."""

    source: Literal["azure", "aws", "gcp"]
    endpoint: Annotated[str, Field(min_length=1, max_length=MAX_ENDPOINT)] | None = None  # default: the cloud's
    interval: Annotated[float, Field(ge=0.1, le=3600.0, allow_inf_nan=False)] = 5.0
    vm_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # Azure: events must name it


class AgentSpec(_Strict):
    """What one node agent runs: the first line the launcher writes to it."""

    job: Annotated[str, Field(min_length=1, max_length=256)]
    node: Rank
    host: Name
    store: bool  # this agent hosts the job's TCPStore (node 0)
    master_addr: Name
    master_port: Port | None  # None: the store picks one (node 0)
    world: Annotated[int, Field(ge=1, le=MAX_RANK)]
    workers: list[WorkerSlot]
    argv: Annotated[list[str], Field(min_length=1)]
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    plan: dict[str, Any] | None = None  # written beside the workers, named by VARUNA_PLAN
    grace: Annotated[float, Field(ge=0.0, le=MAX_GRACE, allow_inf_nan=False)] = 5.0
    legacy_args: LegacyArgs | None = None
    spot: SpotWatch | None = None
    shelf: ShelfSpec | None = None  # serve the workers' published state (a morph by handover)
    # the node runs under a scheduler (Slurm) that signals every process of the job: a SIGTERM or SIGUSR1 the
    # agent gets is the scheduler's warning, reported to the launcher, and does not stop the workers
    scheduler_signals: bool = False
    # fork the workers (and node 0's store host) from this job's fork server on the host when one runs there, and
    # start one when told (:mod:`varuna_core.launch.forkserver`)
    fork_server: bool = False
    # start this job's fork server here before the workers and fork them all from it (the host runs several: one
    # interpreter imports torch instead of each; or a handover would start one once the job trains; not under
    # Slurm); without ``fork_server`` it leaves when this attempt stops
    fork_now: bool = False

    @model_validator(mode="after")
    def _workers_fit(self) -> AgentSpec:
        ranks = [w.rank for w in self.workers]
        if any(r >= self.world for r in ranks):
            raise ValueError(f"a worker's rank is not below world={self.world}")
        if len(set(ranks)) != len(ranks) or len({w.local_rank for w in self.workers}) != len(ranks):
            raise ValueError("two workers have the same rank or local rank")
        if self.master_port is None and not self.store:
            raise ValueError("master_port is needed unless this agent hosts the store")
        return self


class _Event(BaseModel):
    """An event of an agent. Fields of a later version are ignored; the known ones are strict."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ReadyEvent(_Event):
    event: Literal["ready"] = "ready"
    pid: int
    interface: str | None  # the network interface towards the master, if known
    address: str | None  # this host's address on it
    shelf_port: Port | None = None  # where the node's shelf server listens (the spec asked for a shelf)


class StoreEvent(_Event):
    event: Literal["store"] = "store"
    port: Port


class StartedEvent(_Event):
    event: Literal["started"] = "started"
    rank: Rank
    pid: int
    forked: bool = False  # by the host's fork server (else a new interpreter)


class ForkServerEvent(_Event):
    """The job's fork server on the agent's host serves (``pid``; ``seconds`` to start it, 0 if it ran already),
    or cannot (``message``: the workers of later attempts then start as new interpreters)."""

    event: Literal["forkserver"] = "forkserver"
    pid: int | None = None
    seconds: Annotated[float, Field(ge=0.0, le=86400.0, allow_inf_nan=False)] = 0.0
    message: Annotated[str | None, Field(max_length=MAX_LINE)] = None


class LogEvent(_Event):
    event: Literal["log"] = "log"
    rank: Rank
    line: Annotated[str, Field(max_length=MAX_LINE)]


class ExitEvent(_Event):
    event: Literal["exit"] = "exit"
    rank: Rank
    code: int  # negative: killed by that signal


class ErrorEvent(_Event):
    event: Literal["error"] = "error"
    message: Annotated[str, Field(max_length=MAX_LINE)]

    @classmethod
    def of(cls, message: str) -> ErrorEvent:
        """The event of ``message``, cut to fit."""
        return cls(message=message if len(message) <= MAX_LINE else message[: MAX_LINE - 3] + "...")


class StoppedEvent(_Event):
    event: Literal["stopped"] = "stopped"


class PreemptEvent(_Event):
    """The node's VM goes away in ``seconds`` (the cloud said so through its metadata service)."""

    event: Literal["preempt"] = "preempt"
    source: Annotated[str, Field(max_length=64)]
    seconds: Annotated[float, Field(ge=0.0, le=MAX_NOTICE_SECONDS, allow_inf_nan=False)]
    detail: Annotated[str, Field(max_length=1024)] = ""


class SignalledEvent(_Event):
    """The agent got ``signal`` from the scheduler (it runs with ``scheduler_signals``): the job must stop."""

    event: Literal["signalled"] = "signalled"
    signal: Literal["SIGTERM", "SIGUSR1"]


class GoneEvent(_Event):
    """The launcher's own event: the agent's output ended (it exited, or SSH lost the host)."""

    event: Literal["gone"] = "gone"
    code: int | None


AgentEvent = Annotated[ReadyEvent | StoreEvent | StartedEvent | LogEvent | ExitEvent | ErrorEvent | StoppedEvent
                       | PreemptEvent | SignalledEvent | ForkServerEvent, Field(discriminator="event")]
_EVENTS: TypeAdapter[AgentEvent] = TypeAdapter(AgentEvent)


def grace_seconds(value: Any, default: float) -> float:
    """A grace period from the launcher: a finite number of seconds in [0, 3600], else ``default``."""
    if isinstance(value, bool):
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return min(max(number, 0.0), MAX_GRACE) if math.isfinite(number) else default


def _lenient_grace(value: Any) -> float | None:
    number = grace_seconds(value, math.nan)
    return None if math.isnan(number) else number


class _Command(BaseModel):
    """A command to the agent. Unknown fields are ignored; the known ones are strict."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class SignalCommand(_Command):
    """Send ``signal`` to every worker's main process (the agent knows SIGUSR1, SIGUSR2, SIGTERM, SIGINT; and
    SIGKILL, to every worker's whole process group: the workers end, the agent and its shelf stay). ``leaving``
    (with SIGUSR2, a handover's ask): this host is not in the next configuration; the agent marks its shelf so
    first (``Shelf.mark_leaving``), and its workers' publish leaves what it can to replicas on staying hosts.
    ``alone`` (likewise): the next configuration runs on this host and no other (``Shelf.mark_alone``): its
    workers' last publish leaves unhashed the files the new workers link in place."""

    cmd: Literal["signal"] = "signal"
    signal: Annotated[str, Field(max_length=64)]
    leaving: bool = False
    alone: bool = False


class StopCommand(_Command):
    """Stop every worker (SIGTERM, SIGKILL after ``grace`` seconds) and exit. The grace period is lenient on
    purpose: a stop whose grace is nonsense (None, ``"soon"``, NaN) still stops, after the spec's."""

    cmd: Literal["stop"] = "stop"
    grace: Annotated[float | None, BeforeValidator(_lenient_grace)] = None
    last: bool = False  # the job ends: the host's fork server leaves too

    def grace_or(self, default: float) -> float:
        return default if self.grace is None else self.grace


class HandoverCommand(_Command):
    """Node 0's agent puts ``message`` into the job's store under ``key``: a signed :func:`encode_go` under
    :data:`GO_KEY`, where the new configuration's warm workers wait for it, or a signed :func:`encode_regroup`
    under its :func:`regroup_key`, where the survivors of a lost replica wait for it."""

    cmd: Literal["handover"] = "handover"
    message: Annotated[str, Field(max_length=MAX_GO)]
    key: Annotated[str, Field(pattern=r"^(varuna/handover/go|varuna/regroup/[1-9][0-9]{0,6})$")] = GO_KEY


class ForkServerCommand(_Command):
    """Start the job's fork server on this host unless one runs, and keep it for the next attempts (sent once the
    attempt trains: its imports then do not slow the workers' start)."""

    cmd: Literal["forkserver"] = "forkserver"


AgentCommand = Annotated[SignalCommand | StopCommand | HandoverCommand | ForkServerCommand,
                         Field(discriminator="cmd")]
_COMMANDS: TypeAdapter[AgentCommand] = TypeAdapter(AgentCommand)


def describe(exc: ValidationError, limit: int = 3) -> str:
    """A validation error in one line: ``where: what`` of its first ``limit`` problems."""
    problems = exc.errors(include_url=False, include_input=False)
    parts = []
    for problem in problems[:limit]:
        where, what = ".".join(map(str, problem["loc"])), problem["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {what}" if where else what)
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return " ".join(("; ".join(parts) + more).split())


def parse_spec(line: str | bytes) -> AgentSpec:
    """The spec in the agent's first line. Raises ValueError with a one-line message if it is not one."""
    try:
        return AgentSpec.model_validate_json(line)
    except ValidationError as exc:
        raise ValueError(describe(exc)) from None


def parse_event(raw: str | bytes) -> ReadyEvent | StoreEvent | StartedEvent | LogEvent | ExitEvent | ErrorEvent | \
        StoppedEvent | PreemptEvent | SignalledEvent | ForkServerEvent | None:
    """The event in one line of an agent's output, or None if the line is not a well-formed event: a JSON
    object whose ``event`` is a known kind, with every field of that kind present and of its type (``bool`` is
    not an ``int``), ports and ranks in range, a log line at most :data:`MAX_LINE` characters."""
    if len(raw) > MAX_EVENT:
        return None
    try:
        return _EVENTS.validate_json(raw)
    except (ValidationError, ValueError, RecursionError):
        return None


def parse_command(line: str | bytes) -> SignalCommand | StopCommand | HandoverCommand | ForkServerCommand:
    """A command to the agent. Raises ValueError (one line) if ``line`` is not one."""
    try:
        return _COMMANDS.validate_json(line)
    except ValidationError as exc:
        raise ValueError(describe(exc)) from None


# ----------------------------------------------------------------------------------------------------------
# The go of a handover (launcher -> node 0's agent -> the job's store -> the new configuration's warm workers)

_GO_PREFIX = b"varuna-handover-go\0"
_REGROUP_PREFIX = b"varuna-regroup\0"


class ShelfHolder(_Strict):
    """Where an old rank's published state is: its host (as the launcher names it) and its shelf server."""

    host: Name
    address: Name
    port: Port


class Go(_Strict):
    """What the warm workers of attempt ``attempt`` are told once the old configuration has stopped: where to
    take their state from. ``source``: ``shelf`` (the old ranks published step ``step`` on their hosts' shelves;
    ``holders[r]`` holds old rank ``r``'s files, under the shelf ``shelf``), ``store`` (the old ranks wrote step
    ``step`` to the checkpoint store instead) or ``none`` (nothing to resume: start at step 0).
    ``fallback_step``: the store's newest checkpoint, for a take that fails. ``copies``: each host of the
    holders also keeps a copy of the files of the host before it (the hosts in the order of their first rank,
    around the ring): an in-memory snapshot's peer copies, tried when a file's own holder fails."""

    attempt: Annotated[int, Field(ge=0)]
    source: Literal["shelf", "store", "none"]
    step: Annotated[int, Field(ge=0)] | None = None
    shelf: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    holders: Annotated[list[ShelfHolder], Field(max_length=MAX_RANK)] = Field(default_factory=list)
    fallback_step: Annotated[int, Field(ge=0)] | None = None
    copies: bool = False

    @model_validator(mode="after")
    def _complete(self) -> Go:
        if self.source != "none" and self.step is None:
            raise ValueError(f"a go from the {self.source} names its step")
        if self.source == "shelf" and (self.shelf is None or not self.holders):
            raise ValueError("a go from the shelves names the shelf and its holders")
        return self


def encode_go(go: Go, token: str) -> str:
    """``go`` signed with the job's token (HMAC-SHA256 over a prefix that no other message of the job uses)."""
    payload = go.model_dump_json()
    mac = hmac.new(token.encode(), _GO_PREFIX + payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}, separators=(",", ":"))


def decode_go(text: str | bytes, token: str, attempt: int) -> Go:
    """The go in ``text`` if it is signed with ``token`` and meant for ``attempt``; ValueError (one line) if not."""
    if len(text) > MAX_GO:
        raise ValueError(f"the go message is over {MAX_GO} bytes")
    try:
        outer = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("the go message is not JSON") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("p"), str) or not isinstance(outer.get("mac"), str):
        raise ValueError("the go message is not {p, mac}")
    want = hmac.new(token.encode(), _GO_PREFIX + outer["p"].encode(errors="surrogatepass"), hashlib.sha256).hexdigest()
    if not outer["mac"].isascii() or not hmac.compare_digest(want, outer["mac"]):
        raise ValueError("the go message is not signed with the job's token")
    try:
        go = Go.model_validate_json(outer["p"])
    except ValidationError as exc:
        raise ValueError(f"the go message is malformed: {describe(exc)}") from None
    if go.attempt != attempt:
        raise ValueError(f"the go message is for attempt {go.attempt}, not this worker's attempt {attempt}")
    return go


class Regroup(_Strict):
    """What the surviving workers of attempt ``attempt`` are told after a host holding only whole data-parallel
    replicas was lost (DESIGN.md §3.8, "a lost replica stops nobody"): the ``number``-th regroup of the attempt.
    Every survivor redoes step ``step`` in a new process group (the job's store, under the key prefix ``prefix``)
    of ``len([r for r in ranks if r is not None])`` ranks: old rank ``i`` becomes ``ranks[i]``, or leaves (None:
    its replica lost a stage), placed by ``stage_to_rank_map``; each keeps its stage."""

    attempt: Annotated[int, Field(ge=0)]
    number: Annotated[int, Field(ge=1, le=MAX_RANK)]
    step: Annotated[int, Field(ge=0)]
    ranks: Annotated[list[Rank | None], Field(min_length=1, max_length=MAX_RANK)]
    stage_to_rank_map: Annotated[str, Field(min_length=1, max_length=MAX_GO)]
    prefix: Annotated[str, Field(min_length=1, max_length=256)]

    @model_validator(mode="after")
    def _ranks(self) -> Regroup:
        kept = sorted(r for r in self.ranks if r is not None)
        if kept != list(range(len(kept))) or not kept:
            raise ValueError("the new ranks are not 0 .. n-1, each once")
        return self


def regroup_key(number: int) -> str:
    """Where node 0's agent puts the ``number``-th regroup message of an attempt in the job's store."""
    return f"varuna/regroup/{int(number)}"


def encode_regroup(regroup: Regroup, token: str) -> str:
    """``regroup`` signed with the job's token (its own prefix: a go's signature does not pass for it)."""
    return _seal(regroup.model_dump_json(), token, _REGROUP_PREFIX)


def decode_regroup(text: str | bytes, token: str, attempt: int, number: int) -> Regroup:
    """The regroup in ``text`` if it is signed with ``token`` and is the ``number``-th of ``attempt``; ValueError
    (one line) if not."""
    payload = _unseal(text, token, _REGROUP_PREFIX, "regroup")
    try:
        regroup = Regroup.model_validate_json(payload)
    except ValidationError as exc:
        raise ValueError(f"the regroup message is malformed: {describe(exc)}") from None
    if (regroup.attempt, regroup.number) != (attempt, number):
        raise ValueError(f"the regroup message is number {regroup.number} of attempt {regroup.attempt}, not number "
                         f"{number} of this worker's attempt {attempt}")
    return regroup


def _seal(payload: str, token: str, prefix: bytes) -> str:
    mac = hmac.new(token.encode(), prefix + payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}, separators=(",", ":"))


def _unseal(text: str | bytes, token: str, prefix: bytes, what: str) -> str:
    """The payload of a sealed message, checked; ValueError naming ``what``."""
    if len(text) > MAX_GO:
        raise ValueError(f"the {what} message is over {MAX_GO} bytes")
    try:
        outer = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"the {what} message is not JSON") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("p"), str) or not isinstance(outer.get("mac"), str):
        raise ValueError(f"the {what} message is not {{p, mac}}")
    want = hmac.new(token.encode(), prefix + outer["p"].encode(errors="surrogatepass"), hashlib.sha256).hexdigest()
    if not outer["mac"].isascii() or not hmac.compare_digest(want, outer["mac"]):
        raise ValueError(f"the {what} message is not signed with the job's token")
    return str(outer["p"])


# ----------------------------------------------------------------------------------------------------------
# Heartbeat datagrams

MAX_DATAGRAM = 8192
MAX_STEPS = 40  # step records per datagram (a datagram stays well under MAX_DATAGRAM)
MAX_INT = 2**63 - 1
MAX_TEXT = 255  # host names, other string fields
MAX_KEY = 64  # field names, sender and notice ids


class BadField(ValueError):
    """A field of the wrong type or out of range."""


# The field checks of heartbeat datagrams. Not util.checks: these read JSON's types off the wire (an int is an int,
# not anything operator.index takes), run for every datagram, and raise the cheap BadField that the listener
# counts as a rejection; no message is ever shown to a user.
def _count(value: Any, limit: int = MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise BadField(value)
    return int(value)


def _real(value: Any) -> float:
    """A finite number, as a float (JSON has no NaN or infinity; Python's decoder accepts them)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadField(value)
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise BadField(value)
    number = float(value)
    if not math.isfinite(number):
        raise BadField(number)
    return number


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise BadField(value)
    return str(value)


def _ident(value: Any) -> str:
    if not value:
        raise BadField(value)
    return _text(value, MAX_KEY)


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadField(value)
    return value


def _scalar(value: Any) -> Any:
    """A field the manager does not know: kept if it is a short scalar."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise BadField(value)
        return int(value)
    return _real(value)


def check_step_record(value: Any) -> tuple[int, float, float | None]:
    """One ``[step, loss, step time]`` record; raises :class:`BadField`."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise BadField(value)
    return _count(value[0]), _real(value[1]), _optional(_real)(value[2])


def _records(value: Any) -> list[tuple[int, float, float | None]]:
    if not isinstance(value, list) or len(value) > MAX_STEPS:
        raise BadField(value)
    return [check_step_record(r) for r in value]


def _seconds(value: Any) -> float:
    number = _real(value)
    if number < 0:
        raise BadField(number)
    return number


_COMMON_FIELDS: dict[str, Callable[[Any], Any]] = {"job": _text, "kind": _text, "ts": _real}
BEAT_FIELDS: dict[str, Callable[[Any], Any]] = {
    **_COMMON_FIELDS,
    "sender": _ident, "seq": _count, "attempt": _count, "steps": _records,
    "rank": lambda v: _count(v, MAX_RANK - 1), "host": _text, "step": _count,
    "loss_step": _optional(_count), "loss": _optional(_real), "step_time": _optional(_real),
    "compute_time": _optional(_real), "samples": _optional(_count), "total_steps": _optional(_count),
    "stage": _optional(_count), "replica": _optional(_count), "checkpointed": _optional(_count),
    "t_start": _optional(_real), "t_ready": _optional(_real), "t_resumed": _optional(_real),
    "t_checkpointed": _optional(_real), "published": _optional(_count), "t_publishing": _optional(_real),
    "t_published": _optional(_real),
    "published_bytes": _optional(_count), "t_warm": _optional(_real), "t_taken": _optional(_real),
    "taken_local": _optional(_count), "taken_remote": _optional(_count), "taken_copies": _optional(_count),
    "taken_replica": _optional(_count),
    "handover_failed": _optional(_text), "local_ckpt": _optional(_count), "regroup_asked": _optional(_count),
    "regroup_refused": _optional(_count),
    "regrouped": _optional(_count),
    "snapshot": _optional(_count), "snapshot_peer": _optional(_boolean), "snapshot_seconds": _optional(_real),
    "snapshot_copied": _optional(_count), "snapshot_failed": _optional(_count), "snapshot_bytes": _optional(_count),
    "snapshot_every": _optional(_count),
}
_BEAT_REQUIRED = ("ts", "sender", "seq", "attempt", "rank")
NOTICE_FIELDS: dict[str, Callable[[Any], Any]] = {
    **_COMMON_FIELDS, "id": _ident, "host": _text, "seconds": _optional(_seconds),
}
_NOTICE_REQUIRED = ("ts", "id", "host")


def check_beat_field(key: str, value: Any) -> Any:
    """One field of a beat as the manager accepts it (normalised); raises :class:`BadField`."""
    if len(key) > MAX_KEY:
        raise BadField(key)
    return BEAT_FIELDS.get(key, _scalar)(value)


def _validate(body: dict[str, Any], fields: dict[str, Callable[[Any], Any]],
              required: tuple[str, ...]) -> dict[str, Any]:
    """``body`` with every known field checked (and normalised); raises :class:`BadField` at the first wrong one."""
    out = {}
    for key, value in body.items():
        if len(key) > MAX_KEY:
            raise BadField(key)
        out[key] = fields.get(key, _scalar)(value)
    if any(key not in out for key in required):
        raise BadField(required)
    return out


def check_beat(body: dict[str, Any]) -> dict[str, Any]:
    """A ``beat`` payload, every field checked and normalised; raises :class:`BadField`."""
    return _validate(body, BEAT_FIELDS, _BEAT_REQUIRED)


def check_notice(body: dict[str, Any]) -> dict[str, Any]:
    """A ``preempt`` payload, every field checked and normalised; raises :class:`BadField`."""
    return _validate(body, NOTICE_FIELDS, _NOTICE_REQUIRED)


def encode(job: str, token: str, kind: str, body: dict[str, Any]) -> bytes:
    """A signed datagram of ``kind`` carrying ``body`` (stamped with the job and the time)."""
    payload = json.dumps({**body, "job": job, "kind": kind, "ts": time.time()}, separators=(",", ":"),
                         allow_nan=False)
    mac = hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"p": payload, "mac": mac}, separators=(",", ":")).encode()


def open_datagram(data: bytes, job: str, token: str) -> tuple[dict[str, Any] | None, str]:
    """The message's body and "ok", or None and why it is dropped (``oversize``, ``malformed``, ``bad_mac``,
    ``bad_fields``, ``other_job``)."""
    if len(data) > MAX_DATAGRAM:
        return None, "oversize"
    try:
        outer = json.loads(data)
    except (ValueError, RecursionError):
        return None, "malformed"
    if not isinstance(outer, dict) or not isinstance(outer.get("p"), str) or not isinstance(outer.get("mac"), str):
        return None, "malformed"
    try:
        payload = outer["p"].encode()
    except UnicodeEncodeError:
        return None, "malformed"
    mac = outer["mac"]
    want = hmac.new(token.encode(), payload, hashlib.sha256).hexdigest()
    if not mac.isascii() or not hmac.compare_digest(want, mac):
        return None, "bad_mac"
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return None, "bad_fields"
    if not isinstance(body, dict):
        return None, "bad_fields"
    return (body, "ok") if body.get("job") == job else (None, "other_job")


def decode(data: bytes, job: str, token: str) -> dict[str, Any] | None:
    """The message's body (a dict) if it is well formed, of this job and signed with its token; else None.

    Checks neither the body's fields nor its freshness: :class:`~varuna_core.launch.heartbeat.Listener` does."""
    return open_datagram(data, job, token)[0]
