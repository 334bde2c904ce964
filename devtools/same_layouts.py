"""What a run that morphed must equal to the last bit: the same layouts over the same steps, restarted through a
checkpoint store between them, on local processes.

A morph changes the layout (pp × dp, the partition), and another layout rounds differently, which training
amplifies step after step: against a run that never changed its layout, only a tolerance can be asserted, and a
tolerance says nothing about a bug that stays below it. What is guaranteed is stronger. A step computed by an
attempt depends only on the state the attempt started from and the attempt's plan; the state it started from was
produced by an earlier attempt (the one that published it for a handover, or wrote the checkpoint it resumed
from), and so on back to step 0. That chain of attempts — the run's *surviving history* — is replayed here:
each link's plan, from the step it started at to the step its successor started at, as one local launch that
ends with a checkpoint at that step, the next one resuming from it. Every loss the chain's attempts reported, and
the final checkpoint, must equal the replay's exactly.

The chain is read from the launcher's records (``events.jsonl``, ``metrics.jsonl``, ``plans/attempt<K>.yaml``):
an attempt started at the step of its ``go`` (a handover) or its ``resume`` (a checkpoint), else at 0; the state
at step ``s > 0`` was produced by the latest earlier attempt that computed step ``s - 1``. An attempt whose
workers regrouped after losing a host (a ``regroup`` event) is two links: its plan up to the step redone, the
regrouped plan from there. Consecutive links with
the same plan are replayed as one (a restart on one layout reproduces the run to the last bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from devtools.launching import Launch, read_steps

__all__ = ["Link", "surviving_chain", "replay", "mismatches"]


@dataclass(frozen=True)
class Link:
    """Attempt ``attempt`` computed steps ``first .. end - 1`` of the surviving history with ``plan``."""

    attempt: int
    plan: Path
    first: int
    end: int


def surviving_chain(events: list[dict], reports: list[dict], run_dir: Path, last: int) -> list[Link]:
    """The attempts whose steps led to the state at step ``last``, oldest first (see the module docstring)."""
    computed: dict[int, set[int]] = {}
    for r in reports:
        computed.setdefault(r["attempt"], set()).add(r["step"])
    starts = {e["attempt"]: e for e in events if e["event"] == "starting"}
    goes = {e["attempt"]: e for e in events if e["event"] == "go"}

    def start_of(attempt: int) -> int:
        if attempt in goes:
            return goes[attempt]["step"] or 0 if goes[attempt]["source"] != "none" else 0
        return starts[attempt]["resume"] or 0

    def producer(step: int, before: int) -> int:
        makers = [a for a, steps in computed.items() if a < before and step - 1 in steps]
        if not makers:
            raise AssertionError(f"no attempt before attempt {before} computed step {step - 1}")
        return max(makers)

    chain: list[Link] = []
    attempt, end = producer(last, 1 << 30), last
    while True:
        first = start_of(attempt)
        chain.append(Link(attempt, run_dir / "plans" / f"attempt{attempt}.yaml", first, end))
        if first == 0:
            break
        attempt, end = producer(first, attempt), first
    chain.reverse()
    return _split_at_regroups(chain, events, run_dir)


def _split_at_regroups(chain: list[Link], events: list[dict], run_dir: Path) -> list[Link]:
    """An attempt whose survivors regrouped after losing a host ran two layouts: its plan up to the step they
    redid, then the regrouped plan (``plans/attempt<K>-regroup<N>.yaml``) from that step on."""
    regroups = sorted((e for e in events if e["event"] == "regroup"), key=lambda e: (e["attempt"], e["number"]))
    out: list[Link] = []
    for link in chain:
        pieces = [(link.first, link.plan)]
        pieces += [(e["step"], run_dir / "plans" / f"attempt{link.attempt}-regroup{e['number']}.yaml")
                   for e in regroups if e["attempt"] == link.attempt and link.first < e["step"] < link.end]
        for i, (first, plan) in enumerate(pieces):
            out.append(Link(link.attempt, plan, first, pieces[i + 1][0] if i + 1 < len(pieces) else link.end))
    return out


def _merged(chain: list[Link]) -> list[Link]:
    """Consecutive links with the same plan as one (a restart on one layout reproduces the run to the last bit)."""
    merged: list[Link] = []
    for link in chain:
        if merged and merged[-1].plan.read_text() == link.plan.read_text():
            merged[-1] = Link(merged[-1].attempt, merged[-1].plan, merged[-1].first, link.end)
        else:
            merged.append(link)
    return merged


def replay(chain: list[Link], where: Path, train: list[str], timeout: float = 240) -> tuple[dict[int, float], Path]:
    """Run ``chain`` on local processes (``train``: the script and its arguments but ``--steps``), each link up to
    its end step and a checkpoint there, each resuming from the previous one's. Returns every step's loss and the
    final checkpoint's directory."""
    where.mkdir(parents=True, exist_ok=True)
    store = where / "store"
    losses: dict[int, float] = {}
    for i, link in enumerate(_merged(chain)):
        run = where / f"link{i}-attempt{link.attempt}"
        launch = Launch([str(link.plan), "--run-dir", str(run), "--ckpt-dir", str(store), *(["--resume"] if i else []),
                         "--", *train, "--steps", str(link.end)], run, timeout=timeout)
        try:
            code = launch.wait()
        finally:
            launch.close()
        if code != 0:
            raise AssertionError(f"replaying attempt {link.attempt} ({link.first}..{link.end}) failed ({code}):\n"
                                 f"{launch.output()[-3000:]}")
        steps = read_steps(run)
        if set(steps) != set(range(link.first, link.end)):
            raise AssertionError(f"replaying attempt {link.attempt} computed steps {sorted(steps)[:3]}..., not "
                                 f"{link.first}..{link.end - 1}")
        losses.update(steps)
    return losses, store / f"step_{chain[-1].end}"


def mismatches(chain: list[Link], reports: list[dict],
               expected: dict[int, float]) -> list[tuple[int, int, float, float | None]]:
    """``(attempt, step, loss, replayed loss)`` of every step that an attempt of the chain reported, within its
    link, and that differs from the replay (other attempts' steps were not kept: they started from elsewhere)."""
    return [(r["attempt"], r["step"], r["loss"], expected.get(r["step"])) for r in reports
            if any(link.attempt == r["attempt"] and link.first <= r["step"] < link.end for link in chain)
            and r["loss"] != expected.get(r["step"])]
