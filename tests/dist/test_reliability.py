"""Faults a healthy multi-process job must survive or report cleanly: unseeded processes, a rank whose
background checkpoint copy fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT, run_ranks
from varuna_core.checkpoint.layout import scan

pytestmark = pytest.mark.dist

_UNSEEDED = """
import os, torch
from tests.models import SHARED, ToyLM, batch
from varuna_core import Varuna
vm = Varuna(ToyLM(), "0", batch(2), batch_size=4, chunk_size=2, shared_weights=SHARED)
assert vm.seed == torch.initial_seed(), (vm.seed, torch.initial_seed())
print(vm.seed)
"""


def test_fresh_unseeded_processes_all_start(tmp_path) -> None:
    """``torch.initial_seed()`` of an unseeded process is a random value in [0, 2**64): half of them do not fit
    an int64 (before: 'Overflow when unpacking long long' at start-up, in about half of the processes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), VARUNA_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _UNSEEDED], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    seeds = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        seeds.append(int(out.split()[-1]))
    assert len(set(seeds)) == 6 and all(0 <= s < 2**64 for s in seeds)


def test_unseeded_ranks_agree_on_rank_0s_seed_and_run(tmp_path) -> None:
    run = {"schedule": "1f1b", "optimizer": "sgd", "batch": 8, "chunk": 2, "steps": 2, "unseeded": True}
    top = {"schedule": "1f1b", "optimizer": "sgd", "batch": 8, "chunk": 2, "steps": 1, "varuna_seed": 2**64 - 1}
    results = run_ranks({"map": "0;1", "timeout": 60, "runs": [run, top]}, 2, tmp_path)
    for res in results:
        assert res.returncode == 0, res.error
    first = [res.result["runs"][0] for res in results]
    assert first[0]["seed"] == first[1]["seed"] == first[0]["initial_seed"]
    assert first[0]["run_id"] == first[1]["run_id"]
    assert [res.result["runs"][1]["seed"] for res in results] == [2**64 - 1] * 2


def test_a_rank_whose_background_copy_fails_fails_the_checkpoint_everywhere(tmp_path) -> None:
    """Rank 1's copy into the store hits a full disk: rank 1 reports it through the job's store, rank 0 removes
    what was written and fails with rank 1's reason (before: rank 0 waited out its timeout, the partial
    directory stayed, and rank 1's error surfaced later as a raw OSError); no staging copy is left."""
    store, local = tmp_path / "ckpt", tmp_path / "local"
    run = {"schedule": "1f1b", "optimizer": "adamw", "batch": 8, "chunk": 2, "steps": 2, "fail_copy": {"rank": 1},
           "save": {"dir": str(store), "at": 2, "background": True, "tempdir": str(local)}}
    results = run_ranks({"map": "0;1", "timeout": 30, "runs": [run]}, 2, tmp_path / "a",
                        env={"VARUNA_JOB_TOKEN": "t" * 64})
    assert results[1].returncode == 1 and "No space left on device" in results[1].error, results[1].error
    assert results[0].returncode == 1, results[0].error
    assert "rank 1: No space left on device" in results[0].error and "CheckpointError" in results[0].error
    assert scan(store) == [] and list(Path(local).iterdir()) == []
