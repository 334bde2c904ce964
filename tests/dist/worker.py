"""Worker process for the multi-process tests: trains a test model under ``Varuna`` for each run of a spec
and saves losses, gradient norms, loss scales and final parameters. Errors are written to ``rank<R>.err``
as ``Type: message``.

Run options (all optional except schedule/optimizer/batch/chunk): model (a class in tests.models, "GPT" for the
example, or "hf-gpt2", "hf-bert", "hf-llama", "hf-albert" from tests.hf_models with cutpoints="auto"), n_layer, dropout, steps, partition, validate, precision, clip, declare_shared, bad_seq,
stall_rank/stall_seconds, inject_inf {rank, step}, die {rank, step}, evaluate (batch size of an evaluation),
unseeded (no torch.manual_seed and no seed= for Varuna), varuna_seed, fail_copy {rank} (that rank's background
checkpoint copy fails with ENOSPC), meta (build under meta_init: each rank allocates and initialises its stage),
weights (a path for Varuna(weights=...)), evaluate_in_eval_mode (evaluate after .eval(): the loss, or the
error raised, as "eval_mode" or "eval_mode_error"), publish {at, job, roots} (after step ``at``, publish into the
shelf at ``roots[rank]``: one root per rank, hosts that share no directory; the blob map as "owners"; with
reside_at, the state moved into files of ``roots[rank]/keep`` before that step, the bytes as "resided"; with
final, a handover's last publish; ranks in leaving publish as on a host that leaves, ranks in alone as on the
next configuration's only host, unhashed), take
{step, job, token, owners, servers, local, staging, expect_error, map_files, no_links} (before training, take the
published step from the shelf servers: ``servers[r]`` serves old rank r's root, ``local[str(rank)]`` the old rank
whose root this rank reads directly (no_links: copied, not linked); with expect_error, record the error and the
parameters before and after, and stop; without owners, a snapshot's: each blob from its writer's server, then from
the next one, which keeps its copy; with map_files, as a warm worker: in place, the files it owns mapped as its
memory, the parameters so mapped as "mapped"), snapshot
{every, job, token, roots} (in-memory snapshots every ``every`` steps into the shelf at ``roots[rank]``, served
by a shelf server in this process; each one's report as "snapshots"), regroup {step, lose, ranks, map} (rank
``lose`` dies before step ``step``; the survivors regroup in-process as the launcher's decision, put in the store by
rank 0, says), overlap (False: VARUNA_OVERLAP_SYNC=0, the gradient sync after the pipeline), bucket_mb, grads
(record every step's gradients after ``step()``, before the optimizer, as "grads", and how many collectives each
step posted before its pipeline ended as "posted_early").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from tests import models
from tests.models import SHARED, batch
from varuna_core import Varuna, meta_init
from varuna_core.env import OVERLAP_SYNC
from varuna_core.errors import VarunaError

ROOT = Path(__file__).resolve().parents[2]


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw-groups":  # weight decay on matrices only, and another learning rate for the rest
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3}],
                                 lr=1e-2)
    if name == "lbfgs":
        return torch.optim.LBFGS(params)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def gpt_setup(run: dict):
    """The example GPT (small config) and a function step -> global batch of text."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from data import CharDataset
    from model import GPT, SHARED_WEIGHTS, GPTConfig

    ds = CharDataset.load()
    cfg = GPTConfig(vocab_size=ds.vocab_size, block_size=32, n_layer=run.get("n_layer", 2), n_head=2, n_embd=32,
                    dropout=run.get("dropout", 0.0))
    model = GPT(cfg)
    return model, SHARED_WEIGHTS, lambda n, seed: ds.get_batch("train", n, 32, torch.Generator().manual_seed(seed))


def build_model(run: dict):
    """(model, shared weights, step -> batch, cutpoints, loss reduction, initialiser for a meta build)."""
    if run.get("model") == "GPT":
        model, shared, make_batch = gpt_setup(run)
        return model, shared, make_batch, None, "mean", type(model).init_module
    if str(run.get("model", "")).startswith("hf-"):
        from tests import hf_models

        name = run["model"][3:]
        model = hf_models.build(name, dropout=run.get("dropout", 0.0), n_layer=run.get("n_layer"))
        make_batch = lambda n, seed: hf_models.batch(name, n, seed)  # noqa: E731
        return model, None, make_batch, "auto", "sum" if name == "llama" else "mean", None
    model_cls = getattr(models, run.get("model", "ToyLM"))
    model = model_cls(n_layer=run.get("n_layer", 4), dropout=run.get("dropout", 0.0))
    cutpoints = "auto" if getattr(model_cls, "AUTO_CUTS", False) else None
    return model, SHARED, batch, cutpoints, "mean", models.init_toy


def run_one(run: dict, spec: dict) -> dict:
    if not run.get("unseeded"):  # unseeded: torch.initial_seed() is a random 64-bit value, as in a user's script
        torch.manual_seed(run.get("seed", 0))
    with meta_init() if run.get("meta") else contextlib.nullcontext():
        model, shared, make_batch, cutpoints, loss_reduction, init = build_model(run)
    if not run.get("meta"):
        init = None
    batch_dims = None
    if run.get("model") == "SeqFirstLM":
        make_batch, batch_dims = models.seq_first_batch, {"idx": 1, "targets": 1}
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    os.environ[OVERLAP_SYNC] = "0" if run.get("overlap") is False else "1"
    vm = Varuna(model, spec.get("map"), make_batch(2, 0), batch_size=run["batch"], chunk_size=run["chunk"],
                shared_weights=shared if run.get("declare_shared", True) else None,
                schedule=run["schedule"], partition=run.get("partition"), validate=run.get("validate"),
                timeout=spec.get("timeout", 60), precision=run.get("precision"),
                seed=None if run.get("unseeded") else run.get("varuna_seed", 1234),
                input_batch_dims=batch_dims, plan=run.get("plan"), trace=run.get("trace"), trace_step=1,
                cutpoints=cutpoints, loss_reduction=loss_reduction, init=init, weights=run.get("weights"),
                shard_optimizer=run.get("shard"), bucket_mb=run.get("bucket_mb", 25.0))
    opt = make_optimizer(run["optimizer"], vm.parameters())
    vm.set_optimizer(opt, init_loss_scale=run.get("init_loss_scale", 2**20))
    losses, norms, overflows, scales, grads, early = [], [], [], [], [], []
    first = vm.load_checkpoint(run["load"], iteration=run.get("load_step", "latest")) if run.get("load") else 0
    if run.get("take"):
        before = {n: p.detach().clone() for n, p in vm.named_parameters()}
        try:
            first = take_handover(vm, run["take"])
            # a mapped tensor's storage is the file's pages, which cannot be resized (an allocation can)
            vm.mapped_params = sorted(n for n, p in vm.named_parameters() if not p.untyped_storage().resizable())
        except VarunaError as exc:
            if not run["take"].get("expect_error"):
                raise
            return {"error": f"{type(exc).__name__}: {exc}", "params_before": before,
                    "params": {n: p.detach().clone() for n, p in vm.named_parameters()}, "iteration": vm.iteration}
    owners = None  # the blob map of a publish
    snaps, snapshots = start_snapshots(vm, run["snapshot"]) if run.get("snapshot") else (None, [])
    for step in range(first, run.get("steps", 3)):
        if run.get("stall_rank") == vm.rank:
            time.sleep(run["stall_seconds"])
        hooks = []
        inject = run.get("inject_inf")
        if inject and inject["rank"] == vm.rank and inject["step"] == step:
            first = next(iter(vm.parameters()))
            hooks.append(first.register_hook(lambda g: g * float("inf")))
        die = run.get("die")
        if die and die["rank"] == vm.rank and die["step"] == step:
            calls = []

            def kill_on_second_call(module, args, output):
                calls.append(1)
                if len(calls) == 2:  # mid-step: the second micro-batch's forward
                    os.kill(os.getpid(), signal.SIGKILL)

            hooks.append(next(m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
                              and next(m.parameters()).device.type != "meta").register_forward_hook(kill_on_second_call))
        regroup = run.get("regroup")
        if regroup and step == regroup["step"]:
            lose_for_regroup(vm, regroup)
        full = make_batch(run["batch"], 100 + step)
        if run.get("bad_seq") and step == run["bad_seq"]:
            full = {k: v[:, :-1] for k, v in full.items()}
        scales.append(vm.get_loss_scale())
        loss, overflow = vm.step(vm.replica_slice(full), clip_grad_max_norm=run.get("clip"))
        for hook in hooks:
            hook.remove()
        if run.get("grads"):
            grads.append({n: p.grad.detach().clone() for n, p in vm.named_parameters()})
            early.append(vm._grad_sync.posted_early)
        if not overflow:
            opt.step()
        opt.zero_grad()
        losses.append(loss)
        norms.append(vm.grad_norm)
        overflows.append(overflow)
        crash = run.get("die_in_save")
        if crash and crash["rank"] == vm.rank and vm.iteration == crash["at"]:
            from varuna_core.checkpoint.io import FileSink

            write = FileSink.write

            def write_then_die(self, data, calls=[]):  # noqa: B006 - a call counter
                calls.append(1)
                if len(calls) == 3:  # the third tensor of this rank's file
                    os.kill(os.getpid(), signal.SIGKILL)
                write(self, data)

            FileSink.write = write_then_die
        if run.get("publish") and vm.iteration == run["publish"].get("reside_at"):
            from varuna_core.checkpoint.handover import reside

            vm.resided = reside(vm._checkpoint_state(), Path(run["publish"]["roots"][vm.rank]) / "keep")
        if run.get("publish") and vm.iteration == run["publish"]["at"]:
            owners = publish_handover(vm, run["publish"])
        if snaps is not None and snaps.due(vm.iteration):
            report = snaps.take(vm.iteration)
            snapshots.append(None if report is None else {"step": report.step, "peer": report.peer,
                                                          "copied": report.copied})
        fail = run.get("fail_copy")
        if fail and fail["rank"] == vm.rank:  # this rank's background copy hits a full disk
            import errno

            from varuna_core.checkpoint import saveload as checkpoint

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "copy")

            checkpoint.copy_file = full
        if run.get("save") and vm.iteration in run["save"].get("every", [run["save"]["at"]]):
            pending = vm.checkpoint(run["save"]["dir"], tempdir=run["save"].get("tempdir"),
                                    background=run["save"].get("background", False))
            if pending is not None:
                pending.result()
    scales.append(vm.get_loss_scale())
    result = {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "norms": torch.tensor(norms, dtype=torch.float64),
        "overflows": torch.tensor(overflows),
        "scales": torch.tensor(scales, dtype=torch.float64),
        "params": {n: p.detach().clone() for n, p in vm.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in vm.named_buffers()},
        "held_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta"),
        "stage_bytes": vm.parameter_bytes(), "full_bytes": full_bytes,
        "stage": vm.stage, "replica": vm.replica, "schedule": vm.schedule_name, "chunk": vm.chunk_size,
        "optim_bytes": sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0),
        "partition": torch.tensor(vm.partition.ranges),
        "seed": vm.seed, "initial_seed": torch.initial_seed(), "run_id": vm.run_id,
    }
    if run.get("grads"):
        result["grads"], result["posted_early"] = grads, early
    if run.get("publish"):
        result["owners"], result["resided"] = owners, getattr(vm, "resided", 0)
    if run.get("snapshot"):
        result["snapshots"] = snapshots
    if run.get("take"):
        result["taken"] = sorted(vm.taken_blobs)
        result["mapped"] = getattr(vm, "mapped_params", [])
    if run.get("evaluate"):
        eval_batch = make_batch(run["evaluate"], 999)
        # every replica evaluates the same examples here; the mean over replicas is then their loss
        result["eval"] = vm.evaluate(eval_batch)
    if run.get("evaluate_in_eval_mode"):  # the error evaluate() raises after .eval(), if any
        vm.eval()
        try:
            result["eval_mode"] = vm.evaluate(make_batch(run["batch"], 999))
        except VarunaError as exc:
            result["eval_mode_error"] = f"{type(exc).__name__}: {exc}"
        vm.train()
    return result


def lose_for_regroup(vm, spec: dict) -> None:
    """Step ``spec["step"]``: rank ``spec["lose"]`` dies before it; rank 0 plays the launcher first, putting the
    regroup of the survivors (new ranks ``spec["ranks"]``, map ``spec["map"]``) in the job's store."""
    import torch.distributed as dist

    from varuna_core.launch.protocol import Regroup, encode_regroup, regroup_key

    if vm.rank == spec["lose"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if vm.rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        message = Regroup(attempt=int(os.environ["VARUNA_ATTEMPT"]), number=1, step=spec["step"],
                          ranks=spec["ranks"], stage_to_rank_map=spec["map"], prefix="regroup-1/")
        store.set(regroup_key(1), encode_regroup(message, os.environ["VARUNA_JOB_TOKEN"]))


def publish_handover(vm, spec: dict) -> dict[str, int]:
    """Publish this step's state into this rank's own shelf root (a host of its own)."""
    from varuna_core.launch.shelf import Shelf

    root = Path(spec["roots"][vm.rank])
    return vm.publish_state(Shelf(spec["job"], root=root).reserve, copies=spec.get("copies", True),
                            final=spec.get("final", False), leaving=vm.rank in spec.get("leaving", ()),
                            hashed=vm.rank not in spec.get("alone", ()))


def start_snapshots(vm, spec: dict):
    """In-memory snapshots every ``spec["every"]`` steps into this rank's shelf root (``roots[rank]``, a host of
    its own), served to the other ranks by a shelf server in this process; returns (Snapshots, reports)."""
    import torch.distributed as dist

    from varuna_core.launch.shelf import Shelf, ShelfServer, shelf_key
    from varuna_core.worker.snapshots import Snapshots

    shelf = Shelf(shelf_key(spec["job"], 1), root=spec["roots"][vm.rank], budget=spec.get("budget"))
    server = ShelfServer(shelf, spec["token"])
    vm._test_shelf_server = server  # lives as long as the process

    def all_gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return Snapshots(spec["every"], rank=vm.rank, host=f"host{vm.rank}", shelf=shelf,
                     server=("127.0.0.1", server.port), job=spec["job"], token=spec["token"], attempt=1,
                     publish=lambda reserve, copies: vm.publish_state(reserve, copies=copies),
                     all_gather=all_gather), []


def take_handover(vm, spec: dict) -> int:
    """Take the published state from the shelf servers (this host's own shelf read directly, its data files linked
    in place)."""
    from varuna_core.launch.shelf import Shelf, fetch_into

    servers, owners = spec["servers"], spec.get("owners")
    own = spec.get("local", {}).get(str(vm.rank))  # the old rank whose host this rank is on, if any
    local = Shelf(spec["job"], root=spec["roots"][own]) if own is not None else None

    def fetch(holder: str, names: list[str], into, max_bytes: int) -> dict[str, str | None] | None:
        vm.taken_blobs = [*getattr(vm, "taken_blobs", []), *names]  # what this rank took, for the test
        if local is not None and holder == servers[own]:  # as the worker's own (worker.morph): the load checks
            unhashed = {}
            for name in names:
                entry = local.get_into(name, lambda entry: into(entry.name, entry.size), verify=False)
                if entry.digest is None:
                    unhashed[name] = None
            return unhashed or None
        host, port = holder.rsplit(":", 1)
        entries = fetch_into(host, int(port), job=spec["job"], token=spec["token"], names=names, max_bytes=max_bytes,
                             into=lambda entry: into(entry.name, entry.size), timeout=10)
        return {name: entry.digest for name, entry in entries.items()}  # each checked as it arrived

    def link(holder: str, name: str, path: Path) -> tuple[int, str | None] | None:
        if local is None or holder != servers[own] or spec.get("no_links"):
            return None
        vm.taken_blobs = [*getattr(vm, "taken_blobs", []), name]
        entry = local.link(name, path)
        return entry.size, entry.digest

    def holder_of(rank: int) -> str:
        if not 0 <= rank < len(servers):
            raise KeyError(rank)
        return servers[rank]

    def locate(name: str):
        if owners is not None:
            return servers[owners[name]]
        from varuna_core.worker.morph import holder_rank  # a snapshot: the writer's host, then the next (its copy)

        writer = holder_rank(name)
        return [servers[writer], servers[(writer + 1) % len(servers)]]

    mapped = bool(spec.get("map_files"))  # as a warm worker takes: in place, its files mapped as its memory
    return vm.take_state(step=spec["step"], locate=locate, fetch=fetch, staging=spec["staging"], link=link,
                         holder_of=holder_of, in_place=mapped, map_files=mapped,
                         drop=local.remove if local is not None else None)


def main(run_one=run_one) -> None:
    """Run every run of the spec (argv: SPEC OUT_DIR) with ``run_one(run, spec)`` and save this rank's results."""
    spec_path, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = []
    try:
        for run in spec["runs"]:
            results.append(run_one(run, spec))
    except VarunaError as exc:
        (out_dir / f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # as the library's excepthook does: no process-group teardown racing a peer's exit
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    torch.save({"runs": results}, out_dir / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
