"""One rank's box of a logical tensor, as ``torch.distributed.checkpoint`` saves and loads it.

A sharded optimizer (:mod:`varuna_core.pipeline.shard`) holds, on each data-parallel replica, the state of a
box of each parameter: ``exp_avg`` of rows ``[start, start + length)``. A checkpoint must store the logical
tensor ``optim/<name>/exp_avg`` of the parameter's shape, of which each replica writes its box, so that any other
layout (sharded or not, any ``pp`` and ``dp``) reads the part it needs: DCP's planner does that resharding for any
object that names its box (the ``_Checkpointable`` protocol DTensor implements: ``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``). :func:`chunk` wraps a local tensor with its box; the wrapper is
made for one save or load and never escapes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Chunk", "chunk", "local"]


class Chunk(torch.Tensor):
    """A tensor that is the box at ``offsets`` of a logical tensor of ``size`` (see the module docstring). Its
    data is the local tensor's: a load fills it in place."""

    _offsets: torch.Size
    _global: torch.Size

    @staticmethod
    def __new__(cls, data: torch.Tensor, offsets: Sequence[int], size: Sequence[int]) -> Chunk:
        out = torch.Tensor._make_subclass(cls, data, False)
        out._offsets, out._global = torch.Size(offsets), torch.Size(size)
        return out

    def _box(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self._offsets, sizes=self.local().size())

    def size(self, dim: int | None = None):
        """The logical tensor's size, as DCP's load planner checks it against the checkpoint's (DTensor's too)."""
        return self._global if dim is None else self._global[dim]

    def local(self) -> torch.Tensor:
        """The box's data as a plain tensor (a view)."""
        return self.as_subclass(torch.Tensor)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        data = self.local()
        return [WriteItem(index=MetadataIndex(fqn, self._offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._box(),
                                                      properties=TensorProperties.create_from_tensor(data),
                                                      size=self._global))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._box()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and torch.Size(index.offset) != self._offsets:
            raise ValueError(f"{index.fqn}: this rank holds the box at {list(self._offsets)}, not at "
                             f"{list(index.offset)}")
        return self.local()


def chunk(data: torch.Tensor, offsets: Sequence[int], size: Sequence[int]) -> torch.Tensor:
    """``data`` as the box at ``offsets`` of a logical tensor of ``size``; the whole tensor (no box) is ``data``
    itself."""
    if tuple(size) == tuple(data.shape) and not any(offsets):
        return data
    return Chunk(data, offsets, size)


def local(value: torch.Tensor) -> torch.Tensor:
    """A :class:`Chunk`'s data, or ``value`` itself."""
    return value.local() if isinstance(value, Chunk) else value
