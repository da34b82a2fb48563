"""Delta weight sync (rollout.weight_sync_delta): per bucket, only the elements that changed since the last sync
travel over the weight-sync group, compared bit for bit in the engines' dtype.

Both ends keep the last content of every bucket (the base, in host memory: one copy of the model in the engines'
dtype per process). Per bucket the sender broadcasts a header [mode, k, checksum], then the cheapest of: the whole
bucket (FULL: no base yet, or the changes would cost more), the k changed positions and their values (INDICES), or
a bitmask of the changed positions and their values (MASK). Each receiver applies them to its base and compares
the checksum of the result with the sender's; one all-reduce of every bucket's mismatch flags ends the sync (so
the sender packs the next bucket while the receivers apply the last), and a bucket any receiver got wrong is sent
again whole. Bases live as long as their group: a new group (the first sync, an engine started or restarted, a
failed sync) starts from whole buckets on both ends, so a receiver never applies a delta to a base it does not have.

What changes depends on the learning rate against the bf16 spacing of the weights: one RL step of the default
example (4 AdamW steps) moved 95% of the tiny model's bf16 elements at its lr 1e-4 and 10% at lr 1e-6
(benchmarks/bench_weight_sync.py); in float32 nearly every element moves, and the buckets travel whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.weightsync.buckets import TensorMeta, wait

FULL, INDICES, MASK = 0, 1, 2  # how a bucket travels: whole; changed positions + values; a bitmask + values
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width: equal exactly when bitwise equal (-0.0 vs 0.0 and NaN
    payloads included)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """The sum of the bucket's bytes taken as 64-bit words (and of its last bytes, when its size is not a multiple
    of 8), wrapping: integer sums do not depend on their order, so every device gets the same value, and one
    changed element changes it. One pass at memory speed (~60 GB/s on one CPU thread)."""
    raw = flat.reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:
        raw = raw.clone()  # int64 words need an aligned start
    whole = raw.numel() // 8 * 8
    total = int(raw[:whole].view(torch.int64).sum()) + int(raw[whole:].sum(dtype=torch.int64))
    return total % (1 << 62)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _host_copy(flat: torch.Tensor) -> torch.Tensor:
    """The bucket's base in host memory (pinned where a device copies from it)."""
    pin = flat.device.type != "cpu" and torch.cuda.is_available()
    out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=pin)
    return out.copy_(flat)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, 8 positions per byte (position 8i + j in bit j of byte i)."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) << _shifts(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed.unsqueeze(1) >> _shifts(packed.device)) & 1).view(-1)[:n].bool()


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def send_bucket(group, flat: torch.Tensor, i: int, bases: dict[int, torch.Tensor], timeout_s: float | None) -> int:
    """Sender (rank 0 of `group`): bucket `i` in the cheapest of three forms: whole, the changed positions
    (int32 / int64) and their values, or a bitmask of the changed positions and their values (in bf16 the
    positions win below ~3% changed, the bitmask up to ~44%); a delta is sent only when it costs at most half the
    bucket, since finding and applying the changes costs more than moving the rest. Updates `bases[i]`; returns
    the bytes broadcast."""
    n, size = flat.numel(), flat.element_size()
    base = bases.get(i)
    mode, k, payload = FULL, n, [flat]
    if base is not None and base.shape == flat.shape and base.dtype == flat.dtype:
        changed = bits(flat) != bits(base.to(flat.device, non_blocking=True))
        changes = int(torch.count_nonzero(changed))
        costs = {INDICES: changes * (_index_dtype(n).itemsize + size), MASK: -(-n // 8) + changes * size}
        best = min(costs, key=costs.__getitem__)
        if costs[best] <= n * size // 2:
            mode, k = best, changes
            positions = torch.nonzero(changed).flatten()
            where = positions.to(_index_dtype(n)) if mode == INDICES else _pack_bits(changed)
            payload = [where, flat.index_select(0, positions)]
    header = torch.tensor([mode, k, checksum(flat)], dtype=torch.int64, device=flat.device)
    wait(group.broadcast(header, 0), timeout_s)
    for part in payload:
        if part.numel():
            wait(group.broadcast(part, 0), timeout_s)
    if mode == FULL:
        bases[i] = _host_copy(flat)
    else:  # the base takes the changes it sent (cheaper than a copy of the bucket while few elements change)
        base.index_copy_(0, positions.to(base.device), payload[1].to(base.device))
    return header.numel() * 8 + sum(p.numel() * p.element_size() for p in payload)


def send_repairs(group, bases: dict[int, torch.Tensor], buckets: int, device: torch.device,
                 timeout_s: float | None) -> int:  # fmt: skip
    """Sender, after every bucket: the buckets some receiver got wrong (its checksum disagreed), whole again.
    Returns the bytes broadcast."""
    sent = 0
    for i in _drifted(group, [False] * buckets, device, timeout_s):
        whole = bases[i].to(device)
        wait(group.broadcast(whole, 0), timeout_s)
        sent += whole.numel() * whole.element_size()
    return sent


def receive_bucket(
    group, bucket: list[TensorMeta], i: int, bases: dict[int, torch.Tensor], device: torch.device,
    timeout_s: float | None,
) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """Receiver: bucket `i` on `device` (a fresh tensor: what the caller loads from may be kept), received whole
    or as changes applied to `bases[i]`, which is updated; and whether its checksum disagrees with the sender's
    (the bucket then comes again whole in `receive_repairs`)."""
    n, dtype = sum(m.numel for m in bucket), bucket[0].torch_dtype
    header = torch.empty(3, dtype=torch.int64, device=device)
    wait(group.broadcast(header, 0), timeout_s)
    mode, k, expected = (int(x) for x in header.tolist())
    base = bases.pop(i, None)  # a failure below leaves no half-applied base behind
    if mode == FULL:
        fresh = torch.empty(n, dtype=dtype, device=device)
        wait(group.broadcast(fresh, 0), timeout_s)
        bases[i] = _host_copy(fresh)
        return fresh, checksum(fresh) != expected
    where = torch.empty(k if mode == INDICES else -(-n // 8), dtype=_index_dtype(n) if mode == INDICES
                        else torch.uint8, device=device)  # fmt: skip
    vals = torch.empty(k, dtype=dtype, device=device)
    for part in (where, vals):
        if part.numel():
            wait(group.broadcast(part, 0), timeout_s)
    if base is None or base.numel() != n or base.dtype != dtype:
        base = torch.zeros(n, dtype=dtype)  # cannot happen while bases live with their group; repaired after
    positions = where.long() if mode == INDICES else torch.nonzero(_unpack_bits(where, n)).flatten()
    base.index_copy_(0, positions.cpu(), vals.cpu())
    bases[i] = base
    return base.to(device, copy=True), checksum(base) != expected


def receive_repairs(
    group, buckets: list[list[TensorMeta]], drifted: list[bool], bases: dict[int, torch.Tensor],
    device: torch.device, timeout_s: float | None,
) -> Iterator[tuple[int, torch.Tensor]]:  # fmt: skip
    """Receiver, after every bucket: (index, bucket) of each bucket any receiver got wrong, received whole again
    (every receiver takes part, as in any broadcast)."""
    for i in _drifted(group, drifted, device, timeout_s):
        fresh = torch.empty(sum(m.numel for m in buckets[i]), dtype=buckets[i][0].torch_dtype, device=device)
        wait(group.broadcast(fresh, 0), timeout_s)
        bases[i] = _host_copy(fresh)
        yield i, fresh


def _drifted(group, mine: list[bool], device: torch.device, timeout_s: float | None) -> list[int]:
    """The buckets whose checksum disagreed on any receiver: one all-reduce of every rank's flags per sync."""
    flags = torch.tensor([int(d) for d in mine], dtype=torch.int64, device=device)
    wait(group.allreduce(flags), timeout_s)
    return [i for i, flag in enumerate(flags.tolist()) if flag]
