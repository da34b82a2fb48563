"""Run under torchrun (with tests/megatron_cpu on PYTHONPATH, which installs the CPU shim when Megatron is
imported): every Megatron backend check at one tensor / pipeline-parallel layout; rank 0 writes the
measurements as JSON.

    torchrun --nproc-per-node 2 tests/megatron_cpu/check_backend.py --tp 2 --out result.json --work DIR
    torchrun --nproc-per-node 2 tests/megatron_cpu/check_backend.py --pp 2 --out result.json --work DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

# eps well above the smallest gradients: Adam's first step is then smooth in the gradient (with eps 1e-8 it is
# lr * sign(g), which flips for gradients at rounding level and hides nothing but noise).
LR, WD, CLIP, EPS = 1e-3, 0.01, 0.5, 1e-3


def batches(pad_id: int) -> dict[str, dict[str, torch.Tensor]]:
    from agentrl.trainer.batching import collate

    g = torch.Generator().manual_seed(0)
    lens = [9, 14, 6]
    toks = [torch.randint(3, 600, (n,), generator=g).tolist() for n in lens]
    mask = [[0.0] * 3 + [1.0] * (n - 3) for n in lens]
    adv = [torch.randn(n, generator=g).tolist() for n in lens]
    out = {}
    for layout in ("pad", "packed"):
        fields = {"loss_mask": mask, "advantages": adv}
        out[layout] = collate(toks, fields, layout, pad_id)
        out[layout + "_full"] = collate(toks, {"advantages": adv}, layout, pad_id)  # no loss_mask: all columns
    # Packed without the T x T mask (how the worker collates for flash attention): the backend builds it.
    out["packed_nomask"] = collate(toks, {"loss_mask": mask, "advantages": adv}, "packed", pad_id, block_mask=False)
    return out


def loss_of(logp: torch.Tensor, ent: torch.Tensor | None, batch: dict) -> torch.Tensor:
    w = batch["loss_mask"]
    loss = -(logp * batch["advantages"] * w).sum() / w.sum()
    return loss - 0.01 * (ent * w).sum() / w.sum() if ent is not None else loss


def logprobs(backend, model, batch: dict, with_entropy: bool = False):
    """Log-probs (and entropies) of one micro-batch through the backend's schedule, as a loss function's sums."""

    def keep(b, lp, ent):
        return lp.sum() * 0.0, {"lp": lp, "ent": ent}

    out = backend.forward_backward(model, [batch], keep, forward_only=True, with_entropy=with_entropy)[0]
    return out["lp"], out["ent"]


def values(backend, critic, batch: dict) -> torch.Tensor:
    """The critic's values of one micro-batch (the backend's per-token results, no loss function)."""
    return backend.forward_backward(critic, [batch], forward_only=True)[0]


def train(backend, model, batches: list[dict], loss, **kw) -> None:
    """Forward and backward of `batches` with `loss(out, ent, batch)`; every data-parallel replica sees the same
    batches, so each one's share of the loss is 1 / dp_size."""
    backend.forward_backward(model, batches, lambda b, out, ent: (loss(out, ent, b) / backend.dp_size, {}), **kw)


def max_diff(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    if a.shape != b.shape or a.numel() == 0:
        return float("inf")
    d = (a.float() - b.float()).abs()
    return float((d * where if where is not None else d).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--recompute", action="store_true", help="activation checkpointing (full, per layer)")
    ap.add_argument("--precision", default="fp32", help="bf16: a smoke run (the fp32 tolerances do not apply)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.time()

    from safetensors.torch import load_file

    from agentrl.config.schema import Config
    from agentrl.models.tiny import resolve_model_path
    from agentrl.platform import detect
    from agentrl.trainer.backends import create_backend
    from agentrl.trainer.backends.megatron import _unwrap
    from agentrl.trainer.losses import SamplingDist
    from agentrl.trainer.model import forward_logprobs, forward_values
    from tests.hf_models import load_causal_lm, load_value_model

    path = resolve_model_path("builtin:tiny")
    cfg = Config.model_validate(
        {
            "seed": 1,
            "trainer": {
                "backend": "megatron",
                "num_ranks": world,
                "precision": args.precision,
                "activation_checkpointing": args.recompute,
                "megatron": {
                    "tensor_parallel": args.tp,
                    "pipeline_parallel": args.pp,
                    "sequence_parallel": args.sequence_parallel,
                    "distributed_optimizer": not args.no_distributed_optimizer,
                },
                "optim": {"lr": LR, "weight_decay": WD, "grad_clip": CLIP, "eps": EPS},
            },
        }
    )
    platform = detect()
    backend = create_backend("megatron", cfg, path, torch.device("cpu"), platform)
    policy = backend.build("policy")
    ref = backend.build("reference")
    res: dict = {"tp": args.tp, "pp": args.pp, "world": world, "dp_size": backend.dp_size, "dp_rank": backend.dp_rank}
    res["recompute"] = backend.bridge.config.recompute_granularity
    from megatron.core.pipeline_parallel import get_forward_backward_func

    res["schedule"] = get_forward_backward_func().__name__
    ones = torch.ones(1)
    dist.all_reduce(ones, group=backend.dp_group)  # host bookkeeping group: one rank per replica
    res["dp_group_size"] = int(ones)

    # 1. HF -> Megatron -> HF round trip.
    hf_sd = load_file(os.path.join(path, "model.safetensors"))
    tied = True
    metas = backend.weight_metas(policy, tied)
    full = list(backend.full_weights(policy, tied))
    res["roundtrip_names_equal"] = [n for n, _ in full] == [m[0] for m in metas]
    res["roundtrip_meta_shapes_equal"] = all(
        tuple(t.shape) == m[1] and t.dtype == m[2] for (_, t), m in zip(full, metas, strict=True)
    )
    res["roundtrip_missing"] = sorted(set(hf_sd) - {n for n, _ in full} - {"lm_head.weight"})
    res["roundtrip_extra"] = sorted({n for n, _ in full} - set(hf_sd))
    res["roundtrip_bitexact"] = all(torch.equal(t, hf_sd[n]) for n, t in full if n in hf_sd)

    # 2. Log-probs and entropies vs the plain HF model.
    hf = load_causal_lm(path, torch.float32, torch.device("cpu"))
    bs = batches(pad_id=0)
    for name, batch in bs.items():
        for tag, model in (("ref", ref), ("policy", policy)):
            with torch.no_grad():
                lp, ent = logprobs(backend, model, batch, with_entropy=True)
                hf_batch = bs["packed"] if name == "packed_nomask" else batch  # HF SDPA needs the block mask
                hlp, hent = forward_logprobs(hf, hf_batch, with_entropy=True)
            # Padding positions of a short row hold garbage in both (HF masks pad keys, Megatron is causal).
            real = batch["seq_ids"] >= 0
            res[f"logprob_diff_{name}_{tag}"] = max_diff(lp, hlp, real)
            res[f"entropy_diff_{name}_{tag}"] = max_diff(ent, hent, real)
    res["logprob_zero_outside_loss"] = bool((lp[:, 0] == 0).all())
    # Several micro-batches of different shapes in one schedule (pipeline stages exchange each one's shape).
    names = ["pad", "packed", "pad_full"]
    with torch.no_grad():
        several = backend.forward_backward(ref, [bs[n] for n in names], forward_only=True)
        hf_lps = [forward_logprobs(hf, bs[n])[0] for n in names]
    res["several_microbatches_diff"] = max(
        max_diff(lp, h, bs[n]["seq_ids"] >= 0) for n, lp, h in zip(names, several, hf_lps, strict=True)
    )
    with torch.no_grad():
        lp_only = backend.forward_backward(policy, [bs["packed"]], forward_only=True)[0]  # no loss function
        _, none = logprobs(backend, policy, bs["packed"])
        lp_ent, _ = logprobs(backend, policy, bs["packed"], with_entropy=True)
    res["logprob_without_entropy_equal"] = none is None and torch.equal(lp_only, lp_ent)
    # Of the distribution the engines sample from: a temperature alone (vocab-parallel), and top-k / top-p (the
    # vocabulary gathered): log-probs and entropies against the HF model's.
    for key, sd in (("temperature", SamplingDist(0.7)), ("truncated", SamplingDist(0.7, 0.9, 20))):
        batch = bs["pad"]
        kw = {"forward_only": True, "with_entropy": True, "sampling_dist": sd}
        with torch.no_grad():
            out = backend.forward_backward(policy, [batch], lambda b, lp, e: (lp.sum() * 0, {"lp": lp, "e": e}), **kw)
            hlp, hent = forward_logprobs(hf, batch, with_entropy=True, sampling_dist=sd)
        real = batch["seq_ids"] >= 0
        res[f"sampling_logprob_diff_{key}"] = max_diff(out[0]["lp"], hlp, real)
        res[f"sampling_entropy_diff_{key}"] = max_diff(out[0]["e"], hent, real)

    # 3. One optimizer step vs torch AdamW on the HF model (same loss, clipping, weight decay on every param).
    batch = bs["pad"]
    opt = backend.optimizer(policy, total_steps=10)
    opt.zero_grad()
    train(backend, policy, [batch], loss_of, with_entropy=True)
    gn = opt.step()
    hopt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    hlp, hent = forward_logprobs(hf, batch, with_entropy=True)
    loss_of(hlp, hent, batch).backward()
    hgn = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP))
    hopt.step()
    hsd = hf.state_dict()
    after1 = {n: t.clone() for n, t in backend.full_weights(policy, tied)}
    res["step_grad_norm"] = [gn, hgn]
    res["step_weight_diff"] = max(max_diff(t, hsd[n]) for n, t in after1.items())
    res["step_weight_change"] = max(max_diff(t, hf_sd[n]) for n, t in after1.items())

    # 3b. The critic: values and one step vs agentrl's HF ValueModel with the same (non-zero) head.
    critic = backend.build("critic")
    hcritic = load_value_model(path, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    w0, b0 = torch.randn(1, hcritic.value_head.in_features, generator=g) * 0.1, torch.randn(1, generator=g)
    head = getattr(_unwrap(critic), "output_layer", None)  # the last pipeline stage's
    with torch.no_grad():
        for mod in (head, hcritic.value_head) if head is not None else (hcritic.value_head,):
            mod.weight.copy_(w0)
            mod.bias.copy_(b0)
    copt = backend.optimizer(critic, total_steps=10)

    def value_loss(v, batch):
        w = batch["loss_mask"]
        return (((v - batch["advantages"]) ** 2) * w).sum() / w.sum()

    for name in ("pad", "packed"):
        with torch.no_grad():
            v, hv = values(backend, critic, bs[name]), forward_values(hcritic, bs[name])
        res[f"value_diff_{name}"] = max_diff(v, hv, bs[name]["seq_ids"] >= 0)
    copt.zero_grad()
    train(backend, critic, [batch], lambda v, _, b: value_loss(v, b))
    cgn = copt.step()
    hcopt = torch.optim.AdamW(hcritic.parameters(), lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    value_loss(forward_values(hcritic, batch), batch).backward()
    hcgn = float(torch.nn.utils.clip_grad_norm_(hcritic.parameters(), CLIP))
    hcopt.step()
    res["critic_grad_norm"] = [cgn, hcgn]
    head_diff = torch.zeros(1)
    if head is not None:
        w_diff = max_diff(head.weight, hcritic.value_head.weight)
        head_diff[0] = max(w_diff, max_diff(head.bias, hcritic.value_head.bias))
    dist.all_reduce(head_diff, op=dist.ReduceOp.MAX)  # to rank 0 from the last stage
    res["critic_head_diff"] = float(head_diff)
    with torch.no_grad():
        res["critic_value_diff_after_step"] = max_diff(
            values(backend, critic, bs["packed"]), forward_values(hcritic, bs["packed"]), bs["packed"]["seq_ids"] >= 0
        )

    # 4. Checkpoint after step 1, then step 2; a fresh build loads it and repeats step 2.
    ckpt = os.path.join(args.work, "ckpt")
    extra = {"rank": rank, "counter": 7}
    backend.save_checkpoint(ckpt, {"policy": policy, "critic": critic}, {"optim": opt, "critic_optim": copt}, extra)
    with torch.no_grad():
        values_saved = values(backend, critic, bs["pad"])

    def loss2(lp, ent, b):  # log-probs only (Megatron's in-place cross entropy on the logits), entropy a metric
        assert not ent.requires_grad
        return loss_of(lp, None, b)

    def step2(model, o):  # two micro-batches accumulate into one step
        o.zero_grad()
        train(backend, model, [bs["packed"], bs["pad"]], loss2, with_entropy=True, entropy_grad=False)
        return o.step()

    gn2 = step2(policy, opt)
    after2 = {n: t.clone() for n, t in backend.full_weights(policy, tied)}
    policy2, critic2 = backend.build("policy"), backend.build("critic")
    opt2, copt2 = backend.optimizer(policy2, total_steps=10), backend.optimizer(critic2, total_steps=10)
    got = backend.load_checkpoint(ckpt, {"policy": policy2, "critic": critic2}, {"optim": opt2, "critic_optim": copt2})
    with torch.no_grad():
        res["ckpt_critic_value_diff"] = max_diff(values(backend, critic2, bs["pad"]), values_saved)
    res["ckpt_critic_steps"] = copt2.steps
    loaded = {n: t.clone() for n, t in backend.full_weights(policy2, tied)}
    res["ckpt_extra_ok"] = got == extra
    res["ckpt_steps"] = opt2.steps
    res["ckpt_load_diff"] = max(max_diff(t, after1[n]) for n, t in loaded.items())
    gn2b = step2(policy2, opt2)
    again = {n: t.clone() for n, t in backend.full_weights(policy2, tied)}
    res["ckpt_step_grad_norm"] = [gn2, gn2b]
    res["ckpt_step_diff"] = max(max_diff(t, after2[n]) for n, t in again.items())

    # 5. Offline export of the checkpoint to an HF directory (one process, no Megatron model).
    dist.barrier()
    if rank == 0:
        from agentrl.trainer.backends.megatron_bridge import export_hf

        out_dir = os.path.join(args.work, "hf_export")
        export_hf(ckpt, out_dir)  # the HF source recorded in the checkpoint
        exp = load_file(os.path.join(out_dir, "model.safetensors"))
        res["export_names_equal"] = sorted(exp) == sorted(after1)
        res["export_bitexact"] = all(torch.equal(exp[n], after1[n]) for n in after1 if n in exp)
        res["wall_s"] = time.time() - t0
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
