"""Parity of the C++ extension ``varuna_core._native`` with its pure-Python references.

The extension is built by the normal install (``pip install -e .``), so a missing module is a failure here, not
a skip. References: ``schedule.generate``, ``simulate.simulate_python``, ``inflight.inflight``.
"""

from __future__ import annotations

import random

import pytest

from varuna_core import _native as native  # the extension itself, whatever VARUNA_NO_NATIVE says
from varuna_core.env import NO_NATIVE
from varuna_core.ir.inflight import inflight, inflight_named
from varuna_core.ir.schedule import SCHEDULE_NAMES, Action, Op, Schedule, generate, validate
from varuna_core.planning.simulate import (
    IdleCost,
    StageCosts,
    inflight_counts,
    simulate,
    simulate_generated,
    simulate_python,
    sync_costs,
)

OP_CODE = {Op.F: 0, Op.R: 1, Op.B: 2, Op.W: 3}
OP_NAME = ("F", "R", "B", "W")
SPLIT = ("zb", "varuna-zb")  # the schedules with W actions


def _codes(schedule: Schedule) -> list[list[tuple[int, int]]]:
    return [[(OP_CODE[a.op], a.mb) for a in stage] for stage in schedule.actions]


def _native_sim(schedule: Schedule, costs: list[StageCosts], max_sends: int, opportunistic: bool):
    """simulate_actions with the reference's argument types; the timeline converted to the reference's form."""
    step, pipe, busy, line = native.simulate_actions(
        _codes(schedule), schedule.num_microbatches, [c.as_tuple() for c in costs], max_sends, opportunistic, True)
    return step, pipe, busy, [(s, OP_NAME[o], mb, a, b) for s, o, mb, a, b in line]


def _assert_same(schedule: Schedule, costs: list[StageCosts], max_sends: int, opportunistic: bool):
    ref = simulate_python(schedule, costs, max_concurrent_sends=max_sends, opportunistic=opportunistic,
                          timeline=True)
    step, pipe, busy, line = _native_sim(schedule, costs, max_sends, opportunistic)
    where = (f"{schedule.name} p={schedule.num_stages} m={schedule.num_microbatches} sends={max_sends} "
             f"opportunistic={opportunistic}")
    assert step == pytest.approx(ref.step_time, rel=1e-12, abs=0.0), where
    assert pipe == pytest.approx(ref.pipeline_time, rel=1e-12, abs=0.0), where
    assert busy == pytest.approx(list(ref.busy), rel=1e-12, abs=0.0), where
    assert line == list(ref.timeline), where
    return ref


def _random_costs(rng: random.Random, p: int, *, ties: bool, last_differs: bool) -> list[StageCosts]:
    """Uniform floats, or small integers (ties in the heap and between send channels) when ``ties``."""
    def draw(lo: float, hi: float) -> float:
        return float(rng.randint(int(lo), int(hi))) if ties else rng.uniform(lo, hi)

    out = []
    for _ in range(p):
        f, r, b, w = draw(1, 4), draw(1, 4), draw(2, 8), draw(1, 4)
        sa, sg = draw(0, 3), draw(0, 3)
        last = {}
        if last_differs:
            last = dict(forward_last=f * rng.uniform(0.2, 1.0), recompute_last=r * rng.uniform(0.2, 1.0),
                        backward_last=b * rng.uniform(0.2, 1.0), send_activation_last=sa * rng.uniform(0.2, 1.0),
                        send_gradient_last=sg * rng.uniform(0.2, 1.0), weight_last=w * rng.uniform(0.2, 1.0))
        out.append(StageCosts(f, r, b, sa, sg, draw(0, 5), weight=w, optimizer=draw(0, 2), **last))
    return out


# ---------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_generate_parity(name: str) -> None:
    for p in range(1, 11):
        for m in range(1, 41):
            assert native.generate(name, p, m) == _codes(generate(name, p, m)), (name, p, m)


@pytest.mark.parametrize(("name", "p", "m"), [("pipedream", 2, 2), ("varuna", 0, 3), ("1f1b", 2, 0),
                                              ("gpipe", -1, 1), ("", 1, 1), ("zb", 0, 2), ("varuna-zb", 2, 0),
                                              ("zb-h2", 2, 2)])
def test_generate_rejects_bad_input(name: str, p: int, m: int) -> None:
    with pytest.raises(ValueError):
        native.generate(name, p, m)
    with pytest.raises(ValueError):
        native.inflight(name, p, m)
    with pytest.raises(ValueError):
        native.simulate_generated(name, p, m, [StageCosts(1, 1, 1).as_tuple()] * max(p, 1), 1, False)


# ---------------------------------------------------------------------------------------------- simulate


@pytest.mark.parametrize("seed", range(16))
def test_simulate_actions_parity_random(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(15):
        schedule = generate(rng.choice(SCHEDULE_NAMES), rng.randint(1, 8), rng.randint(1, 24))
        costs = _random_costs(rng, schedule.num_stages, ties=rng.random() < 0.4, last_differs=rng.random() < 0.3)
        for max_sends in (1, 2, 4):
            for opportunistic in (False, True):
                _assert_same(schedule, costs, max_sends, opportunistic)


def test_simulate_last_microbatch_costs() -> None:
    rng = random.Random(7)
    for name in SCHEDULE_NAMES:
        costs = [StageCosts(2.0, 1.5, 4.0, 0.5, 0.7, 1.0, forward_last=0.5, recompute_last=0.25, backward_last=1.0,
                            send_activation_last=0.1, send_gradient_last=0.2, weight=1.25, weight_last=0.3)
                 for _ in range(4)]
        ref = _assert_same(generate(name, 4, 6), costs, 2, name == "varuna")
        plain = simulate_python(generate(name, 4, 6), [StageCosts(2.0, 1.5, 4.0, 0.5, 0.7, 1.0, weight=1.25)] * 4,
                                opportunistic=name == "varuna")
        assert ref.pipeline_time < plain.pipeline_time  # the *_last values were used
        _assert_same(generate(name, 5, 9), _random_costs(rng, 5, ties=False, last_differs=True), 1, True)


def test_opportunistic_swap_happens_and_matches() -> None:
    # Slow later stages: stage s < 3 reaches its R before the gradient is back while the next activation is
    # already there, so the forward runs first.
    costs = [StageCosts(1.0, 1.0, 2.0, 0.1, 0.1), StageCosts(1.0, 1.0, 2.0, 0.1, 0.1),
             StageCosts(3.0, 3.0, 6.0, 0.1, 0.1), StageCosts(4.0, 0.0, 8.0, 0.1, 0.1)]
    schedule = generate("varuna", 4, 10)
    swapped = _assert_same(schedule, costs, 1, True)
    static = _assert_same(schedule, costs, 1, False)
    assert swapped.timeline != static.timeline

    def order(result, s):
        return [(op, mb) for st, op, mb, _, _ in sorted(result.timeline, key=lambda e: e[3]) if st == s]

    static_order = [[(a.op.value, a.mb) for a in stage] for stage in schedule.actions]
    assert all(order(static, s) == static_order[s] for s in range(4))
    assert any(order(swapped, s) != static_order[s] for s in range(4))  # some F moved before an R
    for s in range(4):  # only forwards move
        assert [x for x in order(swapped, s) if x[0] != "F"] == [x for x in static_order[s] if x[0] != "F"]


def test_simulate_swap_random_heterogeneous() -> None:
    """Heterogeneous stages on varuna schedules: parity holds, and the swap does change some runs."""
    rng = random.Random(1234)
    changed = 0
    for _ in range(30):
        p, m = rng.randint(2, 8), rng.randint(2, 24)
        costs = [StageCosts(rng.uniform(0.5, 1) * k, rng.uniform(0.5, 1) * k, rng.uniform(1, 2) * k,
                            rng.uniform(0, 0.5), rng.uniform(0, 0.5), rng.uniform(0, 2))
                 for k in (rng.choice((1.0, 2.0, 5.0)) for _ in range(p))]
        for sends in (1, 2, 4):
            a = _assert_same(generate("varuna", p, m), costs, sends, True)
            b = _assert_same(generate("varuna", p, m), costs, sends, False)
            changed += a.timeline != b.timeline
    assert changed > 0


def test_simulate_via_public_api_both_backends() -> None:
    rng = random.Random(3)
    for name in SCHEDULE_NAMES:
        schedule = generate(name, 5, 12)
        costs = _random_costs(rng, 5, ties=False, last_differs=True)
        py = simulate(schedule, costs, backend="python", timeline=True, max_concurrent_sends=2)
        cc = simulate(schedule, costs, backend="native", timeline=True, max_concurrent_sends=2)
        assert cc == py


def test_simulate_generated_matches_simulate_actions() -> None:
    rng = random.Random(99)
    for _ in range(60):
        name, p, m = rng.choice(SCHEDULE_NAMES), rng.randint(1, 8), rng.randint(1, 32)
        costs = [c.as_tuple() for c in _random_costs(rng, p, ties=rng.random() < 0.5,
                                                      last_differs=rng.random() < 0.5)]
        for sends in (0, 1, 2, 4):
            for opportunistic in (False, True):
                full = native.simulate_actions(native.generate(name, p, m), m, costs, sends, opportunistic, False)
                assert full[3] is None
                assert native.simulate_generated(name, p, m, costs, sends, opportunistic) == tuple(full[:3])


def test_simulate_sparse_microbatch_numbers() -> None:
    """Hand-written schedules may number micro-batches arbitrarily; the reference keys them in dicts."""
    relabel = {0: 3, 1: 100, 2: -5, 3: 7, 4: 2}  # 3 == m - 1 gets the *_last costs although it is not last
    base = generate("varuna", 3, 5)
    schedule = Schedule("relabelled", 3, 4, tuple(tuple(Action(a.stage, a.op, relabel[a.mb]) for a in stage)
                                                  for stage in base.actions))
    costs = _random_costs(random.Random(5), 3, ties=False, last_differs=True)
    for sends in (1, 2):
        for opportunistic in (False, True):
            _assert_same(schedule, costs, sends, opportunistic)


def test_simulate_deadlock_same_error() -> None:
    schedule = Schedule("bad", 2, 1, ((Action(0, Op.B, 0), Action(0, Op.F, 0)),
                                      (Action(1, Op.F, 0), Action(1, Op.B, 0))))
    costs = [StageCosts(1, 1, 1)] * 2
    with pytest.raises(ValueError) as ref:
        simulate_python(schedule, costs)
    with pytest.raises(ValueError) as got:
        native.simulate_actions(_codes(schedule), 1, [c.as_tuple() for c in costs], 4, False, False)
    assert str(got.value) == str(ref.value) == "schedule deadlocks in simulation; stuck at 0B0, 1F0"


def test_simulate_rejects_bad_costs() -> None:
    actions = native.generate("1f1b", 3, 4)
    with pytest.raises(ValueError, match="2 stage costs for 3 stages"):
        native.simulate_actions(actions, 4, [StageCosts(1, 1, 1).as_tuple()] * 2, 1, False, False)
    with pytest.raises(ValueError, match="2 stage costs for 3 stages"):
        native.simulate_generated("1f1b", 3, 4, [StageCosts(1, 1, 1).as_tuple()] * 2, 1, False)
    with pytest.raises(ValueError, match="expected 14"):
        native.simulate_generated("1f1b", 3, 4, [(1.0, 2.0, 3.0)] * 3, 1, False)
    eleven = StageCosts(1, 1, 1).as_tuple()[:11]  # the rows before W had costs
    with pytest.raises(ValueError, match="stage 0 has 11 cost numbers, expected 14"):
        native.simulate_generated("zb", 3, 4, [eleven] * 3, 1, False)
    with pytest.raises(ValueError, match="has 15 cost numbers, expected 14"):
        native.simulate_actions(actions, 4, [StageCosts(1, 1, 1).as_tuple() + (1.0,)] * 3, 1, False, False)
    for op in (4, -1):
        with pytest.raises(ValueError, match=r"op must be 0 \(F\), 1 \(R\), 2 \(B\) or 3 \(W\)"):
            native.simulate_actions([[(op, 0)]], 1, [StageCosts(1, 1, 1).as_tuple()], 1, False, False)


@pytest.mark.parametrize("seed", range(6))
def test_simulate_weight_costs_random_split_schedules(seed: int) -> None:
    """zb and varuna-zb on random heterogeneous costs with distinct weight/weight_last: both simulators give the
    same results and timelines, and every W takes its stage's weight (weight_last for the last micro-batch)."""
    rng = random.Random(100 + seed)
    for _ in range(8):
        name, p, m = rng.choice(SPLIT), rng.randint(1, 8), rng.randint(1, 24)
        schedule = generate(name, p, m)
        costs = [StageCosts(rng.uniform(0.5, 1) * k, rng.uniform(0.5, 1) * k, rng.uniform(0.5, 1) * k,
                            rng.uniform(0, 0.5), rng.uniform(0, 0.5), rng.uniform(0, 2),
                            weight=rng.uniform(0.2, 1.5) * k, weight_last=rng.uniform(0.05, 0.2) * k)
                 for k in (rng.choice((1.0, 2.0, 5.0)) for _ in range(p))]
        for sends in (1, 4):
            for opportunistic in (False, True):
                ref = _assert_same(schedule, costs, sends, opportunistic)
                assert ref.timeline is not None
                weights = [(s, mb, end - start) for s, op, mb, start, end in ref.timeline if op == "W"]
                assert sorted((s, mb) for s, mb, _ in weights) == [(s, mb) for s in range(p) for mb in range(m)]
                for s, mb, took in weights:
                    c = costs[s]
                    assert took == pytest.approx(c.weight_last if mb == m - 1 else c.weight, rel=1e-9)
                native_busy = native.simulate_generated(name, p, m, [c.as_tuple() for c in costs], sends,
                                                        opportunistic)[2]
                assert native_busy == pytest.approx(list(ref.busy), rel=1e-12, abs=0.0)
                for s, c in enumerate(costs):  # every action's cost once; the W ones included
                    rec = schedule.uses_recompute(s)
                    expected = ((m - 1) * (c.forward + c.backward + c.weight + (c.recompute if rec else 0.0))
                                + c.duration(Op.F, True) + c.duration(Op.B, True) + c.duration(Op.W, True)
                                + (c.duration(Op.R, True) if rec else 0.0))
                    assert ref.busy[s] == pytest.approx(expected, rel=1e-9), (name, p, m, s)


HAND_WRITTEN_W = """
# hand-w stages=2 microbatches=3
0: 0F0 0R0 0B0 0W0 0F1 0F2 0R1 0B1 0R2 0B2 0W1 0W2
1: 1F0 1B0 1W0 1F1 1B1 1F2 1B2 1W2 1W1
"""


def test_simulate_hand_written_schedule_with_w() -> None:
    """A hand-written schedule with W (out of micro-batch order on stage 1) and R: identical in both simulators.
    Stage 0 holds two micro-batches at its peak although its W0 comes before: W does not lower the count that
    caps the opportunistic forward, so F1 runs before R0 (its gradient is not back yet)."""
    schedule = Schedule.from_text(HAND_WRITTEN_W)
    validate(schedule)
    assert inflight(schedule) == [(2, 1), (1, 1)]
    costs = [StageCosts(1.0, 1.0, 2.0, 0.5, 0.5, 0.25, weight=1.5, weight_last=0.75),
             StageCosts(2.0, 0.0, 3.0, 0.5, 0.5, 0.5, weight=1.25, weight_last=0.5)]
    for sends in (1, 2):
        static = _assert_same(schedule, costs, sends, False)
        swapped = _assert_same(schedule, costs, sends, True)
        assert static.timeline is not None and swapped.timeline is not None

        def order(result, s):
            return " ".join(f"{op}{mb}" for st, op, mb, _, _ in sorted(result.timeline, key=lambda e: e[3])
                            if st == s)

        assert order(static, 0) == "F0 R0 B0 W0 F1 F2 R1 B1 R2 B2 W1 W2"
        assert order(swapped, 0) == "F0 F1 R0 B0 W0 F2 R1 B1 R2 B2 W1 W2"
        assert order(static, 1) == order(swapped, 1) == "F0 B0 W0 F1 B1 F2 B2 W2 W1"
        assert [end - start for s, op, mb, start, end in static.timeline if (s, op) == (1, "W")] == [1.25, 0.5, 1.25]


def test_timeline_has_w_entries() -> None:
    """The native timeline codes W as 3, and simulate() names it "W", as the reference does."""
    schedule = generate("varuna-zb", 3, 5)
    costs = [StageCosts(1.0, 0.5, 1.0, 0.1, 0.1, weight=0.75)] * 3
    _, _, _, raw = native.simulate_actions(_codes(schedule), 5, [c.as_tuple() for c in costs], 4, True, True)
    assert raw is not None and sum(1 for _, op, _, _, _ in raw if op == 3) == 15
    for backend in ("native", "python"):
        line = simulate(schedule, costs, timeline=True, backend=backend).timeline
        assert line is not None
        weights = [(s, mb) for s, op, mb, _, _ in line if op == "W"]
        assert sorted(weights) == [(s, mb) for s in range(3) for mb in range(5)], backend
        assert {op for _, op, _, _, _ in line} == {"F", "R", "B", "W"}, backend


# ---------------------------------------------------------------------------------------------- inflight


def test_inflight_parity_and_closed_forms() -> None:
    for name in SCHEDULE_NAMES:
        for p in range(1, 11):
            for m in range(1, 41):
                schedule = generate(name, p, m)
                got = [tuple(x) for x in native.inflight(name, p, m)]
                assert got == inflight(schedule) == inflight_named(name, p, m), (name, p, m)
                if name == "1f1b":
                    assert got == [(min(p - s, m), min(p - s, m)) for s in range(p)]
                elif name == "gpipe":
                    assert got == [(m, m)] * p
                else:
                    for s in range(p):
                        if schedule.uses_recompute(s):
                            assert got[s][1] == 1, (p, m, s)


# ---------------------------------------------------------------------------------------------- golden


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 5), (2, 1), (2, 4), (3, 8), (4, 4), (4, 16), (8, 3), (8, 32)])
def test_balanced_bubble_closed_form(name: str, p: int, m: int) -> None:
    costs = [StageCosts(forward=1.0, recompute=0.0, backward=2.0)] * p
    expected = (p - 1) / (m + p - 1)
    for backend in ("python", "native"):
        result = simulate(generate(name, p, m), costs, backend=backend)
        assert result.bubble_fraction == pytest.approx(expected, rel=1e-12, abs=1e-15), backend
        assert result.pipeline_time == pytest.approx(3.0 * (m + p - 1), rel=1e-12)
    _, pipe, busy = native.simulate_generated(name, p, m, [c.as_tuple() for c in costs], 4, False)
    assert 1.0 - sum(busy) / (p * pipe) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_split_backward_closed_form(p: int, k: int) -> None:
    """F = B = W = 1, free communication: zb's pipeline takes 3M + (S-1) (its bubble is (S-1)(F+B-W)), 1F1B's
    with the whole backward (2) 3M + 3(S-1), for M in {S, 2S, 4S}."""
    m = k * p
    zb = [StageCosts(forward=1.0, recompute=0.0, backward=1.0, weight=1.0)] * p
    one_f_one_b = [StageCosts(forward=1.0, recompute=0.0, backward=2.0)] * p
    for backend in ("python", "native"):
        assert simulate(generate("zb", p, m), zb, backend=backend).pipeline_time == 3 * m + (p - 1), backend
        assert simulate(generate("1f1b", p, m), one_f_one_b, backend=backend).pipeline_time == 3 * m + 3 * (p - 1)
    assert native.simulate_generated("zb", p, m, [c.as_tuple() for c in zb], 4, False)[1] == 3 * m + (p - 1)
    assert native.simulate_generated("1f1b", p, m, [c.as_tuple() for c in one_f_one_b], 4, False)[1] == (
        3 * m + 3 * (p - 1))


# ---------------------------------------------------------------------------------------------- the switch


@pytest.mark.parametrize("no_native", ["0", "1"])
def test_planner_calls_agree_with_and_without_the_extension(monkeypatch, no_native: str) -> None:
    """``simulate_generated`` and ``inflight_counts`` give the reference's answers whichever backend the switch
    (``VARUNA_NO_NATIVE``) picks."""
    monkeypatch.setenv(NO_NATIVE, no_native)
    rng = random.Random(11)
    for name in SCHEDULE_NAMES:
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        costs = _random_costs(rng, p, ties=False, last_differs=True)
        ref = simulate_python(generate(name, p, m), costs, max_concurrent_sends=2, opportunistic=True)
        assert simulate_generated(name, p, m, costs, max_concurrent_sends=2) == ref
        assert inflight_counts(name, p, m) == inflight(generate(name, p, m))


def test_every_simulator_defaults_to_what_the_runtime_does() -> None:
    """simulate() applied the opportunistic forward by default and simulate_python() did not: the reference and
    the planner's simulator disagreed on the same call."""
    import inspect

    from varuna_core.planning.simulate import OPPORTUNISTIC, simulate, simulate_generated

    costs = [StageCosts(1.0, 1.0, 2.0, 0.1, 0.1), StageCosts(1.0, 1.0, 2.0, 0.1, 0.1),
             StageCosts(3.0, 3.0, 6.0, 0.1, 0.1), StageCosts(4.0, 0.0, 8.0, 0.1, 0.1)]
    schedule = generate("varuna", 4, 10)  # a schedule whose forwards move (test_opportunistic_swap_happens...)
    reference = simulate_python(schedule, costs, timeline=True)
    assert reference == simulate(schedule, costs, timeline=True, backend="python")
    assert reference == simulate_python(schedule, costs, timeline=True, opportunistic=OPPORTUNISTIC)
    assert reference == simulate(schedule, costs, timeline=True, backend="native")
    assert simulate_generated("varuna", 4, 10, costs).step_time == reference.step_time
    for function in (simulate, simulate_generated, simulate_python):
        assert inspect.signature(function).parameters["opportunistic"].default is OPPORTUNISTIC is True


@pytest.mark.parametrize("backend", ["python", "native"])
def test_the_allreduce_starts_with_the_last_backward(backend: str) -> None:
    """As the runtime posts its buckets during the last backward (varuna_core.pipeline.overlap), a stage's
    all-reduce starts with its last B (its last W when the backward is split) and overlaps the rest of it; the
    optimizer's step follows both."""
    # one stage, 1F1B over two micro-batches: F0 0-1, B0 1-3, F1 3-4, B1 4-6
    one = generate("1f1b", 1, 2)
    for allreduce, step in ((1.5, 6.0), (3.0, 7.0)):  # hidden in B1, or B1's start + the all-reduce
        costs = [StageCosts(1.0, 0.0, 2.0, allreduce=allreduce, optimizer=0.5)]
        result = simulate(one, costs, backend=backend)
        assert (result.pipeline_time, result.step_time) == (6.0, step + 0.5), allreduce
    # split: the last W is the last backward action (F0 0-1, B0 1-3, W0 3-4, F1 4-5, B1 5-7, W1 7-8)
    split = generate("zb", 1, 2)
    costs = [StageCosts(1.0, 0.0, 2.0, allreduce=2.5, optimizer=0.0, weight=1.0)]
    assert simulate(split, costs, backend=backend).step_time == 9.5
    # a sharded optimizer's collectives run after the pipeline: charged with the optimizer's step
    costs = [StageCosts(1.0, 0.0, 2.0, **sync_costs(1.5, 0.5, sharded=True))]
    assert simulate(one, costs, backend=backend).step_time == 8.0


# ---------------------------------------------------------------------------------------------- idle penalty


def test_idle_fraction_interpolates_and_saturates() -> None:
    idle = IdleCost((0.002, 0.005, 0.02), (0.1, 0.2, 0.3), action_s=0.003)
    assert idle.fraction(0.0) == 0.0 and idle.fraction(-1.0) == 0.0
    assert idle.fraction(0.001) == pytest.approx(0.05)  # linear from (0, 0) to the first point
    assert idle.fraction(0.0035) == pytest.approx(0.15)
    assert idle.fraction(0.02) == pytest.approx(0.3) and idle.fraction(5.0) == pytest.approx(0.3)
    assert idle.penalty(0.02, 0.001) == pytest.approx(0.3 * 0.001)  # a short action: its own time
    assert idle.penalty(0.02, 0.010) == pytest.approx(0.3 * 0.003)  # a long one: the measured action's
    for bad in (((), ()), ((0.0,), (0.1,)), ((0.002, 0.001), (0.1, 0.2)), ((0.001,), (-0.1,)), ((0.001,), ())):
        with pytest.raises(ValueError):
            IdleCost(*bad, action_s=0.003)
    with pytest.raises(ValueError):
        IdleCost((0.001,), (0.1,), action_s=0.0)


def _random_idle(rng: random.Random) -> IdleCost:
    gaps = sorted(rng.sample([0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 20.0], rng.randint(1, 4)))
    return IdleCost(tuple(gaps), tuple(rng.uniform(0, 0.6) for _ in gaps), action_s=rng.uniform(0.5, 6.0))


@pytest.mark.parametrize("seed", range(8))
def test_idle_penalty_parity_random(seed: int) -> None:
    """Both simulators charge the same penalty: every number equal, timelines included, on every schedule."""
    rng = random.Random(500 + seed)
    for _ in range(10):
        schedule = generate(rng.choice(SCHEDULE_NAMES), rng.randint(1, 6), rng.randint(1, 16))
        costs = _random_costs(rng, schedule.num_stages, ties=rng.random() < 0.4, last_differs=rng.random() < 0.3)
        idle = _random_idle(rng)
        for opportunistic in (False, True):
            ref = simulate_python(schedule, costs, max_concurrent_sends=2, opportunistic=opportunistic,
                                  timeline=True, idle=idle)
            step, pipe, busy, line = native.simulate_actions(
                _codes(schedule), schedule.num_microbatches, [c.as_tuple() for c in costs], 2, opportunistic, True,
                *idle.as_args())
            assert step == pytest.approx(ref.step_time, rel=1e-12, abs=0.0)
            assert pipe == pytest.approx(ref.pipeline_time, rel=1e-12, abs=0.0)
            assert busy == pytest.approx(list(ref.busy), rel=1e-12, abs=0.0)
            assert [(s, OP_NAME[o], mb) for s, o, mb, _, _ in line] == [e[:3] for e in ref.timeline]
            assert [t for *_, a, b in line for t in (a, b)] == pytest.approx(
                [t for *_, a, b in ref.timeline for t in (a, b)], rel=1e-12, abs=0.0)
            generated = simulate_generated(schedule.name, schedule.num_stages, schedule.num_microbatches, costs,
                                           max_concurrent_sends=2, opportunistic=opportunistic, idle=idle)
            assert generated.step_time == pytest.approx(ref.step_time, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_idle_penalty_by_hand(backend: str) -> None:
    """gpipe over two stages, F = 1, B = 2, messages 1: stage 1 idles 2 before its first forward (pays 0.2 of
    it) and stage 0 idles 5.2 before its backward (pays 0.2 of min(2, action_s = 1))."""
    costs = [StageCosts(1.0, 1.0, 2.0, send_activation=1.0, send_gradient=1.0)] * 2
    idle = IdleCost((1.0, 2.0), (0.1, 0.2), action_s=1.0)
    line = simulate(generate("gpipe", 2, 1), costs, timeline=True, backend=backend, idle=idle).timeline
    assert line is not None
    spans = {(s, op): (a, b) for s, op, _, a, b in line}
    assert spans[(0, "F")] == pytest.approx((0.0, 1.0))        # no gap before the first action of stage 0
    assert spans[(1, "F")] == pytest.approx((2.0, 3.2))        # waited 2: +0.2 · min(1, 1)
    assert spans[(1, "B")] == pytest.approx((3.2, 5.2))        # right after its forward: no penalty
    assert spans[(0, "B")] == pytest.approx((6.2, 8.4))        # waited 6.2 - 1 = 5.2: +0.2 · min(2, 1)
    plain = simulate(generate("gpipe", 2, 1), costs, timeline=True, backend=backend).timeline
    assert plain is not None and max(b for *_, b in plain) == pytest.approx(8.0)


def test_native_refuses_bad_idle_lists() -> None:
    costs = [StageCosts(1, 1, 1).as_tuple()] * 2
    for gaps, fractions, action in (([0.1], [], 1.0), ([0.0], [0.1], 1.0), ([0.2, 0.1], [0.1, 0.1], 1.0),
                                    ([0.1], [-0.1], 1.0), ([0.1], [0.1], 0.0), ([float("nan")], [0.1], 1.0),
                                    ([0.1], [float("inf")], 1.0)):
        with pytest.raises(ValueError, match="idle"):
            native.simulate_generated("1f1b", 2, 2, costs, 1, False, gaps, fractions, action)
