"""Delta weight sync (rollout.weight_sync_delta): per bucket, only the elements that changed since the last sync
travel over the weight-sync group, compared bit for bit in the engines' dtype.

Both ends keep the last content of every bucket (the base, in host memory: one copy of the model in the engines'
dtype per process). Per bucket the sender broadcasts a header [mode, k, checksum], then either the whole bucket
(FULL: no base yet, or the changes would cost more than the bucket) or the k changed positions and their values
(SPARSE). Each receiver applies them to its base and compares the checksum of the result with the sender's; one
all-reduce of the mismatch flags follows every bucket, and a bucket any receiver got wrong is sent again in full
at once. Bases live as long as their group: a new group (the first sync, an engine started or restarted, a failed
sync) starts from full buckets on both ends, so a receiver never applies a delta to a base it does not have.

Only after a bf16 / fp16 cast does a training step leave most elements unchanged (1-5% change per step at
full-fine-tuning learning rates); in float32 nearly every element moves, and the sender then sends full buckets.
"""

from __future__ import annotations

import torch

from agentrl.weightsync.buckets import TensorMeta, wait

FULL, SPARSE = 0, 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements summed at once by the checksum (bounds its int64 temporary to 128 MiB)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width: equal exactly when bitwise equal (-0.0 vs 0.0 and NaN
    payloads included)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """The sum of the elements' bit patterns, exact and the same on every device (integer sums do not depend on
    the order), reduced to fit an int64 header."""
    ints = bits(flat)
    total = sum(int(chunk.to(torch.int64).sum()) for chunk in ints.split(_CHUNK))
    return total % (1 << 62)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _host_copy(flat: torch.Tensor) -> torch.Tensor:
    """The bucket's base in host memory (pinned where a device copies from it)."""
    pin = flat.device.type != "cpu" and torch.cuda.is_available()
    out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=pin)
    return out.copy_(flat)


def send_bucket(group, flat: torch.Tensor, i: int, bases: dict[int, torch.Tensor], timeout_s: float | None) -> int:
    """Sender (rank 0 of `group`): bucket `i` as a delta against `bases[i]` when that is smaller, else in full;
    again in full when a receiver's checksum disagrees. Updates `bases[i]`; returns the bytes broadcast."""
    n, size = flat.numel(), flat.element_size()
    base = bases.get(i)
    idx = vals = None
    if base is not None and base.shape == flat.shape and base.dtype == flat.dtype:
        changed = torch.nonzero(bits(flat) != bits(base.to(flat.device, non_blocking=True))).flatten()
        idx = changed.to(_index_dtype(n))
        if idx.numel() * (idx.element_size() + size) < n * size:
            vals = flat[changed]
    mode = SPARSE if vals is not None else FULL
    k = idx.numel() if vals is not None else n
    header = torch.tensor([mode, k, checksum(flat)], dtype=torch.int64, device=flat.device)
    wait(group.broadcast(header, 0), timeout_s)
    payload = [idx, vals] if vals is not None else [flat]
    for part in payload:
        if part.numel():
            wait(group.broadcast(part, 0), timeout_s)
    sent = header.numel() * 8 + sum(p.numel() * p.element_size() for p in payload)
    if _any_drift(group, False, flat.device, timeout_s):
        wait(group.broadcast(flat, 0), timeout_s)
        sent += n * size
    bases[i] = _host_copy(flat)
    return sent


def receive_bucket(
    group, bucket: list[TensorMeta], i: int, bases: dict[int, torch.Tensor], device: torch.device,
    timeout_s: float | None,
) -> torch.Tensor:  # fmt: skip
    """Receiver: bucket `i` as the sender has it now, on `device` (a fresh tensor: what the caller loads from may
    be kept), from a full bucket or a delta applied to `bases[i]`; `bases[i]` is updated."""
    n, dtype = sum(m.numel for m in bucket), bucket[0].torch_dtype
    header = torch.empty(3, dtype=torch.int64, device=device)
    wait(group.broadcast(header, 0), timeout_s)
    mode, k, expected = (int(x) for x in header.tolist())
    base = bases.pop(i, None)  # a failure below leaves no half-applied base behind
    fresh = None  # the bucket as received in full, when it was
    if mode == FULL:
        fresh = torch.empty(n, dtype=dtype, device=device)
        wait(group.broadcast(fresh, 0), timeout_s)
        base = _host_copy(fresh)
    else:
        idx = torch.empty(k, dtype=_index_dtype(n), device=device)
        vals = torch.empty(k, dtype=dtype, device=device)
        for part in (idx, vals):
            if k:
                wait(group.broadcast(part, 0), timeout_s)
        if base is None or base.numel() != n or base.dtype != dtype:
            base = torch.zeros(n, dtype=dtype)  # cannot happen while bases live with their group; repaired below
        base[idx.long().cpu()] = vals.cpu()
    drift = checksum(base) != expected
    if _any_drift(group, drift, device, timeout_s):
        fresh = torch.empty(n, dtype=dtype, device=device)
        wait(group.broadcast(fresh, 0), timeout_s)
        base = _host_copy(fresh)
    bases[i] = base
    return fresh if fresh is not None else base.to(device, copy=True)


def _any_drift(group, mine: bool, device: torch.device, timeout_s: float | None) -> bool:
    """Whether any rank's bucket disagrees with the sender's checksum (one small all-reduce every rank joins)."""
    flag = torch.tensor([int(mine)], dtype=torch.int64, device=device)
    wait(group.allreduce(flag), timeout_s)
    return bool(flag.item())
