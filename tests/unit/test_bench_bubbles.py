"""benchmarks/bubbles.py without running it: what a measured step is compared with (a stage's own work, the
closed forms of the bubble, the simulator fed the measured action times)."""

from __future__ import annotations

import pytest

from tests.scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "bubbles.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, "_bench_bubbles")


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_the_simulator_on_exact_times_meets_the_closed_forms(bench, pp: int) -> None:
    """With every action taking exactly the unit, the simulation is the theory: 1F1B's bubble is (pp-1)(F+B+W),
    ZB-H1's (pp-1)(F+B-W), two thirds less, at every M."""
    unit = 0.02
    for m in (pp, 2 * pp, 4 * pp):
        whole = [{"F": unit, "B": 2 * unit}] * pp  # an unsplit B is the input's and the weights' gradients
        split = [{"F": unit, "B": unit, "W": unit}] * pp
        assert bench.simulated("1f1b", pp, m, whole) == pytest.approx(bench.theory("1f1b", pp, m, unit))
        assert bench.simulated("zb", pp, m, split) == pytest.approx(bench.theory("zb", pp, m, unit))
        bubble = {name: bench.theory(name, pp, m, unit) - bench.ideal(name, pp, m, unit) for name in ("1f1b", "zb")}
        assert bubble["zb"] == pytest.approx(bubble["1f1b"] / 3)
        assert bench.theory("varuna", pp, m, unit) is None
        assert bench.ideal("varuna-zb", pp, m, unit) == pytest.approx(4 * m * unit)  # F, R, B and W


def test_arguments_are_checked(bench, monkeypatch, capsys) -> None:
    for argv in (["--pp", "1"], ["--unit", "0"], ["--schedules", "zb,pipedream"], ["--steps", "0"]):
        monkeypatch.setattr("sys.argv", ["bubbles.py", *argv])
        with pytest.raises(SystemExit) as info:
            bench.main()
        assert info.value.code == 2
    assert "need depths" in capsys.readouterr().err
