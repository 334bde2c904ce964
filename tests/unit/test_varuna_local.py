"""The Varuna facade in one process (no process group): parity, evaluate, slicing helpers, bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import SHARED, ToyLM, batch
from tests.reference import Layout, train_reference
from varuna_core import Varuna
from varuna_core.errors import ConfigError, PartitionError, TopologyError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VARUNA_CACHE_DIR", str(tmp_path / "cache"))


def _wrap(stage_map="0", **kw):
    torch.manual_seed(0)
    args = dict(batch_size=8, chunk_size=3, shared_weights=SHARED)
    args.update(kw)
    return Varuna(ToyLM(), stage_map, batch(2), **args)


@pytest.mark.parametrize("schedule", ["varuna", "1f1b", "gpipe", "zb", "varuna-zb"])
def test_single_process_matches_plain_training(schedule) -> None:
    """Bit for bit: one stage adds its micro-batches' gradients as the reference does (``tests/reference.py``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference's thread count: a kernel may split a reduction by it
    try:
        vm = _wrap(schedule=schedule)
        opt = torch.optim.AdamW(vm.parameters(), lr=1e-2)
        vm.set_optimizer(opt)
        losses = []
        for step in range(3):
            loss, overflow = vm.step(batch(8, seed=step))
            assert overflow is False
            opt.step()
            opt.zero_grad()
            losses.append(loss)
    finally:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    ref_buffers: dict[str, torch.Tensor] = {}
    ref_losses, ref_params = train_reference(ToyLM(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), 3,
                                             lambda step: batch(8, seed=step), Layout(8, 3), ties=SHARED,
                                             buffers=ref_buffers)
    assert torch.equal(torch.tensor(losses, dtype=torch.float64), ref_losses), (losses, ref_losses)
    for name, p in vm.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    for name, b in vm.named_buffers():
        assert torch.equal(b, ref_buffers[name]), name


def test_observers_see_every_action_the_run_and_the_gradient_sync() -> None:
    from varuna_core.pipeline.tracing import ActionObserver

    class Recorder(ActionObserver):
        def __init__(self) -> None:
            self.events: list[tuple] = []

        def on_action(self, timing) -> None:
            assert timing.start <= timing.end and timing.waited >= 0 and timing.compute >= 0
            self.events.append(("action", timing.name))

        def on_run(self, start: float, end: float) -> None:
            self.events.append(("run", start <= end))

        def on_sync(self, start: float, end: float) -> None:
            self.events.append(("sync", start <= end))

    vm = _wrap(schedule="1f1b")
    recorder = Recorder()
    with vm.executor.observing(recorder):
        vm.step(batch(8, seed=1))
    assert recorder.events == [("action", a) for a in ("0F0", "0B0", "0F1", "0B1", "0F2", "0B2")] + [
        ("run", True), ("sync", True)]
    vm.step(batch(8, seed=2))  # detached after the block
    assert len(recorder.events) == 8


@pytest.mark.parametrize("schedule", ["zb", "varuna-zb"])
def test_a_split_schedule_computes_the_weights_gradients_in_w(schedule) -> None:
    """Under a split schedule a Linear's weight gets its gradient in the W action, after B, once per micro-batch;
    under 1F1B inside B. (What W computes is tests/unit/test_split.py's; this is the executor running it.)"""
    from varuna_core.pipeline.tracing import ActionObserver

    events: list[str] = []

    class Recorder(ActionObserver):
        def on_action(self, timing) -> None:
            events.append(timing.name)

    for name, expected in ((schedule, ["0F0", "0B0", "grad", "0W0"]), ("1f1b", ["0F0", "grad", "0B0"])):
        vm = _wrap(schedule=name)
        dict(vm.named_parameters())["blocks.0.fc1.weight"].register_hook(lambda g: events.append("grad"))
        events.clear()
        with vm.executor.observing(Recorder()):
            vm.step(batch(8, seed=1))
        assert events[:len(expected)] == expected, (name, events)
        assert events.count("grad") == 3  # one per micro-batch


def test_evaluate_any_batch_size() -> None:
    vm = _wrap()
    torch.manual_seed(0)
    ref = ToyLM()
    b = batch(7, seed=3)
    with torch.no_grad():
        assert vm.evaluate(b) == pytest.approx(ref(**b).item(), rel=1e-6)


def test_gradients_accumulate_across_steps_without_zero_grad() -> None:
    vm = _wrap()
    vm.step(batch(8, seed=1))
    first = {n: p.grad.clone() for n, p in vm.named_parameters()}
    vm.step(batch(8, seed=1))
    for n, p in vm.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n])
    vm.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0 for p in vm.parameters())


def test_gradient_buffer_is_allocated_at_the_first_step_not_at_start_up() -> None:
    vm = _wrap()
    assert vm.grad_buffer.flats == [] and all(p.grad is None for p in vm.parameters())
    vm.zero_grad()  # before any step: nothing to zero, nothing allocated
    assert vm.grad_buffer.flats == [] and all(p.grad is None for p in vm.parameters())
    vm.step(batch(8, seed=1))
    total = sum(p.numel() for p in vm.parameters())
    assert sum(f.numel() for f in vm.grad_buffer.flats) == total
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in vm.parameters())


def test_replica_slice_and_names() -> None:
    vm = _wrap()
    assert vm.replica_range == (0, 8)
    full = batch(8)
    assert torch.equal(vm.replica_slice(full)["idx"], full["idx"])
    with pytest.raises(ConfigError, match="global batch of 8"):
        vm.replica_slice(batch(5))
    names = [n for n, _ in vm.named_parameters()]
    assert "emb.weight" in names and "head.weight" not in names  # one tied weight, listed once
    assert len(list(vm.parameters())) == len(names)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage_map": "0;1"}, TopologyError, "WORLD_SIZE"),
        ({"stage_map": "0,1"}, TopologyError, "WORLD_SIZE"),
        ({"stage_map": "zero"}, TopologyError, "zero"),
        ({"stage_map": None}, TopologyError, "stage_to_rank_map must be a string like '0,2;1,3', got None"),
        ({"stage_map": [0]}, TopologyError, "got \\[0\\]"),
        ({"chunk_size": 9}, ConfigError, "does not fit this replica's batch of 8"),
        ({"chunk_size": 0}, ConfigError, "chunk_size"),
        ({"schedule": "zigzag"}, ConfigError, "unknown schedule"),
        ({"partition": [(0, 2), (2, 5)]}, PartitionError, "stage"),
        ({"precision": "fp8"}, ConfigError, "unknown precision"),
        ({"fp16": True, "precision": "bf16"}, ConfigError, "contradicts"),
    ],
)
def test_bad_arguments(kwargs, error, match) -> None:
    stage_map = kwargs.pop("stage_map", "0")
    with pytest.raises(error, match=match) as info:
        _wrap(stage_map, **kwargs)
    assert str(info.value)


def test_weight_groups_are_found_once_per_varuna(monkeypatch) -> None:
    """They were computed three times (values, the facade, the tie sets), in two representations."""
    import varuna_core.model.stage as stage_module
    import varuna_core.model.values as values_module
    import varuna_core.varuna as varuna_module

    calls = []
    real = stage_module.weight_groups

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (stage_module, values_module, varuna_module):
        monkeypatch.setattr(module, "weight_groups", counted, raising=False)
    vm = _wrap()
    assert len(calls) == 1 and [c for c, _ in vm.weight_groups] == ["emb.weight"]


def test_the_config_holds_checked_values_of_real_types() -> None:
    """Config's fields were Any (stage_to_rank_map, plan, ...): what the facade took from it had no type."""
    import dataclasses

    from varuna_core.pipeline.config import Config

    assert not [f.name for f in dataclasses.fields(Config) if "Any" in str(f.type)]


def _devices_here() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cpu" + ("" if not count else ", cuda:0" if count == 1 else f", cuda:0..{count - 1}")


class _Device:
    """A device that is not a device."""


@pytest.mark.parametrize("device", [
    "tpu", "garbage", "", "cuda:7000", 7000, -2, True, 1.5, _Device(), torch.device("meta"), torch.device("xpu"),
    "cpu:3", *(["cuda", "cuda:0", 0, torch.device("cuda")] if not torch.cuda.is_available() else []),
])
def test_a_device_this_machine_lacks_is_named_before_anything_starts(monkeypatch, device) -> None:
    """The argument, the value and the devices this machine has; checked before the process group is joined
    (torch's own error lists every device type it knows and none of the machine's)."""
    import varuna_core.varuna as facade

    def joined(*args, **kwargs):
        raise AssertionError("the process group was joined before the device was checked")

    monkeypatch.setattr(facade, "ensure_process_group", joined)
    with pytest.raises(ConfigError) as info:
        _wrap(device=device)
    message = str(info.value)
    assert "device=" in message and f"this machine has {_devices_here()}" in message, message
    assert "\n" not in message and "Expected one of" not in message, message


def test_a_map_for_another_world_is_refused_before_the_process_group_is_joined(monkeypatch) -> None:
    """Every rank names the map (a rank that raised after joining would leave a peer still connecting with only
    "connection closed by peer" to report)."""
    import varuna_core.varuna as facade

    def joined(*args, **kwargs):
        raise AssertionError("the process group was joined before the map was checked")

    monkeypatch.setattr(facade, "ensure_process_group", joined)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(TopologyError, match="3 ranks, but WORLD_SIZE=2"):
        _wrap("0;1;2")


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT not set"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 is outside"),
    ({"WORLD_SIZE": "2", "RANK": "-1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=-1 is outside"),
    ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK='x' is not"),
])
def test_torchrun_variables_that_cannot_describe_a_world_are_named(monkeypatch, env, message) -> None:
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        _wrap()


def test_the_cpu_device_is_accepted_in_every_spelling() -> None:
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        assert _wrap(device=device).device.type == "cpu"


def test_bad_step_inputs() -> None:
    vm = _wrap()
    with pytest.raises(ConfigError, match="input 'idx' has 5 examples"):
        vm.step(batch(5))
    with pytest.raises(ConfigError, match="were not in dummy_inputs"):
        vm.step(batch(8) | {"mask": torch.ones(8)})
    with pytest.raises(ConfigError, match="no forward"):
        vm(**batch(8))


def test_uncaught_error_in_a_script_is_one_line_with_exit_code(tmp_path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(
        "from tests.models import ToyLM, batch\nfrom varuna_core import Varuna\n"
        "Varuna(ToyLM(), '0', batch(2), batch_size=4, chunk_size=8)\n"
    )
    env = dict(os.environ, VARUNA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("error: chunk_size=8 does not fit") and lines[1].startswith("hint: ")
    debug = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env | {"VARUNA_DEBUG": "1"}, timeout=120)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_plan_of_another_model_is_refused(tmp_path) -> None:
    from tests.profiles import make_profile
    from varuna_core.planning.artifacts import save_plan
    from varuna_core.planning.planner import PlanRequest, plan_for

    plan = plan_for(make_profile([0.001] * 3), PlanRequest(gpus=1, batch_size=8), pp=1, dp=1, microbatch_size=2,
                    schedule="1f1b")
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    with pytest.raises(ConfigError, match="the plan is for a model with 3 segments; this model has 5"):
        _wrap(None, plan=str(path))
    (tmp_path / "v2.yaml").write_text(path.read_text().replace("schema_version: 1", "schema_version: 2"))
    with pytest.raises(ConfigError, match="plan format version 2"):
        _wrap(None, plan=str(tmp_path / "v2.yaml"))


def test_plan_sets_micro_batch_and_schedule(tmp_path) -> None:
    from tests.profiles import make_profile
    from varuna_core.planning.artifacts import save_plan
    from varuna_core.planning.planner import PlanRequest, plan_for

    plan = plan_for(make_profile([0.001] * 5), PlanRequest(gpus=1, batch_size=8), pp=1, dp=1, microbatch_size=4,
                    schedule="gpipe")
    save_plan(plan, tmp_path / "plan.yaml")
    vm = _wrap(None, plan=str(tmp_path / "plan.yaml"), chunk_size=3)
    assert (vm.chunk_size, vm.schedule_name, vm.num_microbatches) == (4, "gpipe", 2)


def test_checkpoint_retention_and_resume_in_one_process(tmp_path) -> None:
    from varuna_core.checkpoint.layout import scan

    vm = _wrap()
    opt = torch.optim.AdamW(vm.parameters(), lr=1e-2)
    vm.set_optimizer(opt)
    for step in range(3):
        vm.step(batch(8, seed=step))
        opt.step()
        opt.zero_grad()
        vm.checkpoint(tmp_path, keep=2)
    assert [(e.step, e.complete) for e in scan(tmp_path)] == [(2, True), (3, True)]
    after = {n: p.detach().clone() for n, p in vm.named_parameters()}
    fresh = _wrap()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.set_optimizer(fresh_opt)
    assert fresh.load_checkpoint(tmp_path) == 3 and fresh.iteration == 3
    for name, p in fresh.named_parameters():
        assert torch.equal(p, after[name]), name
        assert torch.equal(fresh_opt.state[p]["exp_avg"], opt.state[dict(vm.named_parameters())[name]]["exp_avg"])


def test_start_up_and_evaluate_leave_the_written_buffers_as_they_were() -> None:
    """Discovery, the start-up validation (``cutpoints="auto"``) and ``evaluate()`` of a model left in training
    mode run forwards that update BatchNorm statistics: none of them may change a buffer. A step does."""
    from tests.models import ResNetLM

    torch.manual_seed(0)
    model = ResNetLM()
    before = {n: b.clone() for n, b in model.named_buffers()}
    vm = Varuna(model, "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED, cutpoints="auto",
                validate=True)
    for name, buf in vm.named_buffers():
        assert torch.equal(buf, before[name]), f"start-up changed {name}"
    vm.evaluate(batch(8, seed=3))
    for name, buf in vm.named_buffers():
        assert torch.equal(buf, before[name]), f"evaluate() changed {name}"
    vm.set_optimizer(torch.optim.SGD(vm.parameters(), lr=0.1))
    vm.step(batch(8, seed=4))
    assert int(dict(vm.named_buffers())["bn_f.num_batches_tracked"]) == 3  # once per micro-batch (3, 3, 2)


def test_a_model_computing_another_structure_in_eval_mode_is_refused_there() -> None:
    """Discovery sees training mode; ``evaluate()`` after ``.eval()`` on a model whose eval forward carries
    another value across a cut raises a CutPointError naming the cut, before running anything; back in training
    mode it runs. A model computing the same structure in both modes evaluates in eval mode."""
    from tests.models import ModeDependentLM
    from varuna_core.errors import CutPointError

    torch.manual_seed(0)
    vm = Varuna(ModeDependentLM(), "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED)
    vm.eval()
    with pytest.raises(CutPointError, match=r"eval mode.*cuts\.1") as info:
        vm.evaluate(batch(8, seed=3))
    assert info.value.hint and ".train()" in info.value.hint
    vm.set_optimizer(torch.optim.SGD(vm.parameters(), lr=0.1))
    with pytest.raises(CutPointError, match="eval mode"):
        vm.step(batch(8, seed=3))
    vm.train()
    vm.evaluate(batch(8, seed=3))
    plain = _wrap()
    plain.eval()
    assert plain.evaluate(batch(8, seed=3)) > 0


def test_a_model_failing_in_eval_mode_builds_and_is_refused_only_in_eval_mode() -> None:
    """The other mode's dry run is only a check: a model whose eval forward raises still trains, and its
    ``evaluate()`` after ``.eval()`` raises a CutPointError carrying that error."""
    from varuna_core.errors import CutPointError

    class TrainOnly(ToyLM):
        def forward(self, idx, targets):
            if not self.training:
                raise ValueError("no evaluation here")
            return super().forward(idx, targets)

    torch.manual_seed(0)
    vm = Varuna(TrainOnly(), "0", batch(2), batch_size=8, chunk_size=3, shared_weights=SHARED)
    vm.set_optimizer(torch.optim.SGD(vm.parameters(), lr=0.1))
    vm.step(batch(8, seed=1))
    vm.eval()
    with pytest.raises(CutPointError, match="ValueError: no evaluation here"):
        vm.evaluate(batch(8, seed=3))
