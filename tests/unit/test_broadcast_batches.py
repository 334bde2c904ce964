"""How start-up's broadcast from replica 0 groups a stage's tensors (``varuna_core.pipeline.groups``): per dtype and
device, in order, in batches of at most one bucket, so that the flat copy it makes never holds the stage twice."""

from __future__ import annotations

import torch

from varuna_core.pipeline.groups import coalesced_batches


def _sizes(batches) -> list[list[int]]:
    return [[t.numel() for t in batch] for batch in batches]


def test_small_tensors_share_a_batch_up_to_the_bucket_and_a_large_one_goes_alone() -> None:
    f32 = [torch.zeros(n) for n in (10, 20, 30, 100, 5, 5)]
    assert _sizes(coalesced_batches(f32, bucket_bytes=60 * 4)) == [[10, 20, 30], [100], [5, 5]]
    assert _sizes(coalesced_batches(f32, bucket_bytes=10**9)) == [[10, 20, 30, 100, 5, 5]]


def test_dtypes_never_share_a_batch_and_every_tensor_is_sent_once_in_order() -> None:
    tensors = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(3), torch.zeros(2, dtype=torch.int64)]
    batches = coalesced_batches(tensors, bucket_bytes=1024)
    assert [{t.dtype for t in b} for b in batches] == [{torch.float32}, {torch.float64}, {torch.int64}]
    assert [t for b in batches for t in b if t.dtype == torch.float32] == [tensors[0], tensors[2]]
    assert sum(len(b) for b in batches) == len(tensors)


def test_no_batch_of_several_tensors_exceeds_the_bucket() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.zeros(int(n)) for n in torch.randint(1, 5000, (200,), generator=gen)]
    for batch in coalesced_batches(tensors, bucket_bytes=16 * 1024):
        assert len(batch) == 1 or sum(t.numel() * 4 for t in batch) <= 16 * 1024
