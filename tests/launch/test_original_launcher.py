"""A script written for the original Varuna (`examples/original_api/`) runs unchanged: under
`python -m varuna.run_varuna` on local processes (a layout given by hand, uneven micro-batches) and over SSH
hosts (planned from a profile its `Profiler` script wrote, read by `AutoConfig` too), and under torchrun; every
step's loss equals the same training in one plain PyTorch process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devtools.testhosts import start_cluster
from tests.launch.conftest import ROOT, VARUNA
from tests.scripts import load_script

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

EXAMPLE = ROOT / "examples" / "original_api"
STEPS, SEED, LR = 6, 1234, 3e-3
_STEP = re.compile(r"^step (\d+) loss (\S+) ", re.M)


def one_process_losses(global_batch: int) -> list[float]:
    """The example's training in one process, plain PyTorch: the tied pair is one parameter."""
    example = load_script(EXAMPLE / "model.py", "original_api_model")
    text = example.Text()
    torch.manual_seed(SEED)
    model = example.SampleModel(text.vocab_size)
    model.lm_head_weight = model.embedding.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(**text.step_batch(step, global_batch, SEED))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def losses_in(text: str) -> list[float]:
    found = {int(step): float(loss) for step, loss in _STEP.findall(text)}
    assert sorted(found) == list(range(STEPS)), text[-2000:]
    return [found[s] for s in range(STEPS)]


def assert_equal_to_one_process(got: list[float], global_batch: int) -> None:
    want = one_process_losses(global_batch)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst < 1e-5, (got, want)


def run(argv: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", VARUNA_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def run_varuna(args: list[str], tmp_path: Path) -> list[float]:
    run_dir = tmp_path / "run"
    run([sys.executable, "-m", "varuna.run_varuna", *args, "--run-dir", str(run_dir), "--code_dir", str(ROOT),
         "examples/original_api/train.py", "--steps", str(STEPS), "--save", str(tmp_path / "store")], tmp_path)
    return losses_in((run_dir / "logs" / "rank0.log").read_text())


def test_under_run_varuna_on_local_processes_with_a_layout_given_by_hand(tmp_path) -> None:
    """Two stages, micro-batches of 3 over a batch of 14 (uneven: 3, 3, 3, 3, 2); the machine list is this
    machine; the README's `--batch-size` spelling."""
    (tmp_path / "machines").write_text("127.0.0.1\n")
    got = run_varuna(["--machine_list", str(tmp_path / "machines"), "--gpus_per_node", "2", "--batch-size", "14",
                      "--nstages", "2", "--chunk_size", "3", "--no_morphing"], tmp_path)
    assert_equal_to_one_process(got, 14)
    plan = (tmp_path / "run" / "plan.yaml").read_text()
    assert "partition: null" in plan and "layout given by hand" in plan
    assert (tmp_path / "store" / f"step_{STEPS}" / "COMPLETE").exists()  # the script's own checkpoint call


def test_profiler_autoconfig_and_run_varuna_over_ssh_hosts(tmp_path) -> None:
    """The Profiler script under torchrun writes the profile; AutoConfig reads it; run_varuna plans from it
    (no --nstages/--chunk_size) and runs the script on two SSH hosts, one worker each, morphing on."""
    profiles = tmp_path / "profiles"
    torchrun = Path(VARUNA).parent / "torchrun"
    run([str(torchrun), "--standalone", "--nproc-per-node", "2", "examples/original_api/profile_model.py",
         "--save", str(profiles)], tmp_path)
    assert (profiles / "profile.json").is_file()
    config = run([sys.executable, "examples/original_api/config.py", "--num_gpus", "2", "--batch_size", "16",
                  "--profile_folder", str(profiles)], tmp_path).stdout
    assert re.match(r"pp [12] micro_batch [1-4] time \d", config), config

    cluster = start_cluster(2, tmp_path / "hosts")
    try:
        machines = tmp_path / "machines"
        machines.write_text("".join(line + "\n" for line in cluster.hosts_file_lines(1)))
        got = run_varuna(["--machine_list", str(machines), "--gpus_per_node", "1", "--batch_size", "16",
                          "--profile_folder", str(profiles), *cluster.launcher_args()], tmp_path)
    finally:
        cluster.close()
    assert_equal_to_one_process(got, 16)
    plan = (tmp_path / "run" / "plan.yaml").read_text()
    assert f"profile_path: {profiles / 'profile.json'}" in plan


def test_under_torchrun_with_the_launchers_arguments_given_by_hand(tmp_path) -> None:
    """Two data-parallel replicas; `--batch-size` is the per-process batch, as the original launcher passed it."""
    torchrun = Path(VARUNA).parent / "torchrun"
    done = run([str(torchrun), "--standalone", "--nproc-per-node", "2", "examples/original_api/train.py",
                "--stage_to_rank_map", "0,1", "--chunk_size", "4", "--batch-size", "8", "--steps", str(STEPS),
                "--save", str(tmp_path / "store")], tmp_path)
    assert_equal_to_one_process(losses_in(done.stdout), 16)
