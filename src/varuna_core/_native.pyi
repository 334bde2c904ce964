"""Types of the C++ extension built from csrc/ (the functions are bound in csrc/bindings.cpp).

An action is ``(op, mb)`` with op coded F=0, R=1, B=2, W=3 (``varuna_core.planning.simulate._OP_CODE``); a cost
row is the 14 numbers of ``StageCosts.as_tuple()`` (the 11 of F, R, B and the sends, then ``weight`` and
``weight_last``, the durations of ``W``, and ``optimizer``); a timeline entry is ``(stage, op, mb, start, end)``.
"""

from collections.abc import Sequence

def generate(name: str, p: int, m: int) -> list[list[tuple[int, int]]]: ...
def simulate_actions(
    actions: Sequence[Sequence[tuple[int, int]]], m: int, costs: Sequence[Sequence[float]], max_sends: int,
    opportunistic: bool, timeline: bool, idle_gaps: Sequence[float] = ..., idle_fractions: Sequence[float] = ...,
    idle_action: float = ...,
) -> tuple[float, float, list[float], list[tuple[int, int, int, float, float]] | None]: ...
def simulate_generated(
    name: str, p: int, m: int, costs: Sequence[Sequence[float]], max_sends: int, opportunistic: bool,
    idle_gaps: Sequence[float] = ..., idle_fractions: Sequence[float] = ..., idle_action: float = ...,
) -> tuple[float, float, list[float]]: ...
def inflight(name: str, p: int, m: int) -> list[tuple[int, int]]: ...

# True when built with the CUDA kernels of csrc/fused.cu (a CUDA compiler was found); the names below exist only then.
CUDA: bool
FUSED_CHUNK: int

def unscale_sq_norms(
    table: int, n: int, chunks: int, dtype: int, inv_scale: int, found_inf: int, partials: int, sq_out: int,
    stream: int,
) -> None: ...
