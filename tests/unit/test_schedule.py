"""Tests of the schedule IR, the generators (golden files) and the deadlock/structure validator."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

from varuna_core.errors import ConfigError, ScheduleError
from varuna_core.ir.inflight import inflight, inflight_named, pending_weights
from varuna_core.ir.schedule import (
    SCHEDULE_NAMES,
    Action,
    Op,
    Schedule,
    check_schedule,
    generate,
    recompute_stages,
    validate,
)

GOLDEN_DIR = pathlib.Path(__file__).resolve().parents[1] / "golden" / "schedules"
GOLDEN_CASES = [("varuna", 4, 10), ("varuna", 2, 5), ("varuna", 1, 3), ("1f1b", 4, 8), ("1f1b", 3, 2), ("gpipe", 3, 4),
                ("zb", 4, 8), ("zb", 3, 2), ("varuna-zb", 4, 8), ("varuna-zb", 2, 5)]
SPLIT = ("zb", "varuna-zb")  # the schedules that split the backward into B and W
RECOMPUTE = ("varuna", "varuna-zb")

# Output of the original genschedule for 4 stages x 10 micro-batches (verified in varuna-original.md §3.1).
VARUNA_4x10 = [
    "F0 F1 F2 F3 F4 F5 F6 F7 F8 R0 B0 R1 B1 R2 B2 F9 R3 B3 R4 B4 R5 B5 R6 B6 R7 B7 R8 B8 R9 B9",
    "F0 F1 F2 F3 F4 F5 R0 B0 R1 B1 R2 B2 F6 F7 F8 R3 B3 R4 B4 R5 B5 F9 R6 B6 R7 B7 R8 B8 R9 B9",
    "F0 F1 F2 R0 B0 R1 B1 R2 B2 F3 F4 F5 R3 B3 R4 B4 R5 B5 F6 F7 F8 R6 B6 R7 B7 R8 B8 F9 R9 B9",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 F8 B8 F9 B9",
]


def _short(schedule: Schedule, stage: int) -> str:
    return " ".join(f"{a.op.value}{a.mb}" for a in schedule.stage_actions(stage))


def _make(name: str, num_mb: int, *stages: str) -> Schedule:
    return Schedule(name, len(stages), num_mb, tuple(tuple(Action.parse(t) for t in s.split()) for s in stages))


# ---------------------------------------------------------------------------------------------- golden


@pytest.mark.parametrize(("name", "stages", "mbs"), GOLDEN_CASES)
def test_golden(name: str, stages: int, mbs: int) -> None:
    path = GOLDEN_DIR / f"{name}_s{stages}_m{mbs}.txt"
    text = generate(name, stages, mbs).to_text()
    if os.environ.get("VARUNA_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text


def test_varuna_matches_original_4x10() -> None:
    schedule = generate("varuna", 4, 10)
    assert [_short(schedule, s) for s in range(4)] == VARUNA_4x10


def test_varuna_2x5_and_single_stage() -> None:
    schedule = generate("varuna", 2, 5)
    assert _short(schedule, 1) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    assert _short(generate("varuna", 1, 3), 0) == "F0 B0 F1 B1 F2 B2"


def test_1f1b_explicit() -> None:
    schedule = generate("1f1b", 4, 8)
    assert _short(schedule, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _short(schedule, 1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert _short(schedule, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    small = generate("1f1b", 3, 2)  # warm-up is capped at M
    assert [_short(small, s) for s in range(3)] == ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]


def test_zb_explicit() -> None:
    """ZB-H1: 1F1B's order with stage s's W s places behind their B, and the drain's B, W pairs."""
    schedule = generate("zb", 4, 8)
    assert _short(schedule, 0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert _short(schedule, 1) == "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7"
    assert _short(schedule, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"



def test_varuna_zb_explicit() -> None:
    """varuna-zb: varuna's order (its forwards ahead, R right before each B but on the last stage), with stage s's
    W s places behind their B, the rest after the last B."""
    for p, m in ((2, 3), (4, 8), (3, 10)):
        split, plain = generate("varuna-zb", p, m), generate("varuna", p, m)
        for s in range(p):
            assert [a for a in split.stage_actions(s) if a.op is not Op.W] == list(plain.stage_actions(s))
    assert [_short(generate("varuna-zb", 2, 3), s) for s in range(2)] == ["F0 F1 F2 R0 B0 W0 R1 B1 W1 R2 B2 W2",
                                                                           "F0 B0 F1 B1 W0 F2 B2 W1 W2"]


@pytest.mark.parametrize("name", SPLIT)
def test_split_schedules_hold_what_the_docstring_says(name: str) -> None:
    """Graphs as 1F1B (or one at a time under recompute), and at most s+1 micro-batches waiting for W on
    stage s: no stage holds more than 1F1B's first stage."""
    for p in range(1, 9):
        for m in range(1, 17):
            schedule = generate(name, p, m)
            graphs = [g for _, g in inflight(schedule)]
            assert graphs == ([g for _, g in inflight(generate("1f1b", p, m))] if name == "zb" else [1] * p)
            pending = pending_weights(schedule)
            assert all(1 <= n <= s + 1 for s, n in enumerate(pending)), (name, p, m, pending)
            if m >= p:
                assert pending == [s + 1 for s in range(p)], (name, p, m, pending)
            assert pending_weights(generate("1f1b", p, m)) == [0] * p


@pytest.mark.parametrize(("text", "match"), [
    (("0F0 0B0 0W0", "1F0 1B0"), "stage 1 misses W of micro-batch 0"),
    (("0F0 0B0 0W0 0W0", "1F0 1B0 1W0"), "stage 0 has 2 times W of micro-batch 0"),
    (("0F0 0W0 0B0", "1F0 1B0 1W0"), "W of micro-batch 0 at position 1, before its B"),
])
def test_a_split_schedule_needs_one_w_after_each_b(text: tuple[str, ...], match: str) -> None:
    with pytest.raises(ScheduleError, match=match) as info:
        validate(_make("split", 1, *text))
    assert "one W after each B" in info.value.hint


def test_gpipe_explicit() -> None:
    schedule = generate("gpipe", 3, 4)
    assert all(_short(schedule, s) == "F0 F1 F2 F3 B0 B1 B2 B3" for s in range(3))
    assert not any(schedule.uses_recompute(s) for s in range(3))


# ---------------------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_all_sizes_validate(name: str) -> None:
    for stages in range(1, 9):
        for mbs in range(1, 17):
            schedule = generate(name, stages, mbs)
            validate(schedule)
            for s in range(stages):
                acts = schedule.stage_actions(s)
                assert all(a.stage == s for a in acts)
                for op in (Op.F, Op.B, Op.W) if name in SPLIT else (Op.F, Op.B):
                    assert sorted(a.mb for a in acts if a.op is op) == list(range(mbs))
                assert schedule.splits_backward == (name in SPLIT)
                uses_r = schedule.uses_recompute(s)
                assert uses_r == (name in RECOMPUTE and s < stages - 1)
                if uses_r:
                    assert sorted(a.mb for a in acts if a.op is Op.R) == list(range(mbs))


def test_varuna_ops_in_increasing_mb_order_and_r_before_b() -> None:
    for stages in range(1, 9):
        for mbs in range(1, 17):
            schedule = generate("varuna", stages, mbs)
            for s in range(stages):
                acts = schedule.stage_actions(s)
                for op in Op:
                    mb_order = [a.mb for a in acts if a.op is op]
                    assert mb_order == sorted(mb_order)
                for i, a in enumerate(acts):  # every non-last stage emits R k immediately followed by B k
                    if a.op is Op.R:
                        assert acts[i + 1] == Action(s, Op.B, a.mb)


def test_varuna_large_m_is_not_truncated() -> None:
    # The original stopped after 20000 quanta; 8000 micro-batches need more than that.
    schedule = generate("varuna", 2, 8000)
    assert len(schedule.stage_actions(0)) == 3 * 8000
    assert schedule.stage_actions(1)[-1] == Action(1, Op.B, 7999)


def test_generate_errors() -> None:
    with pytest.raises(ConfigError) as info:  # a name is what the user gave: bad input, exit code 2
        generate("zero-bubble", 2, 2)
    assert "zero-bubble" in str(info.value) and all(n in info.value.hint for n in SCHEDULE_NAMES)
    for stages, mbs in ((0, 4), (4, 0), (-1, 1)):
        with pytest.raises(ScheduleError, match="at least 1"):
            generate("varuna", stages, mbs)


def test_no_torch_import() -> None:
    import subprocess

    code = (
        "import sys, varuna_core.ir.schedule, varuna_core.ir.topology, varuna_core.ir.partition;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------- text forms


def test_action_round_trip() -> None:
    for action in (Action(0, Op.F, 0), Action(12, Op.R, 345), Action(3, Op.B, 7)):
        assert Action.parse(str(action)) == action
    assert str(Action(2, Op.F, 0)) == "2F0"
    assert Action.parse(" 1B2 ") == Action(1, Op.B, 2)


@pytest.mark.parametrize("text", ["", "F0", "0X1", "0F", "-1F0", "0 F 1", "0f1", "0F1x"])
def test_action_parse_errors(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


@pytest.mark.parametrize(("name", "stages", "mbs"), GOLDEN_CASES)
def test_schedule_text_round_trip(name: str, stages: int, mbs: int) -> None:
    schedule = generate(name, stages, mbs)
    text = schedule.to_text()
    assert text.splitlines()[0] == f"# {name} stages={stages} microbatches={mbs}"
    assert text.splitlines()[1].startswith("0: 0F0 ")
    assert Schedule.from_text(text) == schedule


def test_from_text_tolerates_comments_and_order() -> None:
    text = "# my sched stages=2 microbatches=1\n\n# comment\n1: 1F0 1B0\n0: 0F0 0B0\n"
    schedule = Schedule.from_text(text)
    assert schedule.name == "my sched" and schedule.num_stages == 2
    validate(schedule)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "header"),
        ("0: 0F0 0B0", "header"),
        ("# x stages=1 microbatches=1\n0 0F0 0B0", "bad schedule line"),
        ("# x stages=1 microbatches=1\n0: 0F0 0Q0", "cannot parse action"),
        ("# x stages=2 microbatches=1\n0: 0F0 0B0", r"no line for stage\(s\) \[1\]"),
        ("# x stages=1 microbatches=1\n0: 0F0\n0: 0B0", "appears twice"),
        ("# x stages=1 microbatches=1\n3: 3F0", "stages=1"),
        ("# x stages=0 microbatches=1\n", "at least 1"),
    ],
)
def test_from_text_errors(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_text(text)


def test_schedule_construction_errors() -> None:
    with pytest.raises(ScheduleError, match="2 stages but has 1 action lists"):
        Schedule("x", 2, 1, ((Action(0, Op.F, 0),),))
    with pytest.raises(ScheduleError, match="not an action"):
        Schedule("x", 1, 1, ((1, 2),))
    with pytest.raises(ScheduleError, match="stage 5 out of range"):
        generate("gpipe", 2, 2).stage_actions(5)


def test_grid() -> None:
    grid = generate("1f1b", 2, 2).grid().splitlines()
    assert grid[0].split() == ["step", "|", "0", "1"]
    assert grid[1].split() == ["0", "|", "F0", "."]
    assert grid[2].split() == ["1", "|", "F1", "F0"]
    assert grid[3].split() == ["2", "|", ".", "B0"]
    assert len(grid) == 1 + 6


# ---------------------------------------------------------------------------------------------- broken


def test_deadlock_backward_before_forward() -> None:
    schedule = _make("bad", 2, "0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1")
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    msg = str(info.value)
    assert "deadlocks at step 2" in msg
    assert "stage 1 is blocked at 1B0, waiting for 1F0" in msg
    assert "stage 0 is blocked at 0B0, waiting for 1B0" in msg
    assert "step | 0" in msg and "<-- stuck" in msg
    stuck = next(ln for ln in msg.splitlines() if "<-- stuck" in ln)
    assert stuck.split()[:4] == ["stuck", "|", "B0", "B0"]
    assert "<-- stuck" in schedule.grid()


def test_deadlock_cycle_across_stages() -> None:
    # Stage 0 waits for 1B0, which stage 1 only runs after 1F1, which needs 0F1, which stage 0 runs after 0B0.
    schedule = _make("cycle", 2, "0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    msg = str(info.value)
    assert "stage 0 is blocked at 0B0, waiting for 1B0 (stage 1 runs it at position 2, after its blocked 1F1)" in msg
    assert "stage 1 is blocked at 1F1, waiting for 0F1 (stage 0 runs it at position 2, after its blocked 0B0)" in msg
    assert "<-- stuck" in msg
    assert info.value.hint


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        (("0F0 0F1 0B0 0B1", "1F0 1B0 1F1"), "stage 1 misses B of micro-batch 1"),
        (("0F0 0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"), "stage 0 has 2 times F of micro-batch 0"),
        (("0F0 0F1 0B0 0R0 0B1", "1F0 1B0 1F1 1B1"), "R of micro-batch 0 at position 3, not between"),
        (("0F0 0R0 0R0 0B0", "1F0 1B0"), "recomputes micro-batch 0 2 times"),
        (("0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1B0 1F1 1B1"), "micro-batch 2 outside 0..1"),
        (("0F0 0F1 0B0 0B1", "1F0 0B0 1F1 1B1"), "holds 0B0, an action of stage 0"),
    ],
)
def test_malformed_schedules(stages: tuple[str, ...], match: str) -> None:
    schedule = _make("broken", 2, *stages)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    assert "step | 0" in str(info.value)  # the grid is always attached


def test_recompute_allowed_on_last_stage() -> None:
    validate(_make("r-last", 2, "0F0 0F1 0B0 0B1", "1F0 1F1 1R0 1B0 1R1 1B1"))
    validate(_make("r-one", 1, "0F0 0R0 0B0"))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_recompute_stages_and_inflight_by_name_match_the_generated_schedule(name: str) -> None:
    for p in range(1, 9):
        for m in range(1, 13):
            schedule = generate(name, p, m)
            assert recompute_stages(name, p) == schedule.recompute_stages, (name, p, m)
            assert inflight_named(name, p, m) == inflight(schedule), (name, p, m)


def test_inflight_does_not_count_w() -> None:
    """held and graphs span F..B (R..B under recompute): a W, even one before the stage's peak, lowers neither."""
    schedule = _make("w-early", 1, "0F0 0B0 0W0 0F1 0F2 0B1 0W1 0B2 0W2")
    assert inflight(schedule) == [(2, 2)]
    assert pending_weights(schedule) == [1]
    recomputing = _make("w-early-r", 1, "0F0 0R0 0B0 0W0 0F1 0F2 0R1 0B1 0W1 0R2 0B2 0W2")
    assert inflight(recomputing) == [(2, 1)]


def test_recompute_stages_of_an_unknown_schedule() -> None:
    with pytest.raises(ConfigError, match="unknown schedule 'zb-h2'"):
        recompute_stages("zb-h2", 2)


@pytest.mark.parametrize("name", ["zb-h2", "", "VARUNA", None, 3, ["varuna"], "x" * 500])
def test_one_check_of_a_schedule_name_refuses_the_same_everywhere(name) -> None:
    """The argument, the request, the plan and the executor all say what check_schedule says."""
    from varuna_core.planning.planner import PlanRequest, layout_plan

    with pytest.raises(ConfigError) as expected:
        check_schedule(name)
    assert len(expected.value.message) < 80 and all(n in expected.value.hint for n in SCHEDULE_NAMES)
    for refuse in (lambda: generate(name, 2, 2), lambda: recompute_stages(name, 2),
                   lambda: PlanRequest(gpus=2, batch_size=8, schedules=(name,)),
                   lambda: layout_plan(pp=1, dp=1, microbatch_size=1, batch_size=1, gpus=1, gpus_per_node=1,
                                       schedule=name)):
        with pytest.raises(ConfigError) as info:
            refuse()
        assert (info.value.message, info.value.hint) == (expected.value.message, expected.value.hint)
    assert all(check_schedule(n) == n for n in SCHEDULE_NAMES)
