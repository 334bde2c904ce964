"""benchmarks/handover_io.py at a tiny size, in a subprocess: one JSON document with every phase timed, the take
bit for bit, nothing left in the shelf root or the store; a bad width is refused with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.scripts import BENCHMARKS

SCRIPT = BENCHMARKS / "handover_io.py"


def test_a_tiny_run_times_every_phase_and_leaves_nothing(tmp_path) -> None:
    shm, store = tmp_path / "shm", tmp_path / "store"
    shm.mkdir()
    store.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                           "--repeats", "1", "--json", "--shelf-root", str(shm), "--store", str(store)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["bit_equal"] is True and report["state_bytes"] > 0
    assert sorted(report["seconds"]) == ["load", "publish", "save", "take"]
    assert all(len(v) == 1 and v[0] > 0 for v in report["seconds"].values())
    assert list(shm.iterdir()) == [] and list(store.iterdir()) == []


def test_a_width_the_heads_do_not_divide_is_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--n-embd", "30", "--n-head", "4"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "is not a multiple of --n-head" in done.stderr
