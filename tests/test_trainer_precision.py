"""Precision and memory of the FSDP2 trainer on CPU: the meta-device sharded build, bf16 mixed precision,
activation checkpointing, CPU offload and the chunked log-prob / entropy kernel.

Models are built through `build_sharded` in a 1-rank gloo process group (the trainer's own path). The memory
test runs each setting in a fresh subprocess (this file as a script) so that peak RSS values do not mix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.config.schema import TrainerConfig
from agentrl.platform import CPU
from agentrl.trainer import losses as L
from agentrl.trainer import model as M
from agentrl.trainer import sharding as S
from agentrl.trainer.batching import collate
from agentrl.trainer.prompt_sharing import plan_sharing

CPU_DEV = torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(prefix: int = 0) -> dict[str, torch.Tensor]:
    """Three rows (padded), the last tokens of each trained on; `prefix` shared leading tokens."""
    head = [9 + j % 50 for j in range(prefix)]
    toks = [head + [5 + (7 * i + j) % 500 for j in range(n)] for i, n in enumerate([30, 23, 17])]
    masks = [[0] * (len(t) - 12) + [1] * 12 for t in toks]
    return collate(toks, {"loss_mask": masks}, "pad", 0)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss_and_grads(model, batch) -> tuple[float, torch.Tensor]:
    """The SFT loss (token-mean NLL on the loss mask), and all gradients flattened (fp32)."""
    model.zero_grad(set_to_none=True)
    lp, _ = M.forward_logprobs(model, batch)
    mask = batch["loss_mask"]
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach()), torch.cat([_full(p.grad).float().flatten() for p in model.parameters()])


# ---- meta-device build ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["policy", "reference", "critic"])
def test_meta_init_and_rank0_broadcast_equal_a_direct_load(one_rank_group, tiny_model_path, role) -> None:
    """Every parameter bit-equal to from_pretrained's, the rotary buffers (not in the checkpoint, garbage
    after to_empty) recomputed, the tied head still tied, and the outputs identical."""
    from tests.hf_models import load_causal_lm, load_value_model

    tc = TrainerConfig(activation_checkpointing=role == "policy")  # wrapper names must not leak into keys
    built = S.build_sharded(tiny_model_path, CPU_DEV, tc, CPU, role)
    if role == "critic":
        direct = load_value_model(tiny_model_path, torch.float32, CPU_DEV)
    else:
        direct = load_causal_lm(tiny_model_path, torch.float32, CPU_DEV)
    got, want = built.state_dict(), direct.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(_full(got[k]), want[k]) for k in want)
    bufs = dict(built.named_buffers())
    assert bufs and all(torch.equal(b, dict(direct.named_buffers())[k]) for k, b in bufs.items())
    if role != "critic":
        assert built.lm_head.weight is built.model.embed_tokens.weight
    b = _batch()
    args = (b["input_ids"], b["attention_mask"], b["position_ids"])
    with torch.no_grad():
        out, ref = (built(*args), direct(*args)) if role == "critic" else (built(*args).logits, direct(*args).logits)
    assert torch.equal(out, ref)
    assert built.training == (role != "reference")
    assert all(p.requires_grad == (role != "reference") for p in built.parameters())


def test_reference_is_stored_in_the_compute_dtype_and_policy_keeps_fp32_masters(
    one_rank_group, tiny_model_path
) -> None:
    tc = TrainerConfig(precision="bf16")
    ref = S.build_sharded(tiny_model_path, CPU_DEV, tc, CPU, "reference")
    pol = S.build_sharded(tiny_model_path, CPU_DEV, tc, CPU, "policy")
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pol.parameters()} == {torch.float32}
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    assert S.resolve_dtype(TrainerConfig(), CPU) == torch.float32


# ---- precision and memory ---------------------------------------------------------------------------------------


def test_bf16_mixed_precision_loss_and_grads_close_to_fp32(one_rank_group, tiny_model_path) -> None:
    """bf16 compute over fp32 masters, fp32 reduction: the loss within 1e-3 relative and the gradients within
    3% (norm of the difference) of fp32; not identical, so bf16 really ran. Grads land in fp32 on the masters."""
    b = _batch()
    fp32 = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(precision="fp32"), CPU, "policy")
    bf16 = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(precision="bf16"), CPU, "policy")
    l32, g32 = _loss_and_grads(fp32, b)
    l16, g16 = _loss_and_grads(bf16, b)
    assert all(p.grad.dtype == torch.float32 for p in bf16.parameters())
    rel = float((g16 - g32).norm() / g32.norm())
    print(f"bf16 vs fp32: loss {l32:.6f} vs {l16:.6f}, grad rel diff {rel:.4f}")
    assert 0 < abs(l16 - l32) < 1e-3 * abs(l32)
    assert 0 < rel < 0.03


@pytest.mark.parametrize("prefix", [0, 24])
def test_activation_checkpointing_gives_the_same_gradients(one_rank_group, tiny_model_path, prefix) -> None:
    """Recomputed layers give bit-for-bit the plain gradients, also on a batch whose shared prefix would go
    through the KV cache (the replay must not append to the cache a second time)."""
    b = _batch(prefix)
    if prefix:
        plan = plan_sharing(b)
        assert plan is not None and plan.prefix == prefix
    plain = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(activation_checkpointing=False), CPU, "policy")
    ckpt = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(activation_checkpointing=True), CPU, "policy")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert sum(isinstance(m, CheckpointWrapper) for m in ckpt.modules()) == ckpt.config.num_hidden_layers
    l0, g0 = _loss_and_grads(plain, b)
    l1, g1 = _loss_and_grads(ckpt, b)
    assert l0 == pytest.approx(l1, abs=1e-6)
    assert torch.allclose(g0, g1, atol=1e-6)


def test_cpu_offload_step_matches(one_rank_group, tiny_model_path) -> None:
    b = _batch()
    on = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(cpu_offload=True), CPU, "policy")
    off = S.build_sharded(tiny_model_path, CPU_DEV, TrainerConfig(), CPU, "policy")
    l0, g0 = _loss_and_grads(off, b)
    l1, g1 = _loss_and_grads(on, b)
    assert l0 == l1 and torch.equal(g0, g1)


# ---- chunked log-probs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_whole_softmax(temperature) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 11, 97)).requires_grad_()
    targets = torch.randint(0, 97, (3, 11))
    coef = torch.randn(3, 11)

    def whole():
        logp_all = torch.log_softmax(logits.float() / temperature, -1)
        lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return lp, -(logp_all.exp() * logp_all).sum(-1)

    lp0, ent0 = whole()
    (g0,) = torch.autograd.grad((lp0 * coef).sum() + ent0.sum(), logits, retain_graph=True)
    (g0_lp,) = torch.autograd.grad((lp0 * coef).sum(), logits)
    for chunk in (97, 5 * 97, 10**9):  # one row per chunk, uneven chunks, one chunk
        lp, ent = L.token_logprobs(logits, targets, temperature, True, True, chunk_elems=chunk)
        assert torch.allclose(lp, lp0, atol=1e-6) and torch.allclose(ent, ent0, atol=1e-5)
        (g,) = torch.autograd.grad((lp * coef).sum() + ent.sum(), logits)
        assert torch.allclose(g, g0, atol=1e-6)
        lp, ent = L.token_logprobs(logits, targets, temperature, True, False, chunk_elems=chunk)
        assert not ent.requires_grad and torch.allclose(ent, ent0, atol=1e-5)
        (g,) = torch.autograd.grad((lp * coef).sum(), logits)
        assert torch.allclose(g, g0_lp, atol=1e-6)
    with torch.no_grad():
        lp, ent = L.token_logprobs(logits, targets, temperature, True, chunk_elems=2 * 97)
    assert torch.allclose(lp, lp0, atol=1e-6) and torch.allclose(ent, ent0, atol=1e-5)
    p = torch.softmax(logits.detach(), -1)
    _, entropy = L.token_logprobs(logits.detach(), None, with_entropy=True)
    assert torch.allclose(entropy, -(p * p.log()).sum(-1), atol=1e-5)


def test_forward_logprobs_in_chunks_equals_one_chunk(tiny_model_path, monkeypatch) -> None:
    """The model path (loss positions, padding) is unchanged when the vocabulary pass is split into chunks."""
    from tests.hf_models import load_causal_lm

    model = load_causal_lm(tiny_model_path, torch.float32, CPU_DEV)
    b = _batch()
    lp1, ent1 = M.forward_logprobs(model, b, with_entropy=True)
    (g1,) = torch.autograd.grad((lp1 * b["loss_mask"]).sum(), model.model.embed_tokens.weight)
    monkeypatch.setattr(L, "LOGIT_CHUNK_ELEMS", 3 * model.config.vocab_size)  # 3 rows per chunk
    lp2, ent2 = M.forward_logprobs(model, b, with_entropy=True)
    (g2,) = torch.autograd.grad((lp2 * b["loss_mask"]).sum(), model.model.embed_tokens.weight)
    assert torch.allclose(lp1, lp2, atol=1e-6) and torch.allclose(ent1, ent2, atol=1e-5)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_packed_mask_is_dropped_only_for_flash_attention(tiny_model_path) -> None:
    """Flash-attention models read packed boundaries from the position ids; SDPA keeps the dense mask. On
    CPU the builder picks SDPA (FA2 needs CUDA, bf16 and flash-attn)."""
    from agentrl.platform import platform_for
    from tests.hf_models import load_causal_lm

    model = load_causal_lm(tiny_model_path, torch.float32, CPU_DEV)
    packed, pad = collate([[5, 6, 7], [8, 9]], {}, "packed", 0), collate([[5, 6, 7], [8, 9]], {}, "pad", 0)
    assert M.model_mask(model, packed["attention_mask"]) is packed["attention_mask"]
    model.config._attn_implementation = "flash_attention_2"
    assert M.model_mask(model, packed["attention_mask"]) is None
    assert M.model_mask(model, pad["attention_mask"]) is pad["attention_mask"]  # padding over several rows
    lean = collate([[5, 6, 7], [8, 9]], {}, "packed", 0, block_mask=False)  # what the worker collates for flash
    assert lean["attention_mask"].shape == (1, 5) and M.model_mask(model, lean["attention_mask"]) is None
    assert S.attn_implementation(CPU, torch.bfloat16) == "sdpa"
    assert S.attn_implementation(platform_for("cuda", 1), torch.float32) == "sdpa"
    assert S.attn_implementation(platform_for("npu", 1), torch.bfloat16) == "flash_attention_2"  # simulated NPU


def test_fused_adamw_only_on_cuda() -> None:
    from agentrl.config.schema import OptimConfig
    from agentrl.trainer.optim import build_optimizer

    opt, _ = build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(lr=3e-4), 10)
    assert not opt.param_groups[0]["fused"] and opt.param_groups[0]["foreach"] is False


# ---- memory: activation checkpointing ----------------------------------------------------------------------------

MEM_TOKENS = 1024


def _write_random_qwen3(out: str) -> None:
    """A ~45M-parameter Qwen3 with random weights (no download): 12 layers, hidden 512, vocab 8192."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)


def _memory_step(model_dir: str, checkpointing: bool) -> dict:
    """Subprocess body: build the policy, one forward/backward/AdamW step on MEM_TOKENS tokens; peak RSS."""
    import torch.distributed as dist

    from agentrl.config.schema import OptimConfig
    from agentrl.platform import configure_cpu_threads
    from agentrl.trainer.optim import build_optimizer

    configure_cpu_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    tc = TrainerConfig(activation_checkpointing=checkpointing)
    model = S.build_sharded(model_dir, CPU_DEV, tc, CPU, "policy")
    opt, _ = build_optimizer(model.parameters(), OptimConfig(lr=3e-4), 1)
    toks = [[(31 * j) % 8000 + 3 for j in range(MEM_TOKENS)]]
    b = collate(toks, {"loss_mask": [[0] * (MEM_TOKENS - 64) + [1] * 64]}, "pad", 0)
    before = _peak_rss_kib()
    t0 = time.perf_counter()
    loss, _ = _loss_and_grads(model, b)
    opt.step()
    peak = _peak_rss_kib()
    dist.destroy_process_group()
    return {"loss": loss, "before_mib": before / 1024, "peak_mib": peak / 1024, "s": time.perf_counter() - t0}


def _peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM), in KiB. Not `ru_maxrss`: Linux carries that over from the forked
    parent across exec, so under a pytest process grown larger than the measured step (the full suite) both peaks
    read as the parent's size (measured in CI: 27 and 0 MiB above the logits, against 775 and 520 MiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _measuring_env() -> dict[str, str]:
    """A clean environment for a peak-RSS measurement: nothing earlier tests left in this process's environment
    (vLLM's and torch's allocator settings, huge pages) reaches the measured one."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "OMP_NUM_THREADS": "1"}


@pytest.mark.heavy
def test_activation_checkpointing_lowers_peak_memory(tmp_path) -> None:
    """Peak RSS of one train step with checkpointing on is measurably (>= 150 MiB) below the same step without
    it, each setting in a fresh process; the loss is the same."""
    _write_random_qwen3(str(tmp_path))
    res = {}
    for ck in (False, True):
        out = subprocess.run(
            [sys.executable, __file__, str(tmp_path), str(int(ck))],
            capture_output=True, text=True, timeout=120, env=_measuring_env(),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        res[ck] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS: checkpointing off {res[False]}, on {res[True]}")
    assert res[False]["loss"] == pytest.approx(res[True]["loss"], abs=1e-5)
    assert res[False]["peak_mib"] - res[True]["peak_mib"] >= 150


def _logprob_memory(chunked: bool) -> dict:
    """Subprocess body: log-probs (+ entropy metric) of 2048 positions over a 32k vocabulary, forward and
    backward; peak RSS above the logits themselves."""
    torch.manual_seed(0)
    logits = torch.randn(2048, 32768, requires_grad=True)
    targets = torch.randint(0, 32768, (2048,))
    base = _peak_rss_kib()
    if chunked:
        lp, _ = L.token_logprobs(logits, targets, with_entropy=True, entropy_grad=False)
    else:  # the previous whole-vocabulary computation
        logp_all = torch.log_softmax(logits.float(), -1)
        lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        with torch.no_grad():
            _ = -(logp_all.exp() * logp_all).sum(-1)
    lp.sum().backward()
    return {"peak_mib": (_peak_rss_kib() - base) / 1024}


@pytest.mark.heavy
def test_chunked_logprobs_lower_peak_memory() -> None:
    """The [tokens, vocab] fp32 log-softmax (256 MiB here) is never whole: >= 150 MiB below the whole pass."""
    res = {}
    for chunked in (False, True):
        out = subprocess.run(
            [sys.executable, __file__, "logprob_memory", str(int(chunked))],
            capture_output=True, text=True, timeout=60, env=_measuring_env(),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        res[chunked] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
    print(f"log-prob peak RSS above the logits: whole {res[False]:.0f} MiB, chunked {res[True]:.0f} MiB")
    assert res[False] - res[True] >= 150


def _two_rank_build(model_dir: str) -> dict:
    """Subprocess body (RANK, WORLD_SIZE, MASTER_* in the environment): build every role sharded over 2 ranks;
    each rank's full tensors and outputs must equal a direct load (rank 1 received everything by broadcast)."""
    import torch.distributed as dist

    from tests.hf_models import load_causal_lm, load_value_model

    dist.init_process_group("gloo")
    direct = load_causal_lm(model_dir, torch.float32, CPU_DEV)
    b = _batch()
    args = (b["input_ids"], b["attention_mask"], b["position_ids"])
    out = {}
    for role, ck in (("policy", True), ("reference", False), ("critic", True)):
        model = S.build_sharded(model_dir, CPU_DEV, TrainerConfig(activation_checkpointing=ck), CPU, role)
        want = (load_value_model(model_dir, torch.float32, CPU_DEV) if role == "critic" else direct).state_dict()
        got = model.state_dict()
        sharded = all(_full(v).shape != v.to_local().shape for k, v in got.items() if v.dim() and v.shape[0] > 1)
        equal = set(got) == set(want) and all(torch.equal(_full(got[k]), want[k]) for k in want)
        same_out = True
        if role == "policy":
            with torch.no_grad():
                # float tolerance: the all-gathered copies sit elsewhere in memory, and a GEMM's rounding can
                # follow its operands' alignment (bitwise equality failed in 2 of 21 runs here)
                same_out = torch.allclose(model(*args).logits, direct(*args).logits, rtol=1e-5, atol=1e-6)
        out[role] = bool(sharded and equal and same_out)
    dist.barrier()  # neither rank tears down while the other still talks to rank 0's store (seen: an abort on exit)
    dist.destroy_process_group()
    return out


@pytest.mark.heavy
def test_two_ranks_receive_their_shards_from_rank0(tiny_model_path) -> None:
    """Only rank 0 reads the checkpoint; the shards both ranks end up with form the checkpoint exactly."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "two_ranks", tiny_model_path],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == {"policy": True, "reference": True, "critic": True}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `tests` from the repo root
    if sys.argv[1] == "two_ranks":
        print(json.dumps(_two_rank_build(sys.argv[2])))
    elif sys.argv[1] == "logprob_memory":
        print(json.dumps(_logprob_memory(bool(int(sys.argv[2])))))
    else:
        print(json.dumps(_memory_step(sys.argv[1], bool(int(sys.argv[2])))))
    # skip interpreter teardown: a gloo / TCPStore thread still being destroyed there has aborted a finished rank
    # ("terminate called without an active exception", rc -6) after it printed its result
    sys.stdout.flush()
    os._exit(0)
