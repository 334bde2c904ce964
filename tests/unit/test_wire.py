"""The wire dtype without processes: which leaves it narrows, where fp16 overflows, the sender's count, the
receiver's cast back, the argument's checks and the plan's say (multi-process runs: tests/dist/test_wire.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import varuna_cli.app as cli
from tests.models import SHARED, ToyLM, batch
from tests.profiles import make_profile
from varuna_core import Varuna
from varuna_core.errors import ConfigError
from varuna_core.model.payload import TensorSpec
from varuna_core.model.precision import overflow_threshold, wire_dtype
from varuna_core.pipeline import p2p
from varuna_core.pipeline.config import resolve_config, wire_dtype_name
from varuna_core.planning.artifacts import Profile, load_plan
from varuna_core.planning.planner import PlanRequest, layout_plan, make_plan, plan_for
from varuna_core.profiling.run import _SegmentBench

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


@pytest.mark.parametrize(("leaf", "wire", "crosses_in"), [
    (F32, BF16, BF16), (F32, F16, F16), (F64, BF16, BF16), (F64, F16, F16),
    (BF16, F16, BF16),  # as wide: no byte saved, and fp16 would lose bf16's range
    (F16, BF16, F16),  # as wide: bf16 would lose fp16's digits
    (torch.float8_e4m3fn, BF16, torch.float8_e4m3fn),  # narrower: never widened
    (torch.int64, BF16, torch.int64), (torch.bool, F16, torch.bool), (torch.complex64, BF16, torch.complex64),
    (F32, None, F32),
])
def test_only_wider_floating_point_leaves_are_narrowed(leaf, wire, crosses_in) -> None:
    assert wire_dtype(leaf, wire) == crosses_in


def test_the_overflow_threshold_is_where_a_finite_value_becomes_inf() -> None:
    limit = overflow_threshold(F32, F16)
    assert limit == 65520.0
    below = torch.tensor([torch.nextafter(torch.tensor(limit), torch.tensor(0.0)).item()])
    assert torch.isfinite(below.to(F16)).all() and torch.isinf(torch.tensor([limit]).to(F16)).all()
    assert torch.isinf(torch.tensor([-limit], dtype=F64).to(F16)).all() and overflow_threshold(F64, F16) == limit
    assert overflow_threshold(F32, BF16) is None  # the same exponent range: see [Note: wire dtype]
    assert overflow_threshold(F64, BF16) is not None


def _sent(values: list[torch.Tensor], wire: torch.dtype) -> tuple[list[torch.Tensor], float]:
    count = torch.zeros(2)
    out = p2p.to_wire(values, [wire_dtype(v.dtype, wire) for v in values], count[0])
    return out, float(count[0])


def test_to_wire_casts_and_counts_the_leaves_that_overflow() -> None:
    x = torch.randn(4, 3)
    big = x.clone()
    big[1, 2] = -70000.0
    ids = torch.arange(6).reshape(2, 3)
    out, count = _sent([x, big, ids], F16)
    assert [t.dtype for t in out] == [F16, F16, torch.int64] and count == 1
    assert torch.equal(out[0], x.to(F16)) and torch.equal(out[2], ids)
    mask = torch.zeros(3, 3).masked_fill(torch.eye(3, dtype=torch.bool), float("-inf"))  # additive mask
    nan = torch.full((2,), float("nan"))
    assert _sent([mask, nan, torch.full((2,), 65519.0), torch.zeros(0)], F16)[1] == 0  # not the wire's doing
    assert _sent([torch.full((2,), 3e38)], BF16)[1] == 0  # bf16: not counted under fp32
    # without a count (the exact wire) nothing is checked
    assert p2p.to_wire([big], [F16])[0].dtype == F16


def test_the_receiver_casts_back_to_the_recorded_dtypes() -> None:
    spec = [TensorSpec((2, 3), (0,), "torch.float32"), TensorSpec((2,), (0,), "torch.int64")]
    pending = p2p.Pending([torch.ones(2, 3, dtype=BF16), torch.ones(2, dtype=torch.int64)], [], 0, "activation",
                          dtypes=[s.torch_dtype for s in spec])
    assert [t.dtype for t in pending.arrived()] == [F32, torch.int64]
    exact = p2p.Pending([torch.ones(2, 3)], [], 0, "activation")
    assert exact.arrived()[0] is exact.tensors[0]


@pytest.mark.parametrize(("value", "name"), [
    ("bf16", "bf16"), (torch.bfloat16, "bf16"), ("fp16", "fp16"), (torch.float16, "fp16"),
    ("exact", None), ("fp32", None), (torch.float32, None),
])
def test_wire_dtype_names(value, name) -> None:
    assert wire_dtype_name(value) == name


@pytest.mark.parametrize("value", ["int8", "bfloat16 ", "FP16", 16, True, torch.int8, torch.float64, ["bf16"]])
def test_a_bad_wire_dtype_is_a_config_error(value) -> None:
    with pytest.raises(ConfigError) as info:
        wire_dtype_name(value)
    assert "wire_dtype must be 'bf16', 'fp16' or 'exact'" in info.value.message and info.value.hint


def test_varuna_refuses_a_bad_wire_dtype_before_joining_a_group(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="wire_dtype must be"):
        Varuna(ToyLM(), "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED, wire_dtype="fp8")


def _resolve(plan, wire, **kw):
    return resolve_config(ToyLM(), "0;1", 8, 4, fp16=False, schedule="1f1b", partition=None, timeout=None,
                          bucket_mb=25, seed=None, plan=plan, trace=None, trace_step=2, cutpoints=None,
                          loss_reduction="mean", wire_dtype=wire, **{"precision": None, **kw})


@pytest.mark.parametrize(("kw", "message"), [
    ({"reduce_dtype": "int8"}, "reduce_dtype must be 'bf16', 'fp16' or 'exact'"),
    ({"reduce_dtype": "fp16"}, "reduce_dtype='fp16' with precision='fp32'"),
    ({"reduce_dtype": "fp16", "precision": "bf16"}, "reduce_dtype='fp16' with precision='bf16'"),
    ({"reduce_dtype": "bf16", "shard_optimizer": True}, "reduce_dtype='bf16' with shard_optimizer=True"),
])
def test_a_reduce_dtype_that_cannot_work_is_a_config_error(kw, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _resolve(None, None, **kw)


def test_reduce_dtype_names() -> None:
    assert _resolve(None, None, reduce_dtype="bf16").reduce == torch.bfloat16
    assert _resolve(None, None, reduce_dtype="fp16", precision="fp16").reduce == torch.float16
    assert _resolve(None, None, reduce_dtype="exact").reduce is None and _resolve(None, None).reduce is None


def test_a_plan_carries_the_wire_dtype_and_the_argument_overrides_it(caplog) -> None:
    plan = layout_plan(pp=2, dp=1, microbatch_size=4, batch_size=8, gpus=2, gpus_per_node=2)
    assert plan.wire_dtype is None and _resolve(plan, None).wire_dtype is None
    planned = plan.model_copy(update={"wire_dtype": "bf16"})
    assert _resolve(planned, None).wire_dtype == "bf16" and _resolve(planned, None).wire == torch.bfloat16
    with caplog.at_level("WARNING"):
        assert _resolve(planned, "exact").wire_dtype is None  # "exact" overrides the plan's
    assert "wire_dtype=exact differs from the plan's bf16" in caplog.text
    assert _resolve(None, "fp16").wire == torch.float16 and _resolve(None, None).wire is None


# --- the plan: messages charged at the wire's bytes --------------------------------------------------------


def _profile(wire16: float | None = None):
    """Four segments of 1 ms per example, 1 MB per example at each cut, over a 100 MB/s link: messages matter.
    ``wire16``: the fraction of the cut's bytes measured on a 2-byte wire (None: a profile without the measure)."""
    profile = make_profile([1e-3] * 4, out_per_example=10**6, bandwidth=1e8)
    if wire16 is None:
        return profile
    data = profile.model_dump(mode="json")
    for seg in data["segments"]:
        for m in seg["measures"]:
            m["wire16_bytes"] = round(m["output_bytes"] * wire16)
    return Profile.model_validate(data)


def _plan(profile, wire: str | None):
    return plan_for(profile, PlanRequest(gpus=2, batch_size=8, wire_dtype=wire), pp=2, dp=1, microbatch_size=2,
                    schedule="1f1b")


def test_the_planner_charges_messages_at_the_wire_bytes() -> None:
    exact, halved, measured = _plan(_profile(), None), _plan(_profile(), "bf16"), _plan(_profile(0.3), "fp16")
    assert exact.wire_dtype is None and halved.wire_dtype == "bf16" and measured.wire_dtype == "fp16"
    latency = 1e-4
    for plan, nbytes in ((exact, 2e6), (halved, 1e6), (measured, 0.6e6)):  # 2 examples of 1 MB at the cut
        stage = plan.stages[0]
        assert stage.activation_bytes == nbytes
        assert stage.send_activation == pytest.approx(latency + nbytes / 1e8)
        assert plan.stages[1].send_gradient == pytest.approx(latency + nbytes / 1e8)
    assert exact.predicted().step_time > halved.predicted().step_time > measured.predicted().step_time
    note = "the profile does not say which bytes at the cuts are floats wider than 2 bytes"
    search = make_plan(_profile(), PlanRequest(gpus=2, batch_size=8, wire_dtype="bf16"))
    assert search.wire_dtype == "bf16" and any(note in a for a in search.assumptions)
    assert not any(note in a for a in make_plan(_profile(0.5), PlanRequest(gpus=2, batch_size=8,
                                                                           wire_dtype="bf16")).assumptions)


def test_the_profiler_counts_the_bytes_a_2_byte_wire_carries() -> None:
    x = torch.zeros(3, 4)
    value = (x, x.to(BF16), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.bool), x.double())
    bench = SimpleNamespace(stage=SimpleNamespace(is_last=False))
    assert _SegmentBench.output_bytes(bench, value) == 48 + 24 + 24 + 3 + 96
    assert _SegmentBench.wire16_bytes(bench, value) == 24 + 24 + 24 + 3 + 24


def test_varuna_plan_takes_and_records_the_wire_dtype(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)
    path = tmp_path / "profile.json"
    path.write_text(_profile(0.5).model_dump_json())
    args = ["plan", str(path), "--gpus", "2", "--batch-size", "8", "-o", str(tmp_path / "plan.yaml")]
    result = CliRunner().invoke(cli.app, [*args, "--wire-dtype", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["wire_dtype"] == "bf16"
    assert load_plan(tmp_path / "plan.yaml").wire_dtype == "bf16"
    table = CliRunner().invoke(cli.app, [*args, "--wire-dtype", "fp16"])
    assert "cross cuts in fp16" in table.stdout, table.output
    with pytest.raises(SystemExit) as info:
        cli.main([*args, "--wire-dtype", "int8"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("error: --wire-dtype must be 'bf16' or 'fp16'"), err
