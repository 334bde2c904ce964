"""Placement of global ranks on (pipeline stage, data-parallel replica) coordinates.

The original passes this placement around as a ``stage_to_rank_map`` string, ``"0,2;1,3;"``: stages are
separated by ``;`` and, within a stage, the global ranks of its replicas by ``,``; a rank's position in its
stage's list is its replica index. Every process parses the same string, so a malformed map must fail loudly
and identically everywhere, with a message that shows the arithmetic instead of a hang at the first collective.

Pure Python: imported by planning code and the CLI, which must start fast (no torch).
"""

from __future__ import annotations

import dataclasses

from varuna_core.errors import TopologyError

__all__ = ["Topology", "map_shape", "rank_place"]


def _example_map(world_size: int, pp: int | None = None) -> str:
    """A valid clustered map for ``world_size`` (with ``pp`` stages when that divides the world), for hints."""
    if world_size < 1:
        return "'0;' (a single rank)"
    if pp is None or pp < 1 or world_size % pp:
        pp = next((d for d in (2, 3, 4) if world_size % d == 0 and d < world_size), 1)
    text = Topology.clustered(pp, world_size // pp).to_string().rstrip(";")
    return f"{text!r} ({pp} stages × {world_size // pp} replicas = {world_size} ranks)"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which global rank runs which stage of which replica.

    Construction checks that the map is a complete, uniform grid over ranks ``0..pp*dp-1``, because uneven
    data parallelism is not supported and a rank missing from the map would never join its groups.

    Attributes:
        stage_ranks: ``stage_ranks[stage][replica]`` is the global rank.
    """

    stage_ranks: tuple[tuple[int, ...], ...]
    _coords: dict[int, tuple[int, int]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stages = tuple(tuple(stage) for stage in self.stage_ranks)
        object.__setattr__(self, "stage_ranks", stages)
        if not stages:
            raise TopologyError("stage-to-rank map has no stages", hint="give at least one stage, e.g. '0;'")
        coords: dict[int, tuple[int, int]] = {}
        for s, ranks in enumerate(stages):
            if not ranks:
                raise TopologyError(f"stage {s} of the stage-to-rank map has no ranks",
                                    hint="every stage needs one rank per replica, e.g. '0,2;1,3'")
            for r, rank in enumerate(ranks):
                if isinstance(rank, bool) or not isinstance(rank, int):
                    raise TopologyError(f"stage {s} lists {rank!r}, which is not an integer rank")
                if rank < 0:
                    raise TopologyError(f"stage {s} lists negative rank {rank}", hint="ranks are 0..WORLD_SIZE-1")
                if rank in coords:
                    other = coords[rank]
                    raise TopologyError(
                        f"rank {rank} is listed twice: stage {other[0]} replica {other[1]} and stage {s} replica {r}",
                        hint="each rank runs exactly one stage of one replica",
                    )
                coords[rank] = (s, r)
        counts = [len(ranks) for ranks in stages]
        if len(set(counts)) > 1:
            detail = ", ".join(f"stage {s}: {c}" for s, c in enumerate(counts))
            raise TopologyError(
                f"stages have different replica counts ({detail}); uneven data parallelism is not supported",
                hint=f"give every stage the same number of ranks, e.g. {_example_map(len(coords), len(stages))}",
            )
        expected = len(stages) * counts[0]
        missing = sorted(set(range(expected)) - coords.keys())
        if missing:
            extra = sorted(coords.keys() - set(range(expected)))
            raise TopologyError(
                f"{_plural(len(stages), 'stage')} × {_plural(counts[0], 'replica')} = {expected} ranks must be "
                f"0..{expected - 1}, but rank(s) {missing} are missing and {extra} are out of range",
                hint=f"a valid map for {expected} ranks is {_example_map(expected, len(stages))}",
            )
        object.__setattr__(self, "_coords", coords)

    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> Topology:
        """Parse the original's ``stage_to_rank_map`` format (trailing ``;`` optional, whitespace ignored).

        Args:
            text: e.g. ``"0,2;1,3;"``.
            world_size: if given, the map must cover exactly this many ranks.

        Raises:
            TopologyError: empty text or stage, non-integer or negative or repeated rank, uneven stages,
                ranks that are not exactly ``0..world-1``, or a world-size mismatch.
        """
        world_hint = _example_map(world_size) if world_size else "'0,2;1,3'"
        if not isinstance(text, str) or not text.strip():
            raise TopologyError(f"empty stage-to-rank map {text!r}", hint=f"a valid map looks like {world_hint}")
        body = "".join(text.split())
        if body.endswith(";"):
            body = body[:-1]
        stages: list[tuple[int, ...]] = []
        for s, part in enumerate(body.split(";")):
            if not part:
                raise TopologyError(f"stage {s} of stage-to-rank map {text!r} is empty",
                                    hint=f"a valid map looks like {world_hint}")
            ranks = []
            for token in part.split(","):
                try:
                    ranks.append(int(token))
                except ValueError:
                    raise TopologyError(
                        f"stage {s} of stage-to-rank map {text!r} has non-integer rank {token!r}",
                        hint=f"stages are separated by ';', ranks by ',': {world_hint}",
                    ) from None
            stages.append(tuple(ranks))
        topology = cls(tuple(stages))
        if world_size is not None:
            topology.validate(world_size)
        return topology

    @classmethod
    def clustered(cls, pp: int, dp: int) -> Topology:
        """The original launcher's placement: rank = replica·pp + stage, so a replica's pipeline is consecutive
        ranks (usually one node) and the data-parallel groups span nodes."""
        if isinstance(pp, bool) or isinstance(dp, bool) or not isinstance(pp, int) or not isinstance(dp, int):
            raise TopologyError(f"pp and dp must be integers, got pp={pp!r} dp={dp!r}")
        if pp < 1 or dp < 1:
            raise TopologyError(f"cannot place {pp} stages × {dp} replicas", hint="pp and dp must both be >= 1")
        return cls(tuple(tuple(range(s, pp * dp, pp)) for s in range(pp)))

    @classmethod
    def by_stage(cls, pp: int, dp: int) -> Topology:
        """The other placement: rank = stage·dp + replica, so a stage's replicas are consecutive ranks (usually one
        node: their all-reduce stays inside it) and the pipeline's boundaries cross nodes."""
        clustered = cls.clustered(pp, dp)  # the same checks
        return cls(tuple(tuple(range(s * dp, (s + 1) * dp)) for s in range(clustered.pp)))

    @classmethod
    def placed(cls, placement: str, pp: int, dp: int) -> Topology:
        """``"pipeline"``: :meth:`clustered`; ``"stage"``: :meth:`by_stage`."""
        if placement == "pipeline":
            return cls.clustered(pp, dp)
        if placement == "stage":
            return cls.by_stage(pp, dp)
        raise TopologyError(f"unknown placement {placement!r}", hint="'pipeline' or 'stage'")

    @property
    def pp(self) -> int:
        """Number of pipeline stages."""
        return len(self.stage_ranks)

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas (ranks per stage)."""
        return len(self.stage_ranks[0])

    @property
    def world_size(self) -> int:
        """Number of ranks the map covers (``pp * dp``)."""
        return self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(stage, replica)`` of ``rank``; TopologyError if the map does not contain it."""
        try:
            return self._coords[rank]
        except (KeyError, TypeError):
            raise TopologyError(
                f"rank {rank!r} is not in stage-to-rank map {self.to_string()!r} (ranks 0..{self.world_size - 1})",
                hint="the map must list every rank of the world exactly once",
            ) from None

    def rank(self, stage: int, replica: int) -> int:
        """Global rank running ``stage`` of ``replica``."""
        if not 0 <= stage < self.pp or not 0 <= replica < self.dp:
            raise TopologyError(
                f"(stage {stage}, replica {replica}) is outside {self.pp} stages × {self.dp} replicas",
                hint=f"stage in 0..{self.pp - 1}, replica in 0..{self.dp - 1}",
            )
        return self.stage_ranks[stage][replica]

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """Ranks of one replica's pipeline in stage order (its pipeline process group)."""
        if not 0 <= replica < self.dp:
            raise TopologyError(f"replica {replica} out of range: there are {self.dp} replicas",
                                hint=f"use a replica in 0..{self.dp - 1}")
        return tuple(ranks[replica] for ranks in self.stage_ranks)

    def to_string(self) -> str:
        """The original's format, with the trailing ``;`` it requires, e.g. ``"0,2;1,3;"``."""
        return "".join(",".join(str(r) for r in ranks) + ";" for ranks in self.stage_ranks)

    def validate(self, world_size: int) -> None:
        """Check that the map covers exactly ``world_size`` ranks (the structure is checked at construction).

        Raises:
            TopologyError: if ``pp * dp != world_size``.
        """
        if world_size != self.world_size:
            raise TopologyError(
                f"{_plural(self.pp, 'stage')} × {_plural(self.dp, 'replica')} = {self.world_size} ranks, "
                f"but WORLD_SIZE={world_size}",
                hint=f"a valid map for WORLD_SIZE={world_size} is {_example_map(world_size, self.pp)}",
            )


def map_shape(stage_to_rank_map: str) -> tuple[int, int]:
    """``(pipeline depth, data-parallel width)`` of a stage-to-rank map: the original's ``get_varuna_config``."""
    topology = Topology.parse(stage_to_rank_map)
    return topology.pp, topology.dp


def rank_place(stage_to_rank_map: str, rank: int) -> tuple[int, int]:
    """``(stage, replica)`` of global ``rank`` in a stage-to-rank map: the original's
    ``get_this_rank_config_varuna`` (its second value is the data-parallel rank a script shards its data by)."""
    return Topology.parse(stage_to_rank_map).coords(rank)
