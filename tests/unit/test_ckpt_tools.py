"""`varuna ckpt`: list, inspect, verify and merge checkpoint stores (fixtures written here with dcp.save and the
library's storage layer)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import varuna_cli.app as cli
from varuna_core.checkpoint import tools as ckpt_tools
from varuna_core.checkpoint.manifest import FileEntry, Manifest, TensorEntry
from varuna_core.checkpoint.storage import RawWriter
from varuna_core.errors import CheckpointError, ConfigError
from varuna_core.util.digest import of_bytes

VARUNA = Path(sys.executable).parent / "varuna"
VOCAB, HIDDEN = 11, 8
TIED = [["emb.weight", "head.weight"]]


class Net(nn.Module):
    """Two Linear layers between an embedding and a head tied to it, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 16)
        self.fc2 = nn.Linear(16, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(idx))))) * self.scale


def _digest_of(path: Path) -> str:
    return of_bytes(path.read_bytes())


def write_checkpoint(store: Path, step: int, *, seed: int = 0, complete: bool = True, drop: tuple[str, ...] = (),
                     tied_copy: float | None = None, poison: str | None = None):
    """Write ``store/step_<step>`` the way the runtime does; return (model, optimizer, directory).

    drop: keys left out of the tensors (still in the manifest); tied_copy: also store ``model/head.weight``
    as emb.weight + tied_copy (an older writer's copy); poison: a key whose first value becomes NaN.
    """
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, VOCAB, (4, 5))).square().mean().backward()
    opt.step()
    sd: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # each Parameter once: head.weight is emb.weight
        sd[f"model/{name}"] = p.detach().clone()
        for state, value in opt.state[p].items():
            sd[f"optim/{name}/{state}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    sd["buffer/scale"] = model.scale.clone()
    sd["rng/rank0"] = torch.get_rng_state()
    if tied_copy is not None:
        sd["model/head.weight"] = sd["model/emb.weight"] + tied_copy
    if poison:
        sd[poison] = sd[poison].clone()
        sd[poison].view(-1)[0] = float("nan")
    for key in drop:
        del sd[key]
    directory = store / f"step_{step}"
    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=RawWriter(directory))
    files = [FileEntry(path=f.name, bytes=f.stat().st_size, digest=_digest_of(f)) for f in sorted(directory.iterdir())]
    params = [TensorEntry(key=f"model/{n}", shape=list(p.shape), dtype=str(p.dtype))
              for n, p in model.named_parameters()]
    manifest = Manifest(
        step=step, created="2025-01-02T03:04:05+00:00", model="Net", structure_hash="feedc0de", num_segments=2, pp=1,
        dp=1, stage_to_rank_map="0;", partition=[(0, 2)], precision="fp32", iteration=step, samples_seen=4 * step,
        seed=seed, optimizer={"class": "AdamW", "param_groups": [{"lr": 1e-2}]}, tied=TIED, parameters=params,
        files=files)
    (directory / "manifest.json").write_text(manifest.model_dump_json(indent=2))
    if complete:
        (directory / "COMPLETE").write_text(f"{step}\n")
    return model, opt, directory


def run(capsys, *args: str) -> tuple[int, str, str]:
    """`varuna ARGS` in this process through main(): (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        cli.main(list(args))
    out = capsys.readouterr()
    return info.value.code or 0, out.out, out.err


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


# --- list / resolve ---------------------------------------------------------------------------------------


def test_list_includes_incomplete_and_sorts_numerically(store, capsys):
    for step in (2, 10):
        write_checkpoint(store, step)
    write_checkpoint(store, 12, complete=False)
    (store / "step_13").mkdir()  # a writer that died before writing anything
    (store / "notes.txt").write_text("not a checkpoint")
    infos = ckpt_tools.list_checkpoints(store)
    assert [(i.step, i.complete) for i in infos] == [(2, True), (10, True), (12, False), (13, False)]
    assert infos[0].pp == 1 and infos[0].dp == 1 and infos[0].stage_to_rank_map == "0;" and infos[0].plan is False
    assert infos[0].created.startswith("2025-01-02") and infos[0].model == "Net"
    assert infos[0].bytes == sum(f.stat().st_size for f in (store / "step_2").iterdir())
    assert infos[3].manifest_error == "missing" and infos[3].bytes == 0 and infos[3].pp is None

    code, out, _ = run(capsys, "ckpt", "list", str(store), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["latest_complete"] == 10 and [c["step"] for c in doc["checkpoints"]] == [2, 10, 12, 13]
    code, out, _ = run(capsys, "ckpt", "list", str(store))
    assert code == 0 and "incomplete" in out and "latest" in out


def test_resolve_picks_the_latest_complete(store):
    write_checkpoint(store, 2)
    write_checkpoint(store, 9)
    write_checkpoint(store, 10, complete=False)
    assert ckpt_tools.resolve(store) == store / "step_9"  # 9 < 10 numerically; 10 is incomplete
    assert ckpt_tools.resolve(store / "step_10") == store / "step_10"
    assert ckpt_tools.resolve(store / "step_2") == store / "step_2"


def test_bad_stores_are_config_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="does not exist"):
        ckpt_tools.list_checkpoints(tmp_path / "nope")
    with pytest.raises(ConfigError, match="holds no checkpoints"):
        ckpt_tools.resolve(tmp_path)
    write_checkpoint(tmp_path / "only_incomplete", 4, complete=False)
    with pytest.raises(ConfigError, match="no complete checkpoint") as info:
        ckpt_tools.resolve(tmp_path / "only_incomplete")
    assert "step_4" in str(info.value)
    code, _, err = run(capsys, "ckpt", "list", str(tmp_path / "nope"))
    assert code == 2 and err.startswith("error: checkpoint store") and "hint:" in err
    with pytest.raises(ConfigError, match="one checkpoint, not a store"):
        ckpt_tools.list_checkpoints(tmp_path / "only_incomplete" / "step_4")
    (tmp_path / "only_incomplete" / "step_5").mkdir()  # nothing written yet: no tensor index to inspect
    with pytest.raises(CheckpointError, match="cannot read the tensor index"):
        ckpt_tools.inspect(tmp_path / "only_incomplete" / "step_5")
    code, _, err = run(capsys, "ckpt", "inspect", str(tmp_path / "only_incomplete" / "step_5"))
    assert code == 1 and "hint: " in err


# --- inspect ----------------------------------------------------------------------------------------------


def test_inspect_totals(store, capsys):
    model, opt, directory = write_checkpoint(store, 3)
    rep = ckpt_tools.inspect(store)
    assert rep.path == str(directory) and rep.step == 3 and rep.complete and rep.model == "Net"
    params = dict(model.named_parameters())
    assert sorted(t.key for t in rep.tensors if t.kind == "model") == sorted(f"model/{n}" for n in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    optim_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert rep.totals["model"].bytes == param_bytes and rep.totals["model"].tensors == len(params)
    assert rep.totals["buffer"].bytes == VOCAB * 4 and rep.totals["buffer"].tensors == 1
    assert rep.totals["optim"].bytes == optim_bytes and rep.totals["optim"].tensors == 3 * len(params)
    assert rep.totals["other"].tensors == 1  # rng/rank0
    assert rep.total_bytes == sum(t.bytes for t in rep.totals.values())
    fc1 = next(t for t in rep.tensors if t.key == "model/fc1.weight")
    assert fc1.shape == [16, HIDDEN] and fc1.dtype == "torch.float32" and fc1.bytes == 16 * HIDDEN * 4
    # one stage: everything but the rng state is on stage 0
    assert rep.by_stage is not None and len(rep.by_stage) == 1
    assert rep.by_stage[0].bytes == rep.total_bytes - rep.totals["other"].bytes
    prefixes = {g.name: g for g in rep.by_prefix}
    assert set(prefixes) == {"emb", "fc1", "fc2", "scale", "(other)"}
    assert prefixes["fc1"].model == sum(p.numel() * 4 for n, p in params.items() if n.startswith("fc1."))
    assert prefixes["scale"].buffer == VOCAB * 4 and sum(g.bytes for g in rep.by_prefix) == rep.total_bytes

    code, out, _ = run(capsys, "ckpt", "inspect", str(directory), "--json")
    assert code == 0 and json.loads(out)["totals"]["optim"]["bytes"] == optim_bytes
    code, out, _ = run(capsys, "ckpt", "inspect", str(store), "--max-keys", "2")
    assert code == 0 and "fc1" in out and "more tensors" in out


def test_bytes_per_stage_follow_the_rank_files(store):
    """Which rank's file holds a tensor, through the stage_to_rank_map, gives its stage."""
    write_checkpoint(store, 1)
    manifest = Manifest.model_validate_json((store / "step_1" / "manifest.json").read_text())
    manifest.stage_to_rank_map, manifest.pp, manifest.dp = "0,2;1,3;", 2, 2
    tensors = [ckpt_tools.TensorInfo(key=k, kind=ckpt_tools._kind(k), shape=[n], dtype="torch.float32", bytes=4 * n)
               for k, n in (("model/a", 10), ("optim/a/exp_avg", 10), ("model/b", 5), ("buffer/c", 2),
                            ("rng/rank3", 100))]
    where = {"model/a": {"__2_0.distcp"}, "optim/a/exp_avg": {"__0_0.distcp"}, "model/b": {"__3_0.distcp"},
             "buffer/c": {"__1_0.distcp"}, "rng/rank3": {"__3_0.distcp"}}
    stages, note = ckpt_tools._by_stage(tensors, where, manifest)
    assert [(g.name, g.tensors, g.model, g.optim, g.buffer) for g in stages] == [
        ("stage 0", 2, 40, 40, 0), ("stage 1", 2, 20, 0, 8)]
    assert "stage_to_rank_map" in note
    where["model/b"] = {"__0_0.distcp", "__1_0.distcp"}  # chunks on two stages: no per-stage answer
    stages, note = ckpt_tools._by_stage(tensors, where, manifest)
    assert stages is None and "top-level module" in note


# --- verify -----------------------------------------------------------------------------------------------


def test_verify_ok(store, capsys):
    write_checkpoint(store, 5)
    rep = ckpt_tools.verify(store, finite=True)
    assert rep.ok and rep.problems == [] and rep.first_problem is None, rep.problems
    assert rep.files_checked == 2 and rep.parameters_checked == 5 and rep.tied_groups_checked == 1
    assert rep.tensors_checked_finite == 5 + 15  # model + optim (the step counters are float tensors too)
    code, out, _ = run(capsys, "ckpt", "verify", str(store), "--finite")
    assert code == 0 and out.startswith("ok") and "step_5" in out and "finite" in out
    code, out, _ = run(capsys, "ckpt", "verify", str(store / "step_5"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["problems"] == []


def test_an_equal_tied_copy_is_accepted(store):
    write_checkpoint(store, 5, tied_copy=0.0)
    rep = ckpt_tools.verify(store)
    assert rep.ok, rep.problems


def _flip_byte(directory: Path) -> str:
    data = sorted(directory.glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return f"{directory.name}/{data.name}: digest mismatch (file changed or corrupt)"


@pytest.mark.parametrize("case", ["incomplete", "flipped", "missing_param", "tied_differs", "nonfinite"])
def test_verify_names_the_first_problem(store, capsys, case):
    kwargs = {"incomplete": {"complete": False}, "missing_param": {"drop": ("model/fc1.bias",)},
              "tied_differs": {"tied_copy": 1e-3}, "nonfinite": {"poison": "optim/fc2.weight/exp_avg"}}.get(case, {})
    _, _, directory = write_checkpoint(store, 8, **kwargs)
    expected = {
        "incomplete": "step_8: incomplete (no COMPLETE marker",
        "missing_param": "step_8: parameter model/fc1.bias is missing from the tensors",
        "tied_differs": "step_8: tied model/head.weight differs from model/emb.weight",
        "nonfinite": "step_8: optim/fc2.weight/exp_avg has 1 non-finite value(s)",
    }.get(case)
    if case == "flipped":
        expected = _flip_byte(directory)
    args = ["ckpt", "verify", str(directory)] + (["--finite"] if case == "nonfinite" else [])
    rep = ckpt_tools.verify(directory, finite=case == "nonfinite")
    assert not rep.ok and rep.first_problem.startswith(expected), rep.problems
    code, out, err = run(capsys, *args)
    assert code == 1
    assert err.splitlines()[0].startswith(f"error: {expected}"), err
    assert expected in out
    code, out, _ = run(capsys, *args, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["first_problem"].startswith(expected)
    if case == "nonfinite":  # found only when asked for
        assert ckpt_tools.verify(directory).ok


def test_verify_flipped_byte_through_the_console_script(store):
    _, _, directory = write_checkpoint(store, 8)
    expected = _flip_byte(directory)
    env = {k: v for k, v in os.environ.items() if k != "VARUNA_DEBUG"}
    res = subprocess.run([str(VARUNA), "ckpt", "verify", str(store)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines()[0] == f"error: {expected}"
    assert "__0_0.distcp" in res.stdout


def _as_written_before_blake3(directory: Path) -> None:
    """Rewrite ``directory``'s manifest as releases before BLAKE3 wrote it: each file's bare ``sha256``."""
    manifest = json.loads((directory / "manifest.json").read_text())
    for entry in manifest["files"]:
        del entry["digest"]
        entry["sha256"] = hashlib.sha256((directory / entry["path"]).read_bytes()).hexdigest()
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_whose_manifest_records_sha256_is_checked_by_sha256(store, capsys):
    """Checkpoints written before the digests named their algorithm still verify and load, each file checked by
    the SHA-256 its manifest records; a changed byte is still found."""
    from varuna_core.checkpoint.layout import read_manifest
    from varuna_core.checkpoint.storage import RawReader, dcp_load

    model, _, directory = write_checkpoint(store, 4)
    _as_written_before_blake3(directory)
    manifest = read_manifest(directory)
    assert all(f.digest.startswith("sha256:") for f in manifest.files)
    rep = ckpt_tools.verify(store)
    assert rep.ok and rep.files_checked == 2, rep.problems
    expected = {f.path: (f.bytes, f.digest) for f in manifest.files}
    target = {f"model/{n}": torch.zeros_like(p) for n, p in model.named_parameters()}
    dcp_load(target, RawReader(directory, expected), no_dist=True)  # hashes every file it reads
    assert all(torch.equal(target[f"model/{n}"], p) for n, p in model.named_parameters())
    problem = _flip_byte(directory)
    rep = ckpt_tools.verify(store)
    assert not rep.ok and rep.first_problem.startswith(problem), rep.problems
    with pytest.raises(CheckpointError, match="digest mismatch"):
        dcp_load(target, RawReader(directory, expected), no_dist=True)
    code, _, err = run(capsys, "ckpt", "verify", str(store))
    assert code == 1 and err.splitlines()[0] == f"error: {problem}", err


def test_verify_sizes_extra_files_and_manifest(store):
    _, _, directory = write_checkpoint(store, 8)
    data = sorted(directory.glob("__*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-10])
    (directory / "__7_0.distcp").write_bytes(b"stray")
    (directory / "README").write_text("notes")
    rep = ckpt_tools.verify(directory)
    assert rep.problems[0].startswith(f"step_8/{data.name}: size ")
    assert rep.problems[1].startswith("step_8/__7_0.distcp: data file not listed in the manifest")
    assert any("README" in n for n in rep.notes) and len(rep.problems) == 2
    (directory / "manifest.json").write_text("{}")
    rep = ckpt_tools.verify(directory)
    assert rep.problems[0].startswith("step_8/manifest.json: invalid")


def test_finite_check_in_small_chunks(store):
    _, _, directory = write_checkpoint(store, 8, poison="model/fc2.bias")
    rep = ckpt_tools.verify(directory, finite=True, chunk_bytes=1)  # one tensor per load
    assert rep.problems == ["step_8: model/fc2.bias has 1 non-finite value(s) (nan or inf) of 8"]
    assert rep.tensors_checked_finite == 20


# --- merge ------------------------------------------------------------------------------------------------


def test_merge_loads_into_the_unpartitioned_model(store, tmp_path, capsys):
    model, opt, directory = write_checkpoint(store, 6)
    out = tmp_path / "merged" / "model.safetensors"
    out.parent.mkdir()
    rep = ckpt_tools.merge(store, out, optimizer=True)
    assert rep.output == str(out) and rep.step == 6 and rep.tied_copies == ["head.weight <- emb.weight"]
    state = load_file(str(out))
    assert set(state) == set(model.state_dict())  # head.weight included
    fresh = Net()
    fresh.load_state_dict(state, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.head.weight is fresh.emb.weight  # still tied after loading
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["step"] == "6" and meta["model"] == "Net" and meta["structure_hash"] == "feedc0de"
    assert json.loads(meta["tied"]) == TIED
    # optimizer state: a second file, <parameter>/<state>
    optim_path = tmp_path / "merged" / "model.optim.safetensors"
    assert rep.optimizer_output == str(optim_path)
    optim = load_file(str(optim_path))
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(optim[f"{name}/{key}"], value), (name, key)
    assert len(optim) == 15 and rep.optimizer_tensors == 15
    assert not list(out.parent.glob(".*.tmp"))

    out2 = tmp_path / "cli.safetensors"
    code, stdout, _ = run(capsys, "ckpt", "merge", str(directory), "-o", str(out2), "--json")
    doc = json.loads(stdout)
    assert code == 0 and doc["output"] == str(out2) and doc["tensors"] == len(model.state_dict())
    assert doc["optimizer_output"] is None and not (tmp_path / "cli.optim.safetensors").exists()


def test_merge_refuses_an_incomplete_checkpoint(store, tmp_path, capsys):
    _, _, directory = write_checkpoint(store, 6, complete=False)
    out = tmp_path / "model.safetensors"
    with pytest.raises(ConfigError, match=r"refusing to merge .*step_6: incomplete"):
        ckpt_tools.merge(directory, out)
    assert not out.exists()
    code, _, err = run(capsys, "ckpt", "merge", str(directory), "-o", str(out))
    assert code == 2 and "incomplete" in err.splitlines()[0] and "--force" in err and not out.exists()
    rep = ckpt_tools.merge(directory, out, force=True)
    assert rep.forced and "incomplete" in rep.problems[0]
    Net().load_state_dict(load_file(str(out)), strict=True)


def test_merge_refuses_a_corrupt_checkpoint(store, tmp_path):
    _, _, directory = write_checkpoint(store, 6)
    expected = _flip_byte(directory)
    with pytest.raises(ConfigError) as info:
        ckpt_tools.merge(store, tmp_path / "m.safetensors")
    assert expected in info.value.message
