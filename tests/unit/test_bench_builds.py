"""``sim_accuracy.py`` runs the example GPT as its spec builds it: on ``meta``, with the spec's initialiser handed to
``Varuna(init=...)`` (without it a stage refuses ``qv_bias``, which only that initialiser sets: the benchmark's GPT
rows had stopped running)."""

from __future__ import annotations

import pytest

from tests.scripts import BENCHMARKS, load_script


class _Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """``varuna_core.Varuna`` replaced by a stand-in that records its arguments and stops the build there."""
    import torch.distributed as dist

    import varuna_core

    seen: dict = {}

    def fake(model, *args, **kwargs):
        seen.update(kwargs, model=model)
        raise _Captured

    monkeypatch.setattr(varuna_core, "Varuna", fake)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    return seen


def test_sim_accuracy_hands_the_spec_initialiser_to_varuna(captured) -> None:
    bench = load_script(BENCHMARKS / "sim_accuracy.py", "_bench_sim_accuracy")
    spec = bench.gpt_spec()
    job = {"spec": bench.GPT_REF, "batch": 8, "timeout": 30.0, "mbs": 4, "plan": "unused.yaml"}
    with pytest.raises(_Captured):
        bench._build(job, {})
    assert captured["init"] is spec.init is not None
    assert any(p.is_meta for p in captured["model"].parameters())  # built on meta: the initialiser is needed

