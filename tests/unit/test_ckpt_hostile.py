"""Checkpoints prepared by someone else: a crafted index, manifest, marker or data file must end in a reported
problem or a one-line error, never in a hang, a traceback, an allocation the files do not back, or another
file's bytes in `varuna ckpt merge`'s output."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ckpt_tools import write_checkpoint  # a plain function: writes a checkpoint the way the runtime does

import varuna_cli.app as cli
from varuna_core.checkpoint import io as ckpt_io
from varuna_core.checkpoint import tools as ckpt_tools
from varuna_core.checkpoint.storage import METADATA_FILE, RawReader, RawWriter, dcp_load, dcp_save, read_metadata
from varuna_core.errors import CheckpointError, ConfigError, VarunaError
from varuna_core.util.digest import of_bytes

VARUNA = Path(sys.executable).parent / "varuna"
PASSWD = Path("/etc/passwd")
KEY = "model/fc1.weight"  # 16 x 8 float32: 512 bytes
TWIN = "optim/fc1.weight/exp_avg"  # the same shape and dtype


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("VARUNA_DEBUG", raising=False)


def _index(directory: Path) -> dict:
    return json.loads((directory / METADATA_FILE).read_text())


def _chunk(doc: dict, key: str = KEY) -> dict:
    return doc["tensors"][key]["chunks"][0]


def _reseal(directory: Path) -> None:
    """Record the current size and digest of every listed file that can be read (through links): whoever
    crafted the checkpoint can do the same, so the manifest's hashes prove nothing about these."""
    manifest = json.loads((directory / "manifest.json").read_text())
    for entry in manifest["files"]:
        path = directory / entry["path"]
        if path.is_file():
            data = path.read_bytes()
            entry["bytes"], entry["digest"] = len(data), of_bytes(data)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _write_index(directory: Path, doc: dict | bytes) -> None:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    (directory / METADATA_FILE).write_bytes(data)
    _reseal(directory)


def _edit_index(edit):
    def tamper(directory: Path) -> None:
        doc = _index(directory)
        edit(doc, directory)
        _write_index(directory, doc)
    return tamper


def _replace(name: str, make):
    def tamper(directory: Path) -> None:
        (directory / name).unlink()
        make(directory / name)
    return tamper


def _link_to_copy(directory: Path) -> None:
    """The data file moved out of the directory and linked back: sizes and hashes all match, only the link is
    wrong (it could as well point at any other file)."""
    data = directory / "__0_0.distcp"
    outside = directory.parent.parent / "elsewhere.distcp"
    data.rename(outside)
    data.symlink_to(outside)


def _link_to_passwd(directory: Path) -> None:
    (directory / "__0_0.distcp").unlink()
    (directory / "__0_0.distcp").symlink_to(PASSWD)
    _reseal(directory)


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _unlisted_file(directory: Path) -> None:
    (directory / "__5_0.distcp").write_bytes((directory / "__0_0.distcp").read_bytes())
    doc = _index(directory)
    _chunk(doc)["file"] = "__5_0.distcp"
    _write_index(directory, doc)


def _bad_manifest_name(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"].append({"path": "../../../../etc/passwd", "bytes": PASSWD.stat().st_size,
                              "digest": of_bytes(PASSWD.read_bytes())})
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _set(field: str, value):
    def edit(doc: dict, directory: Path) -> None:
        _chunk(doc)[field] = value
    return edit


def _dotdot(doc: dict, directory: Path) -> None:
    (directory.parent.parent / "x").write_bytes(PASSWD.read_bytes())
    _chunk(doc)["file"] = "../../x"


def _beyond_file(doc: dict, directory: Path) -> None:
    _chunk(doc)["offset"] = (directory / "__0_0.distcp").stat().st_size  # past every other chunk


def _huge_chunk(doc: dict, directory: Path) -> None:
    """Consistent in itself (size, chunk box, length): only the file does not hold it."""
    entry = doc["tensors"][KEY]
    entry["size"] = [10**15, 8]
    entry["chunks"] = [{"offsets": [0, 0], "sizes": [10**15, 8], "file": "__0_0.distcp",
                        "offset": (directory / "__0_0.distcp").stat().st_size, "length": 10**15 * 8 * 4}]


def _overlap(doc: dict, directory: Path) -> None:
    _chunk(doc, TWIN)["offset"] = _chunk(doc)["offset"]


def _overlapping_boxes(doc: dict, directory: Path) -> None:
    """Two boxes of the same rows, their volumes adding up to the tensor's, their bytes apart in the file."""
    chunk = _chunk(doc)
    rows, cols = doc["tensors"][KEY]["size"]
    half = chunk["length"] // 2
    first = {**chunk, "offsets": [0, 0], "sizes": [rows // 2, cols], "length": half}
    second = {**first, "offset": chunk["offset"] + half}
    doc["tensors"][KEY]["chunks"] = [first, second]


def _tensor(field: str, value):
    def edit(doc: dict, directory: Path) -> None:
        doc["tensors"][KEY][field] = value
    return edit


# case -> (tamper, what the problem says)
CASES = {
    "absolute_path": (_edit_index(_set("file", str(PASSWD))), "not a checkpoint data file"),
    "dotdot_path": (_edit_index(_dotdot), "not a checkpoint data file"),
    "trailing_newline": (_edit_index(_set("file", "__0_0.distcp\n")), "not a checkpoint data file"),
    "not_in_manifest": (_unlisted_file, "not in the manifest"),
    "manifest_lists_outside": (_bad_manifest_name, "not a checkpoint file"),
    "symlink_to_copy": (_link_to_copy, "symbolic link"),
    "symlink_to_passwd": (_link_to_passwd, "symbolic link"),
    "fifo_data": (_replace("__0_0.distcp", os.mkfifo), "FIFO"),
    "directory_data": (_replace("__0_0.distcp", Path.mkdir), "directory"),
    "fifo_index": (_replace(METADATA_FILE, os.mkfifo), "FIFO"),
    "huge_index": (lambda d: _sparse(d / METADATA_FILE, 257 * 2**20), "more than the"),
    "huge_size": (_edit_index(_tensor("size", [10**15, 8])), "elements"),
    "huge_chunk": (_edit_index(_huge_chunk), "the index needs"),
    "beyond_file": (_edit_index(_beyond_file), "the index needs"),
    "negative_offset": (_edit_index(_set("offset", -4)), "non-negative integer, got -4"),
    "wrong_length": (_edit_index(_set("length", 516)), "516 bytes for a chunk of 512"),
    "overlapping_chunks": (_edit_index(_overlap), "shares bytes"),
    "box_outside": (_edit_index(_set("offsets", [1, 0])), "reaches outside"),
    "overlapping_boxes": (_edit_index(_overlapping_boxes), "cover the same elements"),
    "bool_as_int": (_edit_index(_set("offset", True)), "non-negative integer, got True"),
    "float_as_int": (_edit_index(_set("length", 512.0)), "non-negative integer, got 512.0"),
    "unknown_dtype": (_edit_index(_tensor("dtype", "float8_quux")), "unsupported dtype"),
    "tensors_not_object": (_edit_index(lambda doc, d: doc.update(tensors=[])), "expected an object"),
    "chunks_not_list": (_edit_index(_tensor("chunks", {})), "expected a list"),
    "deep_json": (lambda d: _write_index(d, b"[" * 100_000), "nested too deeply"),
    "truncated_json": (lambda d: _write_index(d, (d / METADATA_FILE).read_bytes()[:200]), "not JSON"),
    "not_utf8": (lambda d: _write_index(d, b"\xff\xfe" + (d / METADATA_FILE).read_bytes()), "not UTF-8"),
}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_checkpoint_is_refused_everywhere(store, tmp_path, case):
    tamper, says = CASES[case]
    _, _, directory = write_checkpoint(store, 1)
    metas = read_metadata(directory).state_dict_metadata
    tamper(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    expected = {e["path"]: (e["bytes"], e["digest"]) for e in manifest["files"]}
    listed = set(expected)

    rep = ckpt_tools.verify(directory, finite=True)
    assert not rep.ok and any(says in p for p in rep.problems), rep.problems

    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    with pytest.raises(ConfigError, match="refusing to merge"):
        ckpt_tools.merge(directory, out)
    with pytest.raises((CheckpointError, ConfigError)) as info:
        ckpt_tools.merge(directory, out, force=True, optimizer=True)
    assert says in info.value.message
    assert list(out.parent.iterdir()) == []  # no output, not even a temporary file

    with pytest.raises(VarunaError) as info:
        ckpt_tools.inspect(directory)
    assert says in info.value.message

    target = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in metas.items()}
    for reader in (lambda: RawReader(directory, expected), lambda: RawReader(directory, listed=listed)):
        with pytest.raises(CheckpointError) as info:
            dcp_load(target, reader(), no_dist=True)
        assert says in info.value.message
    with pytest.raises(CheckpointError, match=says.replace("(", r"\(")):
        ckpt_tools._load(directory, [KEY, TWIN], listed)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", ["absolute_path", "dotdot_path", "symlink_to_passwd", "huge_chunk",
                                  "fifo_data", "huge_size"])
def test_without_a_manifest_the_index_alone_is_refused(store, case):
    """checkpoint.load(check_complete=False) reads without the manifest: the index's own rules still hold."""
    tamper, says = CASES[case]
    _, _, directory = write_checkpoint(store, 1)
    metas = read_metadata(directory).state_dict_metadata
    tamper(directory)
    target = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in metas.items()}
    with pytest.raises(CheckpointError, match=says):
        dcp_load(target, RawReader(directory), no_dist=True)


def test_the_files_a_manifest_may_list(store):
    _, _, directory = write_checkpoint(store, 1)
    for name in ("../__0_0.distcp", "/etc/passwd", "sub/__0_0.distcp", "__0_0.distcp\n", "model.pt", ""):
        with pytest.raises(CheckpointError, match="not a checkpoint file"):
            RawReader(directory, {name: (1, "0" * 64)})
        with pytest.raises(CheckpointError, match="not a checkpoint file"):
            read_metadata(directory, listed={name})


# --- manifest.json and COMPLETE ---------------------------------------------------------------------------


def _in_place_of(name: str, kind: str):
    def tamper(directory: Path) -> None:
        path = directory / name
        if kind == "fifo":
            path.unlink()
            os.mkfifo(path)
        elif kind == "directory":
            path.unlink()
            path.mkdir()
        elif kind == "symlink":  # to a copy of itself: only the link is wrong
            copy = directory.parent.parent / f"copy-of-{name}"
            path.rename(copy)
            path.symlink_to(copy)
        elif kind == "huge":
            _sparse(path, 257 * 2**20 if name == "manifest.json" else 2**30)
        elif kind == "deep":
            path.write_text("[" * 100_000)
        elif kind == "not_utf8":
            path.write_bytes(b"\xff" + path.read_bytes())
    return tamper


MARKER_CASES = {
    "fifo_manifest": (_in_place_of("manifest.json", "fifo"), "FIFO"),
    "directory_manifest": (_in_place_of("manifest.json", "directory"), "directory"),
    "symlink_manifest": (_in_place_of("manifest.json", "symlink"), "symbolic link"),
    "huge_manifest": (_in_place_of("manifest.json", "huge"), "more than the"),
    "deep_manifest": (_in_place_of("manifest.json", "deep"), "recursion limit"),
    "not_utf8_manifest": (_in_place_of("manifest.json", "not_utf8"), "not UTF-8"),
    "fifo_complete": (_in_place_of("COMPLETE", "fifo"), "FIFO"),
    "huge_complete": (_in_place_of("COMPLETE", "huge"), "more than the"),
    "symlink_complete": (_in_place_of("COMPLETE", "symlink"), "symbolic link"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("case", sorted(MARKER_CASES))
def test_a_crafted_manifest_or_marker_is_a_reported_problem(store, tmp_path, capsys, case):
    tamper, says = MARKER_CASES[case]
    _, _, directory = write_checkpoint(store, 1)
    tamper(directory)

    rep = ckpt_tools.verify(directory)
    assert not rep.ok and any(says in p for p in rep.problems), rep.problems
    infos = ckpt_tools.list_checkpoints(store)
    assert [i.step for i in infos] == [1]
    if "manifest" in case:
        assert says in infos[0].manifest_error and infos[0].model is None
    inspected = ckpt_tools.inspect(directory)  # the tensors are fine: shown, with the manifest's problem noted
    assert inspected.tensors and (inspected.manifest_error is not None or "complete" in case)
    out = tmp_path / "model.safetensors"
    with pytest.raises(ConfigError, match="refusing to merge"):
        ckpt_tools.merge(directory, out)
    assert not out.exists()
    for command in (["list", str(store)], ["verify", str(directory)], ["inspect", str(directory)]):
        with pytest.raises(SystemExit):
            cli.main(["ckpt", *command])
        assert "Traceback" not in capsys.readouterr().err


# --- the command line -------------------------------------------------------------------------------------


def _varuna(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VARUNA_DEBUG"}
    return subprocess.run([str(VARUNA), "ckpt", *args], capture_output=True, text=True, env=env, timeout=60)


def _hostile_store(store: Path) -> tuple[Path, Path, Path]:
    """step_1: data file linked to /etc/passwd; step_2: an index nested too deeply; step_3: a FIFO index."""
    _, _, linked = write_checkpoint(store, 1)
    _link_to_passwd(linked)
    _, _, deep = write_checkpoint(store, 2)
    _write_index(deep, b"[" * 100_000)
    _, _, fifo = write_checkpoint(store, 3)
    (fifo / METADATA_FILE).unlink()
    os.mkfifo(fifo / METADATA_FILE)
    return linked, deep, fifo


def _one_error_line(stderr: str, stdout: str) -> bool:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    return len(errors) == 1 and "Traceback" not in stderr + stdout


@pytest.mark.timeout(60)
def test_hostile_checkpoints_through_the_console_script(store, tmp_path):
    """A process of its own (each one imports torch: a few only)."""
    linked, _, _ = _hostile_store(store)
    out = tmp_path / "model.safetensors"
    for args, code in ((["verify", str(linked)], 1), (["merge", str(linked), "-o", str(out), "--force"], 1)):
        res = _varuna(*args)
        assert res.returncode == code and _one_error_line(res.stderr, res.stdout), (args, res.stderr)
        assert not out.exists()
    res = _varuna("list", str(store))
    assert res.returncode == 0 and "Traceback" not in res.stderr and "step" in res.stdout, res.stderr


@pytest.mark.timeout(60)
def test_hostile_checkpoints_through_the_cli(store, tmp_path, capsys):
    linked, deep, fifo = _hostile_store(store)
    out = tmp_path / "model.safetensors"
    for args, code in ((["verify", str(linked)], 1), (["merge", str(linked), "-o", str(out)], 2),
                       (["inspect", str(linked)], 1), (["inspect", str(deep)], 1), (["verify", str(deep)], 1),
                       (["merge", str(deep), "-o", str(out), "--force"], 1), (["verify", str(fifo)], 1),
                       (["merge", str(fifo), "-o", str(out), "--force"], 1), (["inspect", str(fifo)], 1)):
        with pytest.raises(SystemExit) as info:
            cli.main(["ckpt", *args])
        res = capsys.readouterr()
        assert info.value.code == code and _one_error_line(res.err, res.out), (args, res.err)
        assert not out.exists()


def test_markup_in_paths_and_manifest_fields_is_printed_as_text(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line wrapping in the middle of what is looked for
    store = tmp_path / "[bold]x[" / "]"
    _, _, directory = write_checkpoint(store, 1)
    assert "[bold]x[/]" in str(directory)

    def run(*args: str) -> tuple[int, str, str]:
        """(exit code, stdout, stderr), lines joined again where Rich wrapped a long path."""
        with pytest.raises(SystemExit) as info:
            cli.main(["ckpt", *args])
        out = capsys.readouterr()
        return info.value.code or 0, "".join(out.out.splitlines()), "".join(out.err.splitlines())

    code, out, err = run("list", str(store))
    assert code == 0 and "[bold]x[/]" in out, err
    code, out, err = run("verify", str(store))
    assert code == 0 and out.startswith("ok"), err
    merged = tmp_path / "[red]out[" / "]" / "model.safetensors"
    merged.parent.mkdir(parents=True)
    code, out, err = run("merge", str(store), "-o", str(merged))
    assert code == 0 and f"wrote {merged}" in out and "[bold]x[/]" in out, err

    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(model="[/]", stage_to_rank_map="[bold]0;[/]", created=":smile: [/]")
    (directory / "manifest.json").write_text(json.dumps(manifest))
    _reseal(directory)
    code, out, err = run("list", str(store))
    assert code == 0 and "of [/]" in out and "[bold]0;[/]" in out and ":smile: [/]" in out, err
    code, out, err = run("inspect", str(directory))
    assert code == 0 and ", [/]," in out and "[bold]0;[/]" in out, err
    assert "note: bytes per stage not shown: stage_to_rank_map '[bold]0;[/]' does not parse" in out
    (directory / "COMPLETE").unlink()  # merged with --force: the problems are printed as warnings
    (directory / "[bold]x.distcp").write_bytes(b"stray")
    code, out, err = run("merge", str(directory), "-o", str(merged), "--force")
    assert code == 0 and "merged despite: step_1/[bold]x.distcp: data file not listed" in err, err


# --- DCP's own exceptions ---------------------------------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    return {"model/w": torch.randn(64, 33), "model/b": torch.randn(5), "optim/w/step": torch.tensor(3.0)}


def test_a_full_disk_is_one_checkpoint_error(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_io, "_write_all", full)
    with pytest.raises(CheckpointError) as info:
        dcp_save(_state(), RawWriter(tmp_path / "c"))
    assert isinstance(info.value, Exception)
    assert "No space left on device" in info.value.message and "rank 0" in info.value.message
    assert "free space" in info.value.hint


def test_a_failure_inside_dcp_load_is_one_checkpoint_error(tmp_path):
    state = _state()
    writer = RawWriter(tmp_path / "c")
    dcp_save(state, writer)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["model/w"] = torch.zeros(3, 3)  # not the stored shape: DCP's planner refuses it
    with pytest.raises(CheckpointError) as info:
        dcp_load(target, RawReader(tmp_path / "c"), no_dist=True)
    assert info.value.message.startswith("reading the checkpoint failed on rank 0: ")
    assert "\n" not in info.value.message


def test_varuna_errors_inside_dcp_stay_themselves(tmp_path):
    state = _state()
    writer = RawWriter(tmp_path / "c")
    dcp_save(state, writer)
    expected = {f.path: (f.bytes, f.digest) for f in writer.files}
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: digest mismatch"):
        dcp_load({k: torch.zeros_like(v) for k, v in state.items()}, RawReader(tmp_path / "c", expected),
                 no_dist=True)


def test_open_source_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "real").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")
    fd = ckpt_io.open_source(tmp_path / "real")
    os.close(fd)
    for name, says in (("link", "symbolic link"), ("fifo", "FIFO"), ("missing", "does not exist")):
        with pytest.raises(CheckpointError, match=says):
            ckpt_io.open_source(tmp_path / name)
    ckpt_io.copy_file(tmp_path / "real", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"x" * 10
    with pytest.raises(CheckpointError, match="symbolic link"):
        ckpt_io.copy_file(tmp_path / "link", tmp_path / "copy2")
    assert not (tmp_path / "copy2").exists()


def test_control_characters_in_manifest_fields_are_escaped(tmp_path, capsys, monkeypatch):
    """A terminal escape in a manifest's model name reached the terminal through `varuna ckpt list/inspect`."""
    monkeypatch.setenv("COLUMNS", "2000")
    store = tmp_path / "store"
    _, _, directory = write_checkpoint(store, 1)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(model="gpt\x1b[2J\x07", created="2026\x1b]0;owned\x07")
    (directory / "manifest.json").write_text(json.dumps(manifest))
    _reseal(directory)
    for args in (["list", str(store)], ["inspect", str(directory)], ["verify", str(store)]):
        with pytest.raises(SystemExit) as info:
            cli.main(["ckpt", *args])
        out = capsys.readouterr()
        assert (info.value.code or 0) == 0, out.err
        assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err, (args, out)
        if args[0] != "verify":
            assert "gpt\\x1b[2J\\x07" in out.out, out.out


@pytest.mark.parametrize(("reports", "accepted"), [
    ([[("__0_0.distcp", 4), ("__0_1.distcp", 4), ("__0_12.distcp", 4)], [("__1_0.distcp", 4)]], True),
    ([[("__0_0.distcp", 4)], [("__0_1.distcp", 4)]], False),  # rank 1 reports rank 0's file
    ([[("__0_0.distcp", 4), ("__0_0.distcp", 4)], []], False),  # twice
    ([[("__0_01.distcp", 4)], []], False),  # another spelling of file 1
    ([[("__0_1.distcp/../x", 4)], []], False),
    ([[], [("dcp_metadata.json", 4)]], False),  # only rank 0 writes the index
])
def test_the_files_a_rank_may_report(tmp_path, reports, accepted) -> None:
    """A rank may report several files of its own (a publish writes a file per parameter), each once, and no other
    rank's: the manifest then never lists a file that its writer could not have written."""
    from varuna_core.checkpoint.saveload import _entries

    gathered = [[{"path": path, "bytes": size, "digest": "blake3:" + "0" * 64} for path, size in part]
                for part in reports]
    for part in reports:
        for path, size in part:
            if "/" not in path:
                (tmp_path / path).write_bytes(b"x" * size)
    if accepted:
        assert [e.path for e in _entries(gathered, tmp_path)] == sorted(p for part in reports for p, _ in part)
    else:
        with pytest.raises(CheckpointError, match="cannot have written"):
            _entries(gathered, tmp_path)
