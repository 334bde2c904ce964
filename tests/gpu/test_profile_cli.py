"""``varuna profile`` of the example GPT on the GPU: it exits 0 and writes a profile that validates, every timing
positive (and on CUDA every pass's peak memory measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.common import DEVICE, ROOT
from varuna_core.planning.artifacts import load_profile


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profile_of_the_example_gpt(precision, tmp_path) -> None:
    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "varuna_cli", "profile", "examples/gpt/spec.py:spec", "--device",
                           DEVICE, "--precision", precision, "--microbatch-sizes", "1,2", "--repeats", "2",
                           "--warmup", "1", "-o", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    prof = load_profile(out)  # the profile model: the same checks as schemas/profile.schema.json and more
    assert prof.segments
    for seg in prof.segments:
        for m in seg.measures:
            for kind in ("forward", "recompute", "backward"):
                assert getattr(m, kind).median > 0, (seg.index, m.microbatch_size, kind)
            if DEVICE == "cuda":
                assert m.peak_bytes, (seg.index, m.microbatch_size, m.peak_bytes)
    _validates_against_the_schema(out)


def _validates_against_the_schema(path) -> None:
    """The JSON against ``schemas/profile.schema.json`` itself, where ``jsonschema`` is installed."""
    try:
        import jsonschema
    except ImportError:
        return
    schema = json.loads((ROOT / "schemas" / "profile.schema.json").read_text())
    jsonschema.validate(json.loads(path.read_text()), schema)
