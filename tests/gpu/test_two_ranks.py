"""Two processes on the one GPU. Under NCCL (the library's default on CUDA) every rank refuses with one clear
error instead of NCCL's "Duplicate GPU detected" or a hang; under a gloo group the script joins itself the two
stages share the GPU (cut values cross through host memory) and train bit for bit as the reference: with the exact
wire, with a bf16 wire (against a reference rounding at the cut), and as two data-parallel replicas whose gradient
sync is posted from the backward's hooks while it runs (CUDA streams: a bucket must not be read before its
gradients are written)."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.test_wire import rounded
from tests.gpu.common import DEVICE, ROOT, assert_equal_to_reference, needs_real_gpu, reference
from tests.gpu.pp2_worker import BATCH, CHUNK, STEPS
from tests.models import SHARED, ToyLM, batch
from tests.reference import Layout
from varuna_core.env import CACHE_DIR
from varuna_core.launch import forkserver
from varuna_core.model.precision import WIRE_DTYPES
from varuna_core.util.procs import free_port, run_workers, torchrun_env

TIMEOUT = 120.0


def _run(backend: str, tmp_path, *args: str, **env) -> list[int]:
    device = "cuda:0" if DEVICE == "cuda" else DEVICE  # the one GPU, for both ranks
    outcome = run_workers([sys.executable, "-m", "tests.gpu.pp2_worker", backend, device, str(tmp_path), *args], 2,
                          log_dir=tmp_path, timeout=TIMEOUT, cwd=ROOT, stop_on_failure=False,
                          env={CACHE_DIR: str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), **env})
    assert not outcome.timed_out, f"killed after {TIMEOUT:g}s: " + _logs(tmp_path)
    return outcome.returncodes


def _logs(tmp_path) -> str:
    return "".join(f"\n--- rank {r} ---\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))


def test_nccl_refuses_two_ranks_on_one_gpu(tmp_path) -> None:
    """Both ranks given ``LOCAL_RANK=0`` (what one GPU's worth of ``LOCAL_RANK`` gives two processes): each exits
    with the ``ConfigError``'s code (2, bad input) and its one line, the script having let it propagate."""
    needs_real_gpu("NCCL")
    codes = _run("nccl", tmp_path, LOCAL_RANK="0")
    assert codes == [2, 2], _logs(tmp_path)
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith(f"[rank {rank}] error: ")]
        assert len(errors) == 1, log[-3000:]
        assert errors[0].startswith(f"[rank {rank}] error: ranks 0 and 1 would both compute on cuda:0 "), errors
        assert "Traceback" not in log, log[-3000:]


def test_gloo_pipeline_on_one_gpu_equals_the_reference(tmp_path) -> None:
    codes = _run("gloo", tmp_path)
    assert codes == [0, 0], _logs(tmp_path)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    assert {torch.device(r["device"]).type for r in results} == {DEVICE}
    assert results[0]["losses"] == results[1]["losses"]
    torch.manual_seed(0)
    ref_losses, ref_state = reference(ToyLM(), STEPS, batch, Layout(BATCH, CHUNK, pp=2), SHARED, DEVICE)
    state = {**results[0]["state"], **results[1]["state"]}
    assert_equal_to_reference(results[0]["losses"], state, ref_losses, ref_state)


def _results(tmp_path) -> list[dict]:
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert {torch.device(r["device"]).type for r in results} == {DEVICE}
    assert results[0]["losses"] == results[1]["losses"]
    return results


def test_gloo_pipeline_on_one_gpu_with_a_bf16_wire_equals_one_process_rounding_at_the_cut(tmp_path) -> None:
    """The activation at cuts.1 and its gradient cast to bf16 on the GPU, staged through host memory in bf16 and
    cast back on arrival: bit for bit the plain CUDA process whose cuts.1 rounds both to bf16 and back (and not the
    exact run: the rounding must show)."""
    codes = _run("gloo", tmp_path, "0;1", "bf16")
    assert codes == [0, 0], _logs(tmp_path)
    results = _results(tmp_path)
    torch.manual_seed(0)
    model = ToyLM()
    model.cuts[1].set_hook(lambda _, value: rounded(value, WIRE_DTYPES["bf16"]))
    ref_losses, ref_state = reference(model, STEPS, batch, Layout(BATCH, CHUNK, pp=2), SHARED, DEVICE)
    torch.manual_seed(0)
    exact_losses, _ = reference(ToyLM(), STEPS, batch, Layout(BATCH, CHUNK, pp=2), SHARED, DEVICE)
    assert not torch.equal(ref_losses, exact_losses), "the rounding must change something for the test to see it"
    assert_equal_to_reference(results[0]["losses"], {**results[0]["state"], **results[1]["state"]}, ref_losses,
                              ref_state)


def test_gloo_replicas_on_one_gpu_sync_while_the_backward_runs_and_equal_the_reference(tmp_path) -> None:
    """pp=1 x dp=2 on the one GPU: each replica's buckets are all-reduced as their gradients become final (posted
    from the post-accumulate hooks of the last backward), the CUDA gradients staged through host memory; both
    replicas end bit for bit where one CUDA process summing the two halves' gradients ends."""
    codes = _run("gloo", tmp_path, "0,1")
    assert codes == [0, 0], _logs(tmp_path)
    results = _results(tmp_path)
    for name, t in results[0]["state"].items():
        assert torch.equal(t, results[1]["state"][name]), f"the replicas disagree on {name}"
    torch.manual_seed(0)
    ref_losses, ref_state = reference(ToyLM(), STEPS, batch, Layout(BATCH, CHUNK, dp=2), SHARED, DEVICE)
    assert_equal_to_reference(results[0]["losses"], results[0]["state"], ref_losses, ref_state)


def test_ranks_forked_by_the_fork_server_train_on_the_gpu_as_fresh_ones(tmp_path) -> None:
    """What ``varuna launch`` does on a host with several workers (``fork_now``): one server imports torch, numpy
    and varuna (without touching CUDA: a child forked after its parent initialised CUDA cannot use it) and forks
    both ranks, which then initialise CUDA each on its own and train bit for bit as the fresh ones of
    :func:`test_gloo_pipeline_on_one_gpu_equals_the_reference`. The server must also still have no CUDA context
    after its imports (asked of it by a forked child: ``torch.cuda.is_initialized()`` as the server left it)."""
    device = "cuda:0" if DEVICE == "cuda" else DEVICE
    script = str(ROOT / "tests" / "gpu" / "pp2_worker.py")
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nprint('cuda initialised in the server:',\n"
                     "      torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork())\n")
    token, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{CACHE_DIR: str(tmp_path / "cache")})
    env.update(torchrun_env(0, 2, port))  # (TORCHELASTIC_USE_AGENT_STORE acts at import: the server has it too)
    base = tempfile.mkdtemp(prefix="vfs-", dir="/tmp")  # a socket's path must be short
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    client = forkserver.start_server(Path(base) / "fs.sock", token, [sys.executable, script], env, str(ROOT))
    try:
        client.start_reader()
        probed = client.spawn([sys.executable, str(probe)], env, str(ROOT), None)
        assert probed.stdout is not None
        said = probed.stdout.read().decode(errors="replace")
        assert probed.wait(60) == 0, said
        assert "cuda initialised in the server: False" in said, said
        procs = [client.spawn([sys.executable, script, "gloo", device, str(tmp_path)],
                              {**env, **torchrun_env(rank, 2, port)}, str(ROOT), f"varuna-r{rank}")
                 for rank in range(2)]
        outputs = []
        for proc in procs:
            assert proc.stdout is not None
            outputs.append(proc.stdout.read().decode(errors="replace"))
        codes = [proc.wait(TIMEOUT) for proc in procs]
        assert codes == [0, 0], "\n".join(out[-3000:] for out in outputs)
    finally:
        client.quit()
        client.close()
        del store
        shutil.rmtree(base, ignore_errors=True)
    results = _results(tmp_path)
    torch.manual_seed(0)
    ref_losses, ref_state = reference(ToyLM(), STEPS, batch, Layout(BATCH, CHUNK, pp=2), SHARED, DEVICE)
    assert_equal_to_reference(results[0]["losses"], {**results[0]["state"], **results[1]["state"]}, ref_losses,
                              ref_state)
