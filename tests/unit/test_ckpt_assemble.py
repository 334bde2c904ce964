"""`varuna ckpt assemble`: one complete checkpoint from the parts the hosts hold in their own directories (local
ones, and remote ones through a fake `ssh` that runs the command here), and the `PART` marker those parts carry."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_ckpt_tools import TIED, VOCAB, Net  # a plain model class: what the runtime would checkpoint

import varuna_cli.app as cli
from varuna_core.checkpoint import layout
from varuna_core.checkpoint import tools as ckpt_tools
from varuna_core.checkpoint.assemble import SSHOptions, assemble, parse_source
from varuna_core.checkpoint.layout import COMPLETE_FILE, PART_FILE, latest, scan
from varuna_core.checkpoint.manifest import FileEntry, Manifest, TensorEntry
from varuna_core.checkpoint.part import PartMarker, read_part, write_part
from varuna_core.checkpoint.storage import RawWriter
from varuna_core.errors import CheckpointError, ConfigError
from varuna_core.util.digest import of_bytes

VARUNA = Path(sys.executable).parent / "varuna"
RUN = "run-a"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)


def _digest_of(path: Path) -> str:
    return of_bytes(path.read_bytes())


def make_checkpoint(store: Path, step: int, *, run: str | None = RUN, seed: int = 0) -> tuple[Net, Path]:
    """A complete checkpoint ``store/step_<step>`` of :class:`Net` with a data file per kind of tensor (model,
    optimizer, buffer, rng: five files ``__0_0.distcp`` ... ``__0_4.distcp``), as the runtime writes it."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, VOCAB, (4, 5))).square().mean().backward()
    opt.step()
    sd: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        sd[f"model/{name}"] = p.detach().clone()
        for state, value in opt.state[p].items():
            sd[f"optim/{name}/{state}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    sd["buffer/scale"] = model.scale.clone()
    sd["rng/rank0"] = torch.get_rng_state()
    directory = store / f"step_{step}"
    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=RawWriter(directory, group=lambda fqn: fqn.split("/")[0]))
    files = [FileEntry(path=f.name, bytes=f.stat().st_size, digest=_digest_of(f)) for f in sorted(directory.iterdir())]
    params = [TensorEntry(key=f"model/{n}", shape=list(p.shape), dtype=str(p.dtype))
              for n, p in model.named_parameters()]
    manifest = Manifest(
        step=step, run_id=run, created="2025-01-02T03:04:05+00:00", model="Net", structure_hash="feedc0de",
        num_segments=2, pp=1, dp=1, stage_to_rank_map="0;", partition=[(0, 2)], precision="fp32", iteration=step,
        samples_seen=4 * step, seed=seed, optimizer={"class": "AdamW", "param_groups": [{"lr": 1e-2}]}, tied=TIED,
        parameters=params, files=files)
    (directory / "manifest.json").write_text(manifest.model_dump_json(indent=2))
    if run is not None:
        (directory / "RUN").write_text(f"{run}\n")
    (directory / COMPLETE_FILE).write_text(f"{step}\n")
    return model, directory


def data_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("__*.distcp"))


def split(directory: Path, hosts: dict[Path, list[int]]) -> None:
    """Give each host store its part of the checkpoint ``directory``: RUN, manifest, index, the data files of
    the given indexes (into :func:`data_files`) and PART, as a host keeping its checkpoints locally has them."""
    names = data_files(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    step = manifest["step"]
    for store, indexes in hosts.items():
        part = store / directory.name
        part.mkdir(parents=True)
        for name in ("RUN", "manifest.json", "dcp_metadata.json", *(names[i] for i in indexes)):
            if (directory / name).exists():
                shutil.copyfile(directory / name, part / name)
        write_part(part, step=step, run_id=manifest["run_id"], host=store.name, files=[names[i] for i in indexes])


# hosts a, b, c; each data file on two of them (its writer's and a copy): any one host may be missing
LAYOUT = {"a": [0, 1, 2], "b": [2, 3, 4, 0], "c": [1, 3, 4]}
ALL = [0, 1, 2, 3, 4]


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Net, Path, dict[str, Path]]:
    """(the model, the original checkpoint, {host: its store}) for step 5 split over hosts a, b, c."""
    model, original = make_checkpoint(tmp_path / "original", 5)
    stores = {name: tmp_path / name for name in LAYOUT}
    split(original, {stores[name]: indexes for name, indexes in LAYOUT.items()})
    return model, original, stores


def assert_same_model(model: Net, directory: Path, tmp_path: Path) -> None:
    """The checkpoint in ``directory`` verifies, and merges into the model's exact tensors."""
    report = ckpt_tools.verify(directory)
    assert report.ok, report.problems
    out = tmp_path / "merged.safetensors"
    ckpt_tools.merge(directory, out)
    merged = load_file(str(out))
    expected = model.state_dict()
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(list(args))
    out = capsys.readouterr()
    return info.value.code or 0, out.out, out.err


def one_error_line(err: str, out: str = "") -> bool:
    return len([line for line in err.splitlines() if line.startswith("error:")]) == 1 and "Traceback" not in err + out


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


# --- the PART marker ---------------------------------------------------------------------------------------


def test_part_marker_round_trip_and_a_part_is_never_complete(tmp_path):
    store = tmp_path / "store"
    part = store / "step_3"
    part.mkdir(parents=True)
    assert read_part(part) is None
    path = write_part(part, step=3, run_id=RUN, host="node-1", files=["__1_0.distcp", "__0_0.distcp"])
    assert path == part / PART_FILE and not any(p.name.endswith(".tmp") for p in part.iterdir())
    marker = read_part(part)
    assert marker == PartMarker(step=3, run_id=RUN, host="node-1", files=["__0_0.distcp", "__1_0.distcp"])
    assert json.loads(path.read_text())["schema_version"] == 1
    assert [(e.step, e.complete) for e in scan(store)] == [(3, False)]
    assert latest(store) is None and latest(store, of_runs={None, RUN}) is None
    assert latest(store, complete=False).step == 3

    for bad in (dict(files=["../x"]), dict(files=["a/__0_0.distcp"]), dict(run_id="a b"), dict(host="")):
        with pytest.raises(CheckpointError, match="PART marker"):
            write_part(part, **{**dict(step=3, run_id=RUN, host="h", files=[]), **bad})
    path.write_text('{"schema_version": 1, "step": 3, "host": "h", "files": ["../../etc/passwd"]}')
    with pytest.raises(CheckpointError, match="not a valid PART marker"):
        read_part(part)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="symbolic link"):
        read_part(part)


def test_every_schema_file_matches_its_model():
    from varuna_core.schemas import SCHEMAS
    from varuna_core.util.versioned_io import schema_text

    root = Path(__file__).resolve().parents[2] / "schemas"
    assert "part.schema.json" in SCHEMAS
    for name, model in SCHEMAS.items():
        assert (root / name).read_text() == schema_text(model), "regenerate schemas/: python -m varuna_core.schemas"


# --- assembling from local directories -------------------------------------------------------------------


def test_three_hosts_assemble_into_a_checkpoint_that_verifies_and_merges(parts, tmp_path):
    model, original, stores = parts
    out = tmp_path / "out" / "new"  # a new directory
    report = assemble([stores["a"], stores["b"], stores["c"]], out)
    target = out / "step_5"
    assert report.output == str(target) and report.step == 5 and report.run == RUN and not report.warnings
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [*(p.name for p in original.iterdir())])  # RUN, manifest, index, data files, COMPLETE; no PART
    assert (target / "manifest.json").read_bytes() == (original / "manifest.json").read_bytes()
    for name in (*data_files(original), "dcp_metadata.json"):
        assert (target / name).read_bytes() == (original / name).read_bytes()
    assert leftovers(out) == ["step_5"]  # no temporary directory left beside it
    assert latest(out).step == 5
    names = data_files(original)
    by = {f.path: f.source for f in report.files}
    assert {by[names[i]] for i in (0, 1, 2)} == {str(stores["a"])}  # the first source holding it
    assert by[names[3]] == str(stores["b"]) and by["dcp_metadata.json"] == str(stores["a"])
    sources = {s.source: s for s in report.sources}
    assert sources[str(stores["c"])].files == 0 and sources[str(stores["a"])].files == 4
    assert report.bytes == sum(f.bytes for f in report.files) == sum(s.bytes for s in report.sources)
    assert_same_model(model, target, tmp_path)


@pytest.mark.parametrize("gone", list(LAYOUT))
def test_any_one_host_may_be_missing(parts, tmp_path, gone):
    model, _, stores = parts
    out = tmp_path / "out"
    shutil.rmtree(stores[gone])  # the host is gone: its directory cannot be read
    report = assemble([stores[name] for name in LAYOUT], out)
    assert any(str(stores[gone]) in w and "cannot be read" in w for w in report.warnings), report.warnings
    assert_same_model(model, out / "step_5", tmp_path)


def test_a_file_no_source_holds_is_named_and_nothing_is_left(parts, tmp_path):
    _, original, stores = parts
    out = tmp_path / "out"
    missing = data_files(original)[3]  # on b and c only (and so is 4)
    with pytest.raises(CheckpointError, match=missing) as info:
        assemble([stores["a"]], out)
    assert str(stores["a"]) in info.value.message and "step 5" in info.value.message
    assert not out.exists()  # created for nothing: removed again


def test_a_corrupt_copy_is_reported_and_a_good_one_taken(parts, tmp_path):
    model, original, stores = parts
    names = data_files(original)
    assert (original / names[0]).stat().st_size == 0  # rank 0's default file: nothing in it, copied all the same
    bad = stores["a"] / "step_5" / names[1]
    data = bytearray(bad.read_bytes())
    data[0] ^= 0xFF
    bad.write_bytes(bytes(data))  # same size, another hash
    short = stores["a"] / "step_5" / names[2]
    short.write_bytes(short.read_bytes()[:-1])  # another size: not even fetched
    report = assemble([stores["a"], stores["b"], stores["c"]], tmp_path / "out")
    by = {f.path: f.source for f in report.files}
    assert by[names[1]] == str(stores["c"]) and by[names[2]] == str(stores["b"])
    assert by[names[0]] == str(stores["a"])
    assert any(str(stores["a"]) in w and names[1] in w and "digest mismatch" in w for w in report.warnings)
    assert any(str(stores["a"]) in w and names[2] in w and "bytes" in w for w in report.warnings)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


def test_a_corrupt_only_copy_fails_and_leaves_no_checkpoint(parts, tmp_path):
    _, original, stores = parts
    name = data_files(original)[1]  # on a and c
    for host in ("a", "c"):
        path = stores[host] / "step_5" / name
        data = bytearray(path.read_bytes())
        data[0] ^= 1
        path.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=f"no good copy of {name}"):
        assemble([stores["a"], stores["b"], stores["c"]], out)
    assert leftovers(out) == []  # the half-built directory is gone; out itself existed before and stays


def test_a_disagreeing_manifest_is_named_and_its_source_not_used(parts, tmp_path):
    model, original, stores = parts
    path = stores["c"] / "step_5" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][0]["digest"] = "blake3:" + "0" * 64
    path.write_text(json.dumps(manifest))
    report = assemble([stores["c"], stores["a"], stores["b"]], tmp_path / "out")  # c first: still outvoted
    assert any(str(stores["c"]) in w and "disagrees" in w for w in report.warnings), report.warnings
    assert all(f.source != str(stores["c"]) for f in report.files)
    assert (tmp_path / "out" / "step_5" / "manifest.json").read_bytes() == (original / "manifest.json").read_bytes()
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)

    manifest["run_id"] = "other"  # a manifest of another run in a directory whose RUN says run-a
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="no source holds"):
        assemble([stores["c"], stores["a"]], tmp_path / "out2")  # c's copies of file 3 are refused: none left


def test_hostile_names_a_huge_manifest_and_links_are_refused(parts, tmp_path):
    model, original, stores = parts
    names = data_files(original)
    # a: lists a file outside the directory; b: a manifest larger than any manifest may be; c: links
    path = stores["a"] / "step_5" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"].append({"path": "../../secret", "bytes": 3, "digest": "blake3:" + "0" * 64})
    path.write_text(json.dumps(manifest))
    huge = stores["b"] / "step_5" / "manifest.json"
    with huge.open("r+b") as f:
        f.truncate(layout.MANIFEST_LIMIT + 1)  # sparse: no disk used
    c = stores["c"] / "step_5"
    (c / names[1]).unlink()
    (c / names[1]).symlink_to(original / names[1])  # the right bytes, behind a link
    with pytest.raises(CheckpointError, match="no source holds"):  # c's manifest alone is usable: c lacks files
        assemble([stores["a"], stores["b"], stores["c"]], tmp_path / "out")
    assert not (tmp_path / "out").exists()

    # with a good manifest back on a: a's manifest is the reference; b's is refused, c's link not followed
    shutil.copyfile(original / "manifest.json", path)
    report = assemble([stores["c"], stores["a"], stores["b"]], tmp_path / "out3")
    warned = " | ".join(report.warnings)
    assert f"{stores['b']}: step_5/manifest.json is {layout.MANIFEST_LIMIT + 1:,} bytes" in warned
    assert str(stores["c"]) in warned and f"{names[1]} is a symbolic link" in warned
    by = {f.path: f.source for f in report.files}
    assert by[names[1]] == str(stores["a"])
    assert_same_model(model, tmp_path / "out3" / "step_5", tmp_path)


def test_an_invalid_manifest_is_named_and_its_source_not_used(parts, tmp_path):
    model, _, stores = parts
    (stores["c"] / "step_5" / "manifest.json").write_text('{"step": 5, "files": [')
    report = assemble([stores["c"], stores["a"], stores["b"]], tmp_path / "out")
    assert any(str(stores["c"]) in w and "step_5/manifest.json is not a valid manifest" in w
               for w in report.warnings), report.warnings
    assert all(f.source != str(stores["c"]) for f in report.files)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


def test_a_manifest_naming_a_path_outside_is_refused(parts, tmp_path):
    _, _, stores = parts
    for host in LAYOUT:
        path = stores[host] / "step_5" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["files"].append({"path": "../../secret", "bytes": 3, "digest": "blake3:" + "0" * 64})
        path.write_text(json.dumps(manifest))
    (tmp_path / "secret").write_text("abc")
    with pytest.raises(CheckpointError, match=r"no source holds a usable manifest\.json") as info:
        assemble([stores[h] for h in LAYOUT], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert "../../secret" not in info.value.message  # the reasons are warnings; the error says what is missing


def test_a_linked_data_file_is_not_followed(tmp_path):
    """The only copy of a file is a link to a file of the right size and hash: refused all the same (a link could
    point at anything the user can read)."""
    _, original = make_checkpoint(tmp_path / "original", 2)
    host = tmp_path / "host"
    split(original, {host: ALL})
    name = data_files(original)[2]
    (host / "step_2" / name).unlink()
    (host / "step_2" / name).symlink_to(original / name)
    with pytest.raises(CheckpointError, match=name):
        assemble([host], tmp_path / "out")


def test_step_choice_newest_covered_or_as_asked(tmp_path):
    hosts = {name: tmp_path / name for name in ("a", "b")}
    models = {}
    for step in (4, 8, 12):
        models[step], original = make_checkpoint(tmp_path / "original", step, seed=step)
        split(original, {hosts["a"]: [0, 1], hosts["b"]: [2, 3, 4] if step != 12 else [2, 3]})  # 12 lacks file 4
    report = assemble([hosts["a"], hosts["b"]], tmp_path / "out")
    assert report.step == 8 and report.skipped_steps == [12]
    assert any("step 12" in w and "__0_4.distcp" in w for w in report.warnings)
    assert_same_model(models[8], tmp_path / "out" / "step_8", tmp_path)

    report = assemble([hosts["a"], hosts["b"]], tmp_path / "out", step=4)
    assert report.step == 4 and report.skipped_steps == []
    assert_same_model(models[4], tmp_path / "out" / "step_4", tmp_path)
    with pytest.raises(CheckpointError, match=r"__0_4\.distcp"):
        assemble([hosts["a"], hosts["b"]], tmp_path / "out", step=12)
    with pytest.raises(CheckpointError, match="no checkpoint at step 9"):
        assemble([hosts["a"], hosts["b"]], tmp_path / "out", step=9)
    with pytest.raises(ConfigError, match="already exists"):
        assemble([hosts["a"], hosts["b"]], tmp_path / "out", step=8)
    with pytest.raises(ConfigError, match="already exists"):
        assemble([hosts["a"], hosts["b"]], tmp_path / "out")  # the newest covered step, 8, is there


def test_one_step_directory_as_a_source(parts, tmp_path):
    model, _, stores = parts
    report = assemble([stores["a"] / "step_5", stores["b"] / "step_5"], tmp_path / "out")
    assert report.step == 5
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


def test_several_runs_need_a_run(tmp_path):
    hosts = {name: tmp_path / name for name in ("a", "b")}
    _, first = make_checkpoint(tmp_path / "one", 3, run="run-a")
    _, second = make_checkpoint(tmp_path / "two", 6, run="run-b", seed=1)
    split(first, {hosts["a"]: [0, 1], hosts["b"]: [2, 3, 4]})
    split(second, {hosts["a"]: ALL})
    with pytest.raises(ConfigError, match="2 runs") as info:
        assemble([hosts["a"], hosts["b"]], tmp_path / "out")
    assert "'run-a'" in info.value.message and "'run-b'" in info.value.message and "--run" in info.value.hint
    assert assemble([hosts["a"], hosts["b"]], tmp_path / "out", run="run-a").step == 3
    assert assemble([hosts["a"], hosts["b"]], tmp_path / "out", run="run-b").step == 6
    with pytest.raises(CheckpointError, match="no checkpoint of run run-c"):
        assemble([hosts["a"]], tmp_path / "out", run="run-c")
    with pytest.raises(ConfigError, match="not a valid run id"):
        assemble([hosts["a"]], tmp_path / "out", run="../x")


def test_bad_sources_and_outputs(tmp_path, parts):
    _, _, stores = parts
    (tmp_path / "file").write_text("x")
    for sources, out, says in (([], tmp_path / "o", "no sources"),
                               (["@host:/x"], tmp_path / "o", "not a user name"),
                               (["-oProxyCommand=x:/p"], tmp_path / "o", "not a host name"),
                               (["host:"], tmp_path / "o", "names no directory"),
                               ([stores["a"]], tmp_path / "file", "not a directory")):
        with pytest.raises(ConfigError, match=says):
            assemble(sources, out)
    with pytest.raises(CheckpointError, match="none of the 2 source"):
        assemble([tmp_path / "nothing", tmp_path / "file"], tmp_path / "o")
    assert not (tmp_path / "o").exists()
    assert parse_source("./a:b").remote is False and parse_source("a:b").remote is True
    assert parse_source("user@[::1]:ckpt").remote is True


# --- assembling over SSH (a fake ssh that runs the command here) ------------------------------------------

FAKE_SSH = r"""#!/bin/sh
# a stand-in for ssh: log the arguments, drop the options up to "--" and the host, run the command here
printf '%s\0' "$*" >> "$(dirname "$0")/ssh.log"
while [ $# -gt 0 ]; do a=$1; shift; [ "$a" = "--" ] && break; done
host=$1; shift
MODE
"""
MODES = {
    "plain": 'exec sh -c "$*"',
    "extra": 'case "$*" in *"exec cat"*.distcp) sh -c "$*"; printf EXTRA;; *) exec sh -c "$*";; esac',
    "grow-manifest": 'case "$*" in *"exec cat"*manifest.json) sh -c "$*"; printf "%100s" "";; '
                     '*) exec sh -c "$*";; esac',
    "hang": 'exec sleep 60',
    "hang-on-files": 'case "$*" in *"exec cat"*) exec sleep 60;; *) exec sh -c "$*";; esac',
    "unreachable": 'echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255',
    "forged": 'printf "D step_5\\nF step_5 ../../etc/passwd 10\\nF step_5 __0_0.distcp/x 3\\nEND\\n"',
}


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    """``fake_ssh(mode)`` puts an ``ssh`` of that behaviour first on PATH; returns the log of its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def install(mode: str) -> Path:
        script = bin_dir / "ssh"
        script.write_text(FAKE_SSH.replace("MODE", MODES[mode]))
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        return bin_dir / "ssh.log"

    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return install


@pytest.mark.timeout(120)
def test_remote_sources_over_ssh(parts, tmp_path, fake_ssh):
    model, original, stores = parts
    log = fake_ssh("plain")
    sources = [f"host-a:{stores['a']}", str(stores["b"]), f"me@host-c:{stores['c']}/step_5"]
    ssh = SSHOptions(port=2222, identity="/keys/id", options=("StrictHostKeyChecking=yes",), timeout=30)
    report = assemble(sources, tmp_path / "out", ssh=ssh)
    assert not report.warnings, report.warnings
    by = {f.path: f.source for f in report.files}
    assert by[data_files(original)[0]] == sources[0] and by[data_files(original)[3]] == sources[1]
    assert [s.remote for s in report.sources] == [True, False, True]
    calls = log.read_text().split("\0")[:-1]
    assert calls and all("-o BatchMode=yes -o ConnectTimeout=10" in c and "-p 2222" in c and "-i /keys/id" in c
                         and c.startswith("-o StrictHostKeyChecking=yes") for c in calls)
    assert any("-l me -i /keys/id -o IdentitiesOnly=yes -- host-c sh -c" in c for c in calls)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)

    # a remote whose only copy is corrupt: the other copy is taken, the remote named
    names = data_files(original)
    path = stores["a"] / "step_5" / names[2]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    report = assemble(sources, tmp_path / "out2", ssh=ssh)
    assert any(sources[0] in w and "digest mismatch" in w for w in report.warnings), report.warnings
    assert {f.path: f.source for f in report.files}[names[2]] == sources[1]


@pytest.mark.timeout(120)
def test_a_remote_symlink_or_fifo_is_not_read(parts, tmp_path, fake_ssh):
    model, original, stores = parts
    fake_ssh("plain")
    names = data_files(original)
    remote = stores["a"] / "step_5"
    (remote / names[1]).unlink()
    (remote / names[1]).symlink_to(original / names[1])
    os.mkfifo(remote / "PART.fifo")  # a stray FIFO: listed as something else, never opened
    report = assemble([f"h:{stores['a']}", f"h2:{stores['c']}", f"h3:{stores['b']}"], tmp_path / "out",
                      ssh=SSHOptions(timeout=30))
    assert any(names[1] in w and "link" in w for w in report.warnings), report.warnings
    assert {f.path: f.source for f in report.files}[names[1]] == f"h2:{stores['c']}"
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


@pytest.mark.timeout(120)
def test_a_remote_that_sends_more_bytes_is_cut_off(parts, tmp_path, fake_ssh):
    model, _, stores = parts
    fake_ssh("extra")
    sources = [f"host-a:{stores['a']}", str(stores["b"]), str(stores["c"])]
    report = assemble(sources, tmp_path / "out", ssh=SSHOptions(timeout=30))
    assert any(sources[0] in w and "cut off" in w for w in report.warnings), report.warnings
    assert all(f.source != sources[0] for f in report.files if f.path.endswith(".distcp"))
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["hang", "hang-on-files", "unreachable"])
def test_a_hung_or_unreachable_remote_is_a_warning(parts, tmp_path, fake_ssh, mode):
    model, _, stores = parts
    fake_ssh(mode)
    sources = [f"host-a:{stores['a']}", str(stores["b"]), str(stores["c"])]
    report = assemble(sources, tmp_path / "out", ssh=SSHOptions(timeout=1))
    said = {"hang": "sent nothing for 1 s", "hang-on-files": "sent nothing for 1 s",
            "unreachable": "ssh failed: ssh: connect to host host-a port 22: Connection refused"}[mode]
    assert any(sources[0] in w and said in w for w in report.warnings), report.warnings
    assert report.sources[0].reachable is (mode == "hang-on-files")
    assert all(f.source != sources[0] for f in report.files)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


@pytest.mark.timeout(120)
def test_a_forged_remote_listing_is_refused(parts, tmp_path, fake_ssh):
    model, _, stores = parts
    fake_ssh("forged")
    sources = [f"evil:{stores['a']}", str(stores["b"]), str(stores["c"])]
    report = assemble(sources, tmp_path / "out", ssh=SSHOptions(timeout=30))
    assert any(sources[0] in w and "unexpected listing line" in w and "etc/passwd" in w for w in report.warnings)
    assert all(f.source != sources[0] for f in report.files)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


@pytest.mark.timeout(120)
def test_a_remote_manifest_larger_than_the_limit_is_cut_off(parts, tmp_path, fake_ssh, monkeypatch):
    """The listing gives the manifest's size within the limit, but the remote sends 100 bytes more: cut off at
    the limit."""
    model, original, stores = parts
    fake_ssh("grow-manifest")
    monkeypatch.setattr(layout, "MANIFEST_LIMIT", (original / "manifest.json").stat().st_size + 10)
    report = assemble([f"h:{stores['a']}", str(stores["b"]), str(stores["c"])], tmp_path / "out",
                      ssh=SSHOptions(timeout=30))
    assert any(w.startswith("h:") and "manifest.json is larger than" in w for w in report.warnings), report.warnings
    assert all(not f.source.startswith("h:") for f in report.files)
    assert_same_model(model, tmp_path / "out" / "step_5", tmp_path)


# --- the command line -------------------------------------------------------------------------------------


def test_cli_assembles_and_prints_what_came_from_where(parts, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    model, original, stores = parts
    bad = stores["a"] / "step_5" / data_files(original)[1]
    bad.write_bytes(b"\0" * bad.stat().st_size)
    out = tmp_path / "out"
    code, stdout, stderr = run(capsys, "ckpt", "assemble", str(stores["a"]), str(stores["b"]), str(stores["c"]),
                               "-o", str(out))
    assert code == 0, stderr
    assert f"assembled {out / 'step_5'}: step 5 of run {RUN}, 6 files" in stdout
    for name in LAYOUT:
        assert str(stores[name]) in stdout
    assert "warning" in stderr and "digest mismatch" in stderr
    code, stdout, _ = run(capsys, "ckpt", "verify", str(out))
    assert code == 0 and stdout.startswith("ok")
    merged = tmp_path / "m.safetensors"
    code, _, stderr = run(capsys, "ckpt", "merge", str(out), "-o", str(merged))
    assert code == 0, stderr
    assert torch.equal(load_file(str(merged))["fc1.weight"], model.fc1.weight.detach())

    code, stdout, stderr = run(capsys, "ckpt", "assemble", str(stores["b"]), str(stores["c"]), "-o",
                               str(tmp_path / "out2"), "--step", "5", "--run", RUN, "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["step"] == 5 and len(doc["files"]) == 6 and [s["files"] for s in doc["sources"]] == [5, 1]


def test_cli_exit_codes(parts, tmp_path, capsys):
    _, original, stores = parts
    out = tmp_path / "out"
    code, _, stderr = run(capsys, "ckpt", "assemble", str(stores["a"]), "-o", str(out))
    assert code == 1 and one_error_line(stderr) and data_files(original)[3] in stderr
    assert not out.exists()
    code, _, stderr = run(capsys, "ckpt", "assemble", str(stores["a"]))
    assert code == 2 and one_error_line(stderr) and "--out" in stderr and "hint:" in stderr
    code, _, stderr = run(capsys, "ckpt", "assemble", "-o", str(out))
    assert code == 2 and one_error_line(stderr)
    code, _, stderr = run(capsys, "ckpt", "assemble", str(stores["a"]), "-o", str(out), "--step", "-1")
    assert code == 2 and one_error_line(stderr)
    out.mkdir()
    (out / "step_5").mkdir()
    code, _, stderr = run(capsys, "ckpt", "assemble", str(stores["a"]), str(stores["b"]), "-o", str(out))
    assert code == 2 and one_error_line(stderr) and "already exists" in stderr and "hint:" in stderr
    code, _, stderr = run(capsys, "ckpt", "assemble", "bad user@h:x", "-o", str(out))
    assert code == 2 and one_error_line(stderr)


def test_cli_shows_the_warnings_of_a_failed_assemble(parts, tmp_path, capsys):
    _, original, stores = parts
    name = data_files(original)[1]  # on a and c: both copies corrupt
    for host in ("a", "c"):
        path = stores[host] / "step_5" / name
        path.write_bytes(b"\0" * path.stat().st_size)
    code, _, stderr = run(capsys, "ckpt", "assemble", *(str(stores[h]) for h in LAYOUT), "-o", str(tmp_path / "o"))
    assert code == 1 and one_error_line(stderr) and f"no good copy of {name}" in stderr
    warned = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 2 and all("digest mismatch" in line for line in warned), stderr
    assert not (tmp_path / "o").exists()


def test_cli_through_the_console_script(parts, tmp_path):
    """A process of its own: one error line, no traceback."""
    _, original, stores = parts
    env = {k: v for k, v in os.environ.items() if k != "VARUNA_DEBUG"}
    res = subprocess.run([str(VARUNA), "ckpt", "assemble", str(stores["c"]), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and one_error_line(res.stderr, res.stdout), res.stderr
    assert data_files(original)[0] in res.stderr
    res = subprocess.run([str(VARUNA), "ckpt", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert "assemble" in res.stdout
