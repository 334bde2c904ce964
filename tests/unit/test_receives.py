"""Bounded receive buffers ([Note: receive window] in ``varuna_core.ir.inflight``).

The runtime keeps a window of posted receives per direction instead of posting every micro-batch's. These tests
replay the runtime's posting rule over random asynchronous interleavings of all stages (any stage may be slow,
the opportunistic forward swaps as the executor does) and check, for every schedule, ``S ≤ 6`` and ``M ≤ 16``:

* the peak of posted and unconsumed buffers per direction equals ``posted_receives(schedule)``;
* every consumer (a forward for activations, a backward for gradients) finds its receive posted when it starts;
* every message a neighbour sends finds its receive already posted (gloo delivers only into a posted receive:
  a later post would delay the transfer and lose the overlap with compute);

and that the planner's memory model charges the same counts.
"""

from __future__ import annotations

import random

import pytest

from varuna_core.ir.inflight import inflight, posted_receives, receive_windows
from varuna_core.ir.schedule import SCHEDULE_NAMES, Action, Op, Schedule, generate
from varuna_core.planning.memory import stage_bytes
from varuna_core.planning.simulate import inflight_counts

ACT, GRAD = 0, 1


class _Replay:
    """Every stage of ``schedule`` running the executor's rules, one event at a time in a random order.

    A stage is idle at its next action or has started it; starting takes the action's posted receive (the
    window moves on by one), completing needs the message to have arrived, then sends. A recompute whose gradient
    has not arrived lets the next forward go first while the stage holds fewer than its static peak.
    """

    def __init__(self, schedule: Schedule, rng: random.Random) -> None:
        self.sched, self.rng = schedule, rng
        p = self.p = schedule.num_stages
        self.windows = posted_receives(schedule)
        self.cap = [held for held, _ in inflight(schedule)]
        self.actions = [list(stage) for stage in schedule.actions]
        self.order = [([a.mb for a in stage if a.op is Op.F] if s > 0 else [],
                       [a.mb for a in stage if a.op is Op.B] if s < p - 1 else [])
                      for s, stage in enumerate(schedule.actions)]
        self.pos = [0] * p
        self.started: list[Action | None] = [None] * p
        self.held = [0] * p
        self.recompute = [schedule.uses_recompute(s) for s in range(p)]
        self.posted = [[set(), set()] for _ in range(p)]  # posted and unconsumed micro-batches per direction
        self.next_post = [[0, 0] for _ in range(p)]
        self.peak = [[0, 0] for _ in range(p)]
        self.armed = [[set(), set()] for _ in range(p)]  # posted receives whose message has not come yet
        self.arrived = [[set(), set()] for _ in range(p)]  # messages sent to stage s (delivered: posted)
        self.speed = [rng.choice([0.05, 0.3, 1.0, 1.0, 3.0]) for _ in range(p)]  # some stages far slower
        for s in range(p):
            for kind in (ACT, GRAD):
                for _ in range(min(self.windows[s][kind], len(self.order[s][kind]))):
                    self._post(s, kind)

    def _post(self, s: int, kind: int) -> None:
        k = self.next_post[s][kind]
        if k < len(self.order[s][kind]):
            self.posted[s][kind].add(self.order[s][kind][k])
            self.armed[s][kind].add(self.order[s][kind][k])
            self.next_post[s][kind] = k + 1
            self.peak[s][kind] = max(self.peak[s][kind], len(self.posted[s][kind]))

    def _take(self, s: int, kind: int, mb: int, action: Action) -> None:
        assert mb in self.posted[s][kind], f"{action} starts but its receive was never posted"
        self.posted[s][kind].remove(mb)
        self._post(s, kind)

    def _send(self, dst: int, kind: int, mb: int, action: Action) -> None:
        assert mb in self.armed[dst][kind], (
            f"{action} sends {'activation' if kind == ACT else 'gradient'} {mb} to stage {dst} before it is posted "
            f"(posted there: {sorted(self.armed[dst][kind])})")
        self.armed[dst][kind].remove(mb)
        self.arrived[dst][kind].add(mb)

    def _movable(self, s: int) -> list[str]:
        """What stage ``s`` can do now: 'start', 'complete' or nothing."""
        if self.started[s] is not None:
            a = self.started[s]
            need = (a.op is Op.F and s > 0 and a.mb not in self.arrived[s][ACT]) or (
                a.op is Op.B and s < self.p - 1 and a.mb not in self.arrived[s][GRAD])
            return [] if need else ["complete"]
        return ["start"] if self.pos[s] < len(self.actions[s]) else []

    def _start(self, s: int) -> None:
        acts, i = self.actions[s], self.pos[s]
        a = acts[i]
        if (a.op is Op.R and s < self.p - 1 and self.held[s] < self.cap[s]
                and a.mb not in self.arrived[s][GRAD]):  # [Note: opportunistic forward]
            j = next((k for k in range(i + 1, len(acts)) if acts[k].op is Op.F), None)
            if j is not None and (s == 0 or acts[j].mb in self.arrived[s][ACT]):
                acts.insert(i, acts.pop(j))
                a = acts[i]
        if a.op is Op.F and s > 0:
            self._take(s, ACT, a.mb, a)
        if a.op is Op.B and s < self.p - 1:
            self._take(s, GRAD, a.mb, a)
        self.started[s] = a

    def _complete(self, s: int) -> None:
        a = self.started[s]
        self.started[s] = None
        self.pos[s] += 1
        if a.op is Op.F:
            self.held[s] += 1
            assert self.held[s] <= self.cap[s]
            if s < self.p - 1:
                self._send(s + 1, ACT, a.mb, a)
        elif a.op is Op.B:
            self.held[s] -= 1
            if s > 0:
                self._send(s - 1, GRAD, a.mb, a)

    def run(self) -> list[tuple[int, int]]:
        while True:
            moves = [(s, m) for s in range(self.p) for m in self._movable(s)]
            if not moves:
                break
            s, move = self.rng.choices(moves, weights=[self.speed[s] for s, _ in moves])[0]
            self._start(s) if move == "start" else self._complete(s)
        assert all(self.pos[s] == len(self.actions[s]) for s in range(self.p)), f"stuck at {self.pos}"
        assert all(not self.posted[s][k] for s in range(self.p) for k in (ACT, GRAD)), "receives left posted"
        return [(a, g) for a, g in self.peak]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_posting_rule_peaks_at_the_ir_count_and_no_send_finds_its_receive_unposted(name: str) -> None:
    rng = random.Random(name)
    for num_stages in range(1, 7):
        for num_mb in range(1, 17):
            schedule = generate(name, num_stages, num_mb)
            want = posted_receives(schedule)
            for trial in range(4):
                got = _Replay(schedule, rng).run()
                assert got == want, (name, num_stages, num_mb, trial, got, want)


def test_window_formulas_per_schedule() -> None:
    """activations: the previous stage's held peak; gradients: the own; 0 where there is no neighbour."""
    for num_stages in range(1, 7):
        last = num_stages - 1
        for num_mb in range(1, 17):
            for name in SCHEDULE_NAMES:
                held = [h for h, _ in inflight(generate(name, num_stages, num_mb))]
                want = [(held[s - 1] if s else 0, held[s] if s < last else 0) for s in range(num_stages)]
                assert posted_receives(generate(name, num_stages, num_mb)) == want
            assert posted_receives(generate("gpipe", num_stages, num_mb)) == [
                (num_mb if s else 0, num_mb if s < last else 0) for s in range(num_stages)]
            assert posted_receives(generate("1f1b", num_stages, num_mb)) == [
                (min(num_stages - s + 1, num_mb) if s else 0, min(num_stages - s, num_mb) if s < last else 0)
                for s in range(num_stages)]
    # varuna: bounded independently of M once M exceeds the held peaks
    for num_stages in range(2, 7):
        assert posted_receives(generate("varuna", num_stages, 32)) == posted_receives(
            generate("varuna", num_stages, 64))


def test_a_neighbour_in_another_order_gets_every_receive_posted() -> None:
    """A hand-written schedule whose stages forward in different orders falls back to posting everything."""
    sched = Schedule("hand", 2, 3, (
        ("0F0", "0F1", "0F2", "0B0", "0B1", "0B2"),
        ("1F1", "1F0", "1B1", "1F2", "1B0", "1B2"),
    ))
    assert posted_receives(sched) == [(0, 3), (3, 0)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_memory_model_charges_the_runtimes_windows(name: str) -> None:
    """The planner derives the windows from its (native) in-flight counts with the function the runtime uses."""
    for num_stages in range(1, 7):
        for num_mb in (1, 2, 5, 16, 40):
            counts = inflight_counts(name, num_stages, num_mb)
            windows = receive_windows([held for held, _ in counts])
            assert windows == posted_receives(generate(name, num_stages, num_mb))
            for act, grad in windows:
                got = stage_bytes(static=0, saved=0, input_bytes=3.0, output_bytes=5.0, held=0, graphs=0,
                                  act_recvs=act, grad_recvs=grad, headroom=0.0)
                assert got == 3.0 * 2 * act + 5.0 * 2 * grad  # posted receives + unwaited sends, per direction
