"""Synthetic profiles for planner tests (no measuring)."""

from __future__ import annotations

from varuna_core.planning.artifacts import (
    CommCurve,
    Environment,
    LinearFit,
    Profile,
    SegmentMeasure,
    SegmentProfile,
    Stat,
)


def _stat(x: float) -> Stat:
    return Stat(median=x, p10=x, p90=x, repeats=1)


def make_profile(
    forward: list[float], *, sizes=(1, 2, 4, 8), param_bytes: int = 10**6, saved_per_example: int = 10**5,
    out_per_example: int = 10**4, bandwidth: float = 1e9, latency: float = 1e-4, with_comm: bool = True,
    split: float | None = None, weight_per_example: int = 0,
) -> Profile:
    """Segment ``i`` takes ``forward[i] · n`` forward (recompute the same, backward twice) for ``n`` examples.

    ``split``: with it, the profile has the split backward's measures: B takes ``split`` of the backward and W the
    rest, and W keeps ``weight_per_example · n`` bytes; without it, it has none (a profile of an older profiler)."""
    segments = []
    n_seg = len(forward)
    for i, f in enumerate(forward):
        measures = [
            SegmentMeasure(microbatch_size=n, forward=_stat(f * n), recompute=_stat(f * n), backward=_stat(2 * f * n),
                           output_bytes=0 if i == n_seg - 1 else out_per_example * n,
                           saved_bytes=saved_per_example * n,
                           **({} if split is None else {
                               "split_backward": _stat(split * 2 * f * n), "weight": _stat((1 - split) * 2 * f * n),
                               "weight_bytes": weight_per_example * n}))
            for n in sizes
        ]
        segments.append(SegmentProfile(index=i, input_cut=f"c{i - 1}" if i else None,
                                       output_cut=f"c{i}" if i < n_seg - 1 else None, param_count=param_bytes // 4,
                                       param_bytes=param_bytes, grad_bytes=param_bytes,
                                       optimizer_bytes=2 * param_bytes, measures=measures))
    comm = []
    if with_comm:
        sizes_b = [2**10, 2**14, 2**17, 2**20, 2**22, 2**24]
        fit = LinearFit(latency=latency, bandwidth=bandwidth, rel_error=0.0)
        comm = [CommCurve(op="p2p", link="intra", group_size=2, sizes=sizes_b,
                          times=[fit.predict(s) for s in sizes_b], fit=fit)]
        for g in (2, 4, 8):
            comm.append(CommCurve(op="allreduce", link="intra", group_size=g, sizes=sizes_b,
                                  times=[fit.predict(s) for s in sizes_b], fit=fit))
    env = Environment(torch_version="x", python_version="3", device_type="cpu", devices=["cpu"], threads=1,
                      hosts=["h"], nproc=2, precision="fp32")
    return Profile(model="synthetic", structure_hash="0" * 32, num_segments=n_seg,
                   cut_names=[f"c{i}" for i in range(n_seg - 1)], microbatch_sizes=list(sizes), segments=segments,
                   comm=comm, environment=env, created="2026-01-01T00:00:00+00:00")
