"""Pretrained weights per stage (``varuna_core.model.weights``): Hugging Face sharded directories and
``varuna ckpt merge``-style single files load into a model built on meta; a stage opens only its shards; hostile
files and mismatched models are one-line errors naming the thing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import varuna_core
from varuna_core import ConfigError, materialize, meta_init
from varuna_core.model import weights as W
from varuna_core.model.weights import WeightSource, load_into, load_weights

tf = pytest.importorskip("transformers")


def hf_config(name: str):
    if name == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                                 bos_token_id=0, eos_token_id=0)
    return tf.LlamaForCausalLM, tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=100, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved(request, tmp_path_factory):
    """(name, directory) of a tiny pretrained model saved sharded, as the hub serves large ones."""
    cls, cfg = hf_config(request.param)
    torch.manual_seed(1234)
    directory = tmp_path_factory.mktemp(request.param)
    cls(cfg).save_pretrained(directory, max_shard_size="20KB")
    assert (directory / W.INDEX_NAME).is_file() and not (directory / W.SINGLE_NAME).exists()
    return request.param, directory


def on_meta(name: str) -> nn.Module:
    cls, cfg = hf_config(name)
    with meta_init():
        return cls(cfg)


def loss(model: nn.Module) -> torch.Tensor:
    model.eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss


def index_of(directory) -> dict[str, str]:
    return json.loads((directory / W.INDEX_NAME).read_text())["weight_map"]


# ----------------------------------------------------------------------------------------------------------
# (a) full load equals from_pretrained


def test_full_load_equals_from_pretrained(saved):
    name, directory = saved
    cls, _ = hf_config(name)
    reference = cls.from_pretrained(directory)
    model = materialize(on_meta(name), seed=7)
    report = varuna_core.load_weights(model, directory)
    assert len(set(report.shards_opened)) == len(set(index_of(directory).values())) > 1
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for key, value in model.named_parameters(remove_duplicate=False):
        assert torch.equal(value, ref[key]), key
    for key, value in model.named_buffers():
        assert torch.equal(value, dict(reference.named_buffers())[key]), key
    assert torch.equal(loss(model), loss(reference))
    if name == "gpt2":  # HF stores the tied head under the embedding's name only
        assert report.tied == ["lm_head.weight <- transformer.wte.weight"]
        assert model.lm_head.weight is model.transformer.wte.weight


def test_source_reads_headers_lazily(saved):
    _, directory = saved
    with WeightSource.open(directory) as source:
        assert source.opened == []  # names come from the index
        assert set(source.names()) == set(index_of(directory))
        first = source.names()[0]
        assert source.dtype(first) == torch.float32
        assert source.shape(first) == tuple(source.read(first).shape)
        assert source.opened == [index_of(directory)[first]]
    assert source._handles == {}


# ----------------------------------------------------------------------------------------------------------
# (b) a stage reads only its shards


def count_opens(monkeypatch) -> list[str]:
    import safetensors

    calls: list[str] = []
    real = safetensors.safe_open

    def spy(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    return calls


STAGE0 = {"gpt2": ("transformer.wte", "transformer.wpe", "transformer.h.0."),
          "llama": ("model.embed_tokens", "model.layers.0.")}


def test_stage_reads_only_its_shards(saved, monkeypatch):
    name, directory = saved
    prefixes = STAGE0[name]
    model = materialize(on_meta(name), seed=3, modules=lambda m: (m + ".").startswith(prefixes))
    real = [k for k, v in model.named_parameters(remove_duplicate=False) if not v.is_meta]
    assert real and len(real) < len(list(model.named_parameters(remove_duplicate=False)))
    weight_map = index_of(directory)
    wanted = {weight_map[k] for k in real if k in weight_map}
    assert wanted < set(weight_map.values())  # the test means something: other shards exist
    calls = count_opens(monkeypatch)
    report = load_weights(model, directory)  # names=None: every tensor not on meta
    assert len(calls) == len(wanted) and set(report.shards_opened) == wanted
    reference = dict(hf_config(name)[0].from_pretrained(directory).named_parameters(remove_duplicate=False))
    for key, value in model.named_parameters(remove_duplicate=False):
        if not value.is_meta:
            assert torch.equal(value, reference[key]), key


def test_explicit_names_load_only_those(saved, monkeypatch):
    name, directory = saved
    block = "transformer.h.1." if name == "gpt2" else "model.layers.1."
    model = materialize(on_meta(name), seed=3, modules=lambda m: (m + ".").startswith(block))
    names = [k for k, v in model.named_parameters() if not v.is_meta]
    calls = count_opens(monkeypatch)
    with WeightSource.open(directory) as source:
        report = load_into(model, source, names=names)
    assert sorted(report.loaded) == sorted(names)
    assert len(calls) == len({index_of(directory)[k] for k in names})


# ----------------------------------------------------------------------------------------------------------
# (d) varuna ckpt merge output: one file, tied copies, metadata


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def merged_state(seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(10, 4, generator=g)
    return {"emb.weight": emb, "head.weight": emb.clone(), "fc.weight": torch.randn(4, 4, generator=g),
            "fc.bias": torch.randn(4, generator=g), "scale": torch.randn(4, generator=g)}


def write_merged(path, state) -> None:
    """As ``checkpoint.tools.merge`` writes: the model's own names, tied copies cloned, string metadata."""
    save_file(state, str(path), metadata={"format": "pt", "step": "3", "source": "x", "model": "Tiny",
                                          "structure_hash": "", "tied": json.dumps([["emb.weight", "head.weight"]])})


def test_merge_style_file_loads(tmp_path):
    state = merged_state()
    write_merged(tmp_path / "merged.safetensors", state)
    with meta_init():
        model = Tiny()
    materialize(model, seed=1)
    report = load_weights(model, tmp_path / "merged.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert report.tied == ["head.weight <- emb.weight"] and model.head.weight is model.emb.weight
    assert WeightSource.open(tmp_path / "merged.safetensors").metadata()["step"] == "3"


@pytest.mark.parametrize("only", ["emb.weight", "head.weight"])
def test_tied_weight_under_any_one_name(tmp_path, only):
    state = merged_state()
    del state["head.weight" if only == "emb.weight" else "emb.weight"]
    write_merged(tmp_path / "m.safetensors", state)
    model = Tiny()
    report = load_weights(model, tmp_path / "m.safetensors")
    assert torch.equal(model.head.weight, state[only]) and report.loaded.count(only) == 1


def test_directory_with_single_file_and_dtype_conversion(tmp_path):
    state = {k: v.half() for k, v in merged_state().items()}
    save_file(state, str(tmp_path / W.SINGLE_NAME))
    model = Tiny()
    load_weights(model, tmp_path)
    assert model.fc.weight.dtype == torch.float32 and torch.equal(model.fc.weight, state["fc.weight"].float())
    assert WeightSource.open(tmp_path).dtype("fc.weight") == torch.float16


def test_missing_buffer_is_reported_not_an_error(tmp_path):
    state = merged_state()
    del state["scale"]
    write_merged(tmp_path / "m.safetensors", state)
    assert load_weights(Tiny(), tmp_path / "m.safetensors").missing_buffers == ["scale"]


# ----------------------------------------------------------------------------------------------------------
# (c) mismatches and hostile files: one line, naming the thing


def one_line(excinfo, *needles: str) -> None:
    text = str(excinfo.value)
    assert type(excinfo.value) is ConfigError and "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def test_missing_parameter_is_named(tmp_path):
    state = merged_state()
    del state["fc.bias"]
    write_merged(tmp_path / "m.safetensors", state)
    with pytest.raises(ConfigError) as e:
        load_weights(Tiny(), tmp_path / "m.safetensors")
    one_line(e, "'fc.bias'", "not in weights")


def test_extra_tensor_is_named_unless_ignored_or_not_strict(tmp_path):
    state = dict(merged_state(), **{"blocks.0.attn.masked_bias": torch.zeros(1)})
    write_merged(tmp_path / "m.safetensors", state)
    with pytest.raises(ConfigError) as e:
        load_weights(Tiny(), tmp_path / "m.safetensors")
    one_line(e, "'blocks.0.attn.masked_bias'", "not a parameter")
    report = load_weights(Tiny(), tmp_path / "m.safetensors", ignore=r"\.attn\.masked_bias$")
    assert report.ignored == ["blocks.0.attn.masked_bias"]
    load_weights(Tiny(), tmp_path / "m.safetensors", strict=False)
    with pytest.raises(ConfigError) as e:
        load_weights(Tiny(), tmp_path / "m.safetensors", ignore="(")
    one_line(e, "ignore pattern")


def test_shape_mismatch_names_both_shapes_and_loads_nothing(tmp_path):
    state = dict(merged_state(), **{"fc.weight": torch.zeros(4, 5)})
    write_merged(tmp_path / "m.safetensors", state)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / "m.safetensors")
    one_line(e, "'fc.weight'", "[4, 5]", "[4, 4]")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_bad_names_selection(tmp_path):
    write_merged(tmp_path / "m.safetensors", merged_state())
    with pytest.raises(ConfigError) as e:
        load_weights(Tiny(), tmp_path / "m.safetensors", names=["fc.wieght"])
    one_line(e, "'fc.wieght'", "fc.weight")
    with meta_init():
        model = Tiny()
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / "m.safetensors", names=["fc.weight"])
    one_line(e, "'fc.weight'", "on meta")


def sharded(tmp_path, index, shards=None):
    """A model directory with ``index`` (text or JSON-able) and ``shards`` ({file: tensors | bytes})."""
    tmp_path.mkdir(exist_ok=True)
    text = index if isinstance(index, str) else json.dumps(index)
    (tmp_path / W.INDEX_NAME).write_text(text)
    for file, content in (shards or {}).items():
        if isinstance(content, bytes):
            (tmp_path / file).write_bytes(content)
        else:
            save_file(content, str(tmp_path / file))
    return tmp_path


GOOD = {"a.safetensors": {"x": torch.ones(3)}}


@pytest.mark.parametrize("index, needles", [
    ("{not json", ["not JSON"]),
    ("[1, 2]", ["JSON list"]),
    ({"metadata": {}}, ["weight_map"]),
    ({"weight_map": {"x": 3}}, ["'x'", "not a file name"]),
    ({"weight_map": {"x": "../x.safetensors"}}, ["'../x.safetensors'", "not a plain file name"]),
    ({"weight_map": {"x": "/etc/passwd"}}, ["'/etc/passwd'", "not a plain file name"]),
    ({"weight_map": {"x": "sub/a.safetensors"}}, ["'sub/a.safetensors'", "not a plain file name"]),
    ({"weight_map": {"x": ".."}}, ["'..'"]),
    ({"weight_map": {"x": "gone.safetensors"}}, ["gone.safetensors", "does not exist"]),
])
def test_hostile_index(tmp_path, index, needles):
    directory = sharded(tmp_path / "m", index, GOOD)
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, *needles)


def test_index_over_the_limit_is_refused_unread(tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    with open(directory / W.INDEX_NAME, "wb") as f:
        f.truncate(W.INDEX_LIMIT + 1)  # sparse: costs no disk
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, W.INDEX_NAME, "more than")


def test_symlink_shard_out_of_the_directory_is_refused(tmp_path):
    save_file({"x": torch.ones(3)}, str(tmp_path / "outside.safetensors"))
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors"}})
    (directory / "a.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, "a.safetensors", "symbolic link")


def test_symlinks_inside_the_directory_and_into_hub_blobs_are_followed(tmp_path):
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors"}},
                        {"real.safetensors": GOOD["a.safetensors"]})
    (directory / "a.safetensors").symlink_to("real.safetensors")
    assert torch.equal(WeightSource.open(directory).read("x"), torch.ones(3))
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file({"x": torch.ones(3)}, str(repo / "blobs" / "abc123"))
    (repo / "snapshots" / "rev").mkdir(parents=True)
    snapshot = repo / "snapshots" / "rev"
    (snapshot / W.SINGLE_NAME).symlink_to("../../blobs/abc123")
    assert torch.equal(WeightSource.open(snapshot).read("x"), torch.ones(3))


def test_fifo_shard_and_device_do_not_hang(tmp_path):
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors"}})
    os.mkfifo(directory / "a.safetensors")
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, "a.safetensors", "FIFO")
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory / "a.safetensors")  # named directly: still not opened for reading
    one_line(e, "FIFO")
    with pytest.raises(ConfigError) as e:
        WeightSource.open("/dev/zero")
    one_line(e, "/dev/zero", "character device")


@pytest.mark.parametrize("content", [b"", b"\x00" * 7, os.urandom(256), b"\x10\x00\x00\x00\x00\x00\x00\x00{}"])
def test_shard_that_is_not_safetensors(tmp_path, content):
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors"}}, {"a.safetensors": content})
    source = WeightSource.open(directory)  # shards are opened on use
    with pytest.raises(ConfigError) as e:
        source.read("x")
    one_line(e, "a.safetensors", "not a readable safetensors file")


def test_truncated_file(tmp_path):
    save_file({"x": torch.ones(100)}, str(tmp_path / "full.safetensors"))
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-40])
    with pytest.raises(ConfigError) as e:
        load_weights(nn.Linear(10, 10), tmp_path / "cut.safetensors")
    one_line(e, "cut.safetensors", "not a readable safetensors file")


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}, GOOD)
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory).read("y")
    one_line(e, "'y'", "does not hold it")


def test_nothing_loadable(tmp_path):
    with pytest.raises(ConfigError) as e:
        WeightSource.open(tmp_path)
    one_line(e, W.SINGLE_NAME, W.INDEX_NAME)
    with pytest.raises(ConfigError) as e:
        WeightSource.open(tmp_path / "nope.safetensors")
    one_line(e, "does not exist")
    with pytest.raises(ConfigError) as e:
        WeightSource.open(3)
    one_line(e, "must be a path")
    write_merged(tmp_path / "m.safetensors", merged_state())
    with pytest.raises(ConfigError) as e:
        WeightSource.open(tmp_path / "m.safetensors").read("nope")
    one_line(e, "'nope'")


# ----------------------------------------------------------------------------------------------------------
# dtypes that cannot be the tensor's, a tensor named twice, links out of a hub cache


class WithIds(nn.Module):
    """A float parameter and an integer buffer (position ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ids", torch.arange(4, dtype=torch.int64))


def ids_state(**changed: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"fc.weight": torch.randn(4, 4, generator=g), "fc.bias": torch.randn(4, generator=g),
            "ids": torch.arange(4, dtype=torch.int64)} | changed


DTYPE_CASES = [
    ({"fc.weight": torch.ones(4, 4, dtype=torch.bool)}, ("'fc.weight' is bool in w.safetensors, but the parameter "
                                                         "of WithIds is float32")),
    ({"fc.weight": torch.ones(4, 4, dtype=torch.int64)}, "'fc.weight' is int64"),
    ({"fc.bias": torch.ones(4, dtype=torch.uint8)}, "'fc.bias' is uint8"),
    ({"fc.bias": torch.ones(4, dtype=torch.complex64)}, "'fc.bias' is complex64"),
    ({"ids": torch.arange(4, dtype=torch.float32)}, ("'ids' is float32 in w.safetensors, but the buffer of WithIds "
                                                     "is int64")),
    ({"ids": torch.ones(4, dtype=torch.bool)}, "'ids' is bool"),
]


# a model built on meta keeps its buffers real (meta_init() moves parameters only): they load as on a real model
@pytest.mark.parametrize(("changed", "needle", "on_meta"), [
    (changed, needle, on_meta) for changed, needle in DTYPE_CASES for on_meta in (False, True)
    if not (on_meta and "ids" in changed)])
def test_a_dtype_that_cannot_be_the_tensors_is_refused_before_anything_is_copied(tmp_path, changed, needle,
                                                                                 on_meta):
    save_file(ids_state(**changed), str(tmp_path / "w.safetensors"))
    if on_meta:  # the path of Varuna(weights=...) on a model built on meta: values made, then overwritten
        from varuna_core.model.materialize import owner_values, value_plan

        with meta_init():
            model = WithIds()
        plan = value_plan(model, 0, None, "cpu")
        with pytest.raises(ConfigError) as e, WeightSource.open(tmp_path / "w.safetensors") as source:
            for owner in (model, model.fc):
                owner_values(plan, owner, source)
        one_line(e, needle.split(" in ")[0], "the model's tensor is")
        return
    model = WithIds()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / "w.safetensors")
    one_line(e, needle)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing copied


@pytest.mark.parametrize(("changed", "dtype"), [
    ({"fc.weight": torch.ones(4, 4, dtype=torch.float64)}, torch.float32),
    ({"fc.weight": torch.ones(4, 4, dtype=torch.bfloat16)}, torch.float32),
    ({"ids": torch.arange(4, dtype=torch.int32)}, torch.int64),
    ({"ids": torch.arange(4, dtype=torch.uint8)}, torch.int64),
])
def test_conversions_that_keep_the_meaning_are_allowed(tmp_path, changed, dtype):
    save_file(ids_state(**changed), str(tmp_path / "w.safetensors"))
    model = WithIds()
    load_weights(model, tmp_path / "w.safetensors")
    name = next(iter(changed))
    assert model.state_dict()[name].dtype == dtype
    assert torch.equal(model.state_dict()[name], changed[name].to(dtype))


def test_castable_rules():
    assert W.castable(torch.float16, torch.float32) and W.castable(torch.float32, torch.bfloat16)
    assert W.castable(torch.int8, torch.int16) and W.castable(torch.uint8, torch.int16)
    for source, target in [(torch.int64, torch.int32), (torch.int8, torch.uint8), (torch.uint8, torch.int8),
                           (torch.bool, torch.uint8), (torch.uint8, torch.bool), (torch.float32, torch.complex64),
                           (torch.complex64, torch.float32), (torch.int32, torch.float32)]:
        assert not W.castable(source, target), (source, target)


TWO = {"a.safetensors": {"x": torch.ones(3)}, "b.safetensors": {"x": torch.zeros(3), "y": torch.ones(2)}}


def test_an_index_that_names_a_tensor_twice_is_refused(tmp_path):
    index = '{"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "x": "b.safetensors"}}'
    directory = sharded(tmp_path / "m", index, TWO)
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, "names tensor 'x' twice", "'a.safetensors'", "'b.safetensors'")
    directory = sharded(tmp_path / "n", '{"weight_map": {"x": "a.safetensors"}, "weight_map": {"x": "b.safetensors"}}',
                        TWO)
    with pytest.raises(ConfigError) as e:
        WeightSource.open(directory)
    one_line(e, "'weight_map' twice")


class XY(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.full((3,), 7.0))
        self.y = nn.Parameter(torch.full((2,), 7.0))


@pytest.mark.parametrize("first", ["x", "y"])
def test_a_tensor_in_two_shards_is_refused_even_when_the_index_names_it_once(tmp_path, first):
    """Found as the shards are opened (either one first): b.safetensors holds an 'x' of its own, with other
    values than the 'x' of a.safetensors, where the index puts it."""
    directory = sharded(tmp_path / "m", {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}, TWO)
    source = WeightSource.open(directory)
    with pytest.raises(ConfigError) as e:
        for name in (first, "y" if first == "x" else "x"):
            source.read(name)
    one_line(e, "'x'", "a.safetensors", "b.safetensors")
    model = XY()
    with pytest.raises(ConfigError) as e:
        load_weights(model, directory)  # a full load opens every shard
    one_line(e, "'x'", "a.safetensors", "b.safetensors")
    assert torch.equal(model.x, torch.full((3,), 7.0)) and torch.equal(model.y, torch.full((2,), 7.0))


def hub_snapshot(tmp_path, name="tiny"):
    repo = tmp_path / "hub" / f"models--org--{name}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    return repo, snapshot


@pytest.mark.parametrize("layout", ["absolute", "other dir", "blobs is a link", "blob is a link", "index",
                                    "shard", "other repo"])
@pytest.mark.parametrize("named", ["directory", "file"])
def test_hub_cache_links_out_of_the_repository_are_refused_unopened(tmp_path, monkeypatch, layout, named):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"x": torch.ones(3)}, str(outside / "evil.safetensors"))
    repo, snapshot = hub_snapshot(tmp_path)
    link, target = snapshot / W.SINGLE_NAME, outside / "evil.safetensors"
    if layout == "absolute":
        link.symlink_to("/etc/passwd")
        target = Path("/etc/passwd")
    elif layout == "other dir":
        link.symlink_to(target)
    elif layout == "blobs is a link":
        (repo / "blobs").rmdir()
        (repo / "blobs").symlink_to(outside)
        link.symlink_to("../../blobs/evil.safetensors")
    elif layout == "blob is a link":
        (repo / "blobs" / "abc").symlink_to(target)
        link.symlink_to("../../blobs/abc")
    elif layout == "index":
        (outside / "index.json").write_text(json.dumps({"weight_map": {"x": "evil.safetensors"}}))
        link, target = snapshot / W.INDEX_NAME, outside / "index.json"
        link.symlink_to(target)
    elif layout == "shard":
        (snapshot / W.INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "model-1.safetensors"}}))
        link = snapshot / "model-1.safetensors"
        link.symlink_to(target)
    else:  # another repository of the same cache is still outside this one
        _, other = hub_snapshot(tmp_path, "other")
        save_file({"x": torch.ones(3)}, str(other / "real.safetensors"))
        link.symlink_to(other / "real.safetensors")
        target = other / "real.safetensors"
    opened: list[str] = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        opened.append(os.path.realpath(path))
        return real_open(path, *args, **kwargs)

    with pytest.raises(ConfigError) as e, monkeypatch.context() as patch:
        patch.setattr(os, "open", spy)
        WeightSource.open(snapshot if named == "directory" or layout == "shard" else link)
    one_line(e, str(link), "symbolic link", "outside the cache repository", str(repo))
    assert str(target.resolve()) not in opened, opened


def test_hub_cache_links_inside_the_repository_are_followed_when_named_directly(tmp_path):
    repo, snapshot = hub_snapshot(tmp_path)
    save_file({"x": torch.ones(3)}, str(repo / "blobs" / "abc123"))
    (snapshot / W.SINGLE_NAME).symlink_to("../../blobs/abc123")
    assert torch.equal(WeightSource.open(snapshot / W.SINGLE_NAME).read("x"), torch.ones(3))
    elsewhere = tmp_path / "mine"
    elsewhere.symlink_to(snapshot)  # a link of one's own to the snapshot: still the cache's rules
    assert torch.equal(WeightSource.open(elsewhere).read("x"), torch.ones(3))
