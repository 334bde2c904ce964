"""What a checkpoint saves and restores, handed over by whoever trains (the ``Varuna`` facade fills it).

Why a separate object rather than the facade itself: the checkpoint floor (L2) must not know the facade (L4),
and spelling out the values save and load use makes them one list to read instead of attributes picked from an
object with dozens. Torch-free at import (torch types are annotations only).

Two kinds of fields:

* **read** by save and load: where this rank is, the live model, parameters and optimizer (which a load fills
  in place, as ``load_state_dict`` would) and the values a manifest records;
* **restored** by a load: ``iteration``, ``seed``, ``run_id`` and ``loss_scaler`` are replaced by the
  checkpoint's, and ``restored`` is set once the live tensors hold the checkpoint's. The caller copies them back
  then (and only then: a refused checkpoint leaves them, like everything else, as they were).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CheckpointState", "OptimPiece"]


@dataclass(frozen=True)
class OptimPiece:
    """The box of a parameter whose optimizer state this rank holds, under a sharded optimizer
    (:mod:`varuna_core.pipeline.shard`): ``param`` is the Parameter the optimizer steps (a view of the box),
    ``offsets`` where the box starts in the whole parameter. ``save``: this rank writes it (a tied weight's state is
    written from its first stage's copies only; the others load it)."""

    param: torch.nn.Parameter
    offsets: tuple[int, ...]
    save: bool = True


@dataclass
class CheckpointState:
    """One rank's state as :func:`~varuna_core.checkpoint.saveload.save` and
    :func:`~varuna_core.checkpoint.saveload.load` see it.

    Attributes:
        rank, world_size: this process in the job's default process group (collectives use it).
        replica: this rank's data-parallel replica (with ``shard=False`` replica 0 writes the tensors).
        device: where this rank's parameters live (its CUDA RNG state is saved when it is a GPU).
        timeout: seconds a background save's rank 0 waits for every rank's report.
        module: the whole model; parameters of other stages may be on the ``meta`` device. Its parameter names,
            shapes and dtypes are the manifest's ``parameters``; its persistent buffers that are not on ``meta``
            are this rank's to save.
        params: this rank's parameters as ``(name in module, parameter)``, the tensors the optimizer steps.
        weight_groups: ``(canonical name, all names)`` of each weight held under several names (see
            :func:`varuna_core.model.stage.weight_groups`): the checkpoint key of a parameter is its canonical
            name, which depends on the model alone, so any partition finds it.
        optimizer: the optimizer (None before one is set); its state is saved per parameter and restored in place.
        structure_hash, num_segments: the model's structure (a load warns when the hash differs).
        pp, dp, stage_to_rank_map, partition: the layout written under (``partition``: half-open segment range
            per stage); a load under another layout works, these are recorded for people and tools.
        precision: ``"fp32"``, ``"fp16"``, ... (recorded).
        batch_size: the global batch; ``iteration * batch_size`` is the data position recorded.
        plan: the plan the run follows, as JSON values (None without one).
        iteration: optimizer steps taken (the default step of a save); restored.
        seed: the dropout seed; restored (modulo 2**64).
        run_id: the run this state belongs to; a load adopts the checkpoint's.
        loss_scaler: the loss scaler's ``state_dict()`` (None without loss scaling); a load replaces it by the
            checkpoint's when the checkpoint has one.
        pieces: under a sharded optimizer, ``id(parameter) -> OptimPiece`` for each parameter of which this rank
            holds the optimizer state of a box (a parameter absent: another replica holds all of it); its state is
            saved and loaded as that box of ``optim/<name>/<state>``. None: the optimizer steps the parameters.
        job_token: the job's secret under ``varuna launch`` (:class:`~varuna_core.env.WorkerEnv`), which signs a
            background save's reports between ranks; None otherwise.
        restored: set by a load once the live tensors hold the checkpoint's.
    """

    rank: int
    world_size: int
    replica: int
    device: torch.device
    timeout: float
    module: torch.nn.Module
    params: list[tuple[str, torch.nn.Parameter]]
    weight_groups: list[tuple[str, tuple[str, ...]]]
    optimizer: torch.optim.Optimizer | None
    structure_hash: str
    num_segments: int
    pp: int
    dp: int
    stage_to_rank_map: str
    partition: list[tuple[int, int]]
    precision: str
    batch_size: int
    plan: dict[str, Any] | None
    iteration: int
    seed: int
    run_id: str
    loss_scaler: dict[str, Any] | None = None
    pieces: dict[int, OptimPiece] | None = None
    job_token: str | None = dataclasses.field(default=None, repr=False)  # a secret: never in a repr or a log
    restored: bool = False

    @property
    def samples_seen(self) -> int:
        """Examples consumed so far: the data position a resumed run continues from."""
        return self.iteration * self.batch_size

    def canonical_names(self) -> dict[str, str]:
        """Parameter name -> its checkpoint name (the canonical name of its weight group, else itself)."""
        return {name: canonical for canonical, names in self.weight_groups for name in names}
