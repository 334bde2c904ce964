"""Start-up memory given back: ``release_free_memory`` returns glibc's free heap pages, and ``meta_init``
skips initialisers on meta tensors (which would import torch's Python meta kernels, ~67 MB per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from varuna_core import materialize, meta_init
from varuna_core.util.heap import release_free_memory


def _run(code: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_freed_heap_goes_back_to_the_system() -> None:
    """Freeing a 16 MB tensor raises glibc's mmap threshold, so later ones come from the heap and stay resident
    after they are freed, until the trim."""
    got = _run("""
        import torch
        from varuna_core.util.heap import release_free_memory
        def anon():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) // 1024
        big = torch.ones(4 * 2**20)                   # 16 MB: mmapped; freed, the threshold rises to it
        del big
        keep = [torch.ones(2**20 + i) for i in range(24)]   # 4 MB each, from the heap now
        pin = torch.ones(16)                          # a small block above them, so the heap cannot shrink
        del keep
        before = anon()
        assert release_free_memory()
        print(before - anon())
    """)
    assert int(got) >= 60, f"only {got} MB returned"


def test_release_free_memory_is_safe_to_call_any_time() -> None:
    t = torch.ones(1000)
    release_free_memory()
    release_free_memory(collect=False)
    assert float(t.sum()) == 1000


def test_meta_init_runs_no_initialiser_on_meta_and_keeps_real_buffers_exact() -> None:
    out = _run("""
        import sys, torch
        from torch import nn
        from varuna_core import meta_init
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 16)          # reset_parameters: nn.init.normal_(tensor=...) on meta
                self.lin = nn.Linear(16, 16)
                nn.init.trunc_normal_(self.lin.weight)   # several writes on meta
                self.register_buffer("scale", torch.zeros(4).add_(2).mul_(3))   # real: must be computed
        with meta_init():
            net = Net()
        print("sympy" in sys.modules, net.emb.weight.is_meta, net.scale.tolist())
    """)
    assert out == "False True [6.0, 6.0, 6.0, 6.0]"


def test_materialised_values_are_unchanged_by_the_skipped_meta_writes() -> None:
    """The per-owner initialisation skips writes to other modules' (meta) tensors: the values equal a
    materialisation of a model built for real and moved to meta, module by module."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Embedding(10, 8)

    def init(module: nn.Module) -> None:
        if isinstance(module, Net):  # a parent writing to every child's weight: only the real one counts
            nn.init.normal_(module.a.weight, std=0.5)
            nn.init.normal_(module.b.weight, std=0.5)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with meta_init():
        one = Net()
    with torch.device("meta"):
        two = Net()
    materialize(one, seed=7, init=init)
    materialize(two, seed=7, init=init)
    for (name, x), (_, y) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    assert float(one.a.weight.detach().std()) > 0.3  # the parent's initialiser wrote the real weight
