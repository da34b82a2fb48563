"""trainer.lora: peft's adapters on the FSDP2 policy (one rank over gloo, the tiny model, a recorded real batch of
the default example). The base never changes, the optimizer holds the adapters only, and what leaves the trainer
(weight syncs, the export of a checkpoint) is the merged model under the HF names."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from agentrl.config import ConfigError, load_config
from agentrl.run.batch_files import load_batch
from agentrl.trainer import lora
from agentrl.trainer.checkpoint import export_hf
from agentrl.trainer.worker import TrainerRank

ROOT = Path(__file__).resolve().parents[1]
BATCH = ROOT / "tests" / "data" / "batches" / "agentic_sokoban.jsonl.gz"


def _rank(model_path: str, *overrides: str) -> TrainerRank:
    cfg = load_config(ROOT / "examples" / "agentic_sokoban.yaml", ["trainer.optim.lr=1e-3", *overrides])
    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), model_path, 0, 1)
    rank.setup("127.0.0.1", 0)
    return rank


def _close(rank: TrainerRank) -> None:
    with contextlib.suppress(Exception):
        rank.backend.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


@pytest.fixture(scope="module")
def samples():
    return load_batch(BATCH)[:96]


def test_lora_trains_the_adapters_only_and_hands_out_the_merged_model(one_rank_group, tiny_model_path, samples,
                                                                      tmp_path):  # fmt: skip
    plain = _rank(tiny_model_path)
    plain_weights = dict(plain.backend.full_weights(plain.model, plain.tied))
    plain_logprobs = plain.compute_logprobs(samples[:8])
    _close(plain)

    rank = _rank(tiny_model_path, "trainer.lora.rank=8", "trainer.lora.alpha=16")
    params = dict(rank.model.named_parameters())
    trainable = {k for k, p in params.items() if p.requires_grad}
    assert trainable and all(lora.is_adapter(k) for k in trainable)
    in_optimizer = {id(p) for group in rank.opt.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(params[k]) for k in trainable}  # no optimizer state for the frozen base
    base_before = {k: _local(p) for k, p in params.items() if not lora.is_adapter(k)}

    # B starts at 0: the same model as without adapters, under the same names
    merged = dict(rank.backend.full_weights(rank.model, rank.tied))
    assert list(merged) == list(plain_weights)
    assert all(torch.equal(merged[k], plain_weights[k]) for k in merged)
    assert [m[0] for m in rank.backend.weight_metas(rank.model, rank.tied)] == list(plain_weights)
    assert rank.compute_logprobs(samples[:8]) == plain_logprobs

    losses = [rank.train_step(samples)["train/loss"] for _ in range(3)]
    params = dict(rank.model.named_parameters())
    assert all(torch.equal(_local(params[k]), v) for k, v in base_before.items()), "the base moved"
    moved = dict(rank.backend.full_weights(rank.model, rank.tied))
    changed = {k for k in moved if not torch.equal(moved[k], plain_weights[k])}
    assert changed == {lora.hf_name(k).removesuffix(".lora_B.default.weight") + ".weight"
                       for k in trainable if k.endswith("lora_B.default.weight")}  # fmt: skip
    q = "model.layers.0.self_attn.q_proj"  # merged = W + alpha / r * B @ A
    a, b = _local(params[f"{q}.lora_A.default.weight"]), _local(params[f"{q}.lora_B.default.weight"])
    assert torch.allclose(moved[f"{q}.weight"], plain_weights[f"{q}.weight"] + 2.0 * b @ a, atol=1e-6)
    assert losses[-1] != losses[0]

    rank.save_checkpoint(str(tmp_path / "ckpt"))
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    from safetensors.torch import load_file

    exported = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    assert all(torch.equal(exported[k], moved[k]) for k in moved)  # the export is the merged model
    # without merging: a peft adapter dir (peft itself loads it onto the exported base) and the base beside it
    export_hf(tmp_path / "ckpt", tmp_path / "adapter", merged=False)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base", dtype=torch.float32)
    assert all(torch.equal(base.state_dict()[k], plain_weights[k]) for k in plain_weights)  # the base never moved
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    assert all(torch.allclose(peft_model.state_dict()[k], moved[k], atol=1e-6) for k in moved)
    version = rank.version
    _close(rank)

    resumed = _rank(tiny_model_path, "trainer.lora.rank=8", "trainer.lora.alpha=16")
    assert resumed.load_checkpoint(str(tmp_path / "ckpt")) == version
    again = dict(resumed.backend.full_weights(resumed.model, resumed.tied))
    assert all(torch.equal(again[k], moved[k]) for k in moved)
    _close(resumed)
    full = _rank(tiny_model_path)
    with pytest.raises(ValueError, match=r"was saved with trainer\.lora=\{'rank': 8"):
        full.load_checkpoint(str(tmp_path / "ckpt"))
    _close(full)


def test_full_warm_start_fine_tunes_every_weight_then_the_adapters_start_on_its_result(
    one_rank_group, tiny_model_path, samples, tmp_path
):
    sft = [s for s in samples if sum(s.loss_mask)][:16]
    plain = _rank(tiny_model_path, "trainer.sft.lr=1e-3")
    plain_sft = [plain.sft_step(sft)["sft/loss"] for _ in range(3)]
    plain.end_warm_start(str(tmp_path / "plain"))
    fine_tuned = dict(plain.backend.full_weights(plain.model, plain.tied))
    _close(plain)

    rank = _rank(tiny_model_path, "trainer.lora.rank=8", "trainer.sft.lr=1e-3")
    assert [rank.sft_step(sft)["sft/loss"] for _ in range(3)] == plain_sft  # full fine-tuning, step for step
    assert not any(lora.is_adapter(k) for k, _ in rank.model.named_parameters())
    assert rank.end_warm_start(str(tmp_path / "base"))
    params = dict(rank.model.named_parameters())
    trainable = {k for k, p in params.items() if p.requires_grad}
    assert trainable and all(lora.is_adapter(k) for k in trainable)  # RL trains the adapters only...
    assert {id(p) for g in rank.opt.optimizer.param_groups for p in g["params"]} == {id(params[k]) for k in trainable}
    assert rank.sft_opt is None
    merged = dict(rank.backend.full_weights(rank.model, rank.tied))  # ...on the warm-started base (B = 0)
    assert list(merged) == list(fine_tuned) and all(torch.equal(merged[k], fine_tuned[k]) for k in merged)
    base = {k: _local(p) for k, p in params.items() if not lora.is_adapter(k)}
    rank.train_step(samples)
    params = dict(rank.model.named_parameters())
    assert all(torch.equal(_local(params[k]), v) for k, v in base.items()), "the base moved in RL"
    assert any(_local(params[k]).abs().sum() > 0 for k in trainable if "lora_B" in k)  # the adapters learn
    trained = dict(rank.backend.full_weights(rank.model, rank.tied))
    rank.save_checkpoint(str(tmp_path / "ckpt"))
    _close(rank)

    # the checkpoint holds the adapters (and their optimizer state), not the base: it names the base's dir
    shards = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.distcp"))
    base_bytes = sum(f.stat().st_size for f in (tmp_path / "base").glob("*.safetensors"))
    assert shards < base_bytes / 2, (shards, base_bytes)
    resumed = _rank(tiny_model_path, "trainer.lora.rank=8", "trainer.sft.lr=1e-3")  # built on the original model
    resumed.load_checkpoint(str(tmp_path / "ckpt"))  # rebuilt on the warm start's base, then the adapters
    again = dict(resumed.backend.full_weights(resumed.model, resumed.tied))
    assert all(torch.equal(again[k], trained[k]) for k in trained)
    _close(resumed)
    export_hf(tmp_path / "ckpt", tmp_path / "merged")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    import shutil

    shutil.rmtree(tmp_path / "base")
    with pytest.raises(FileNotFoundError, match=r"LoRA adapters whose base .*/base is gone"):
        export_hf(tmp_path / "ckpt", tmp_path / "merged-again")
    orphan = _rank(tiny_model_path, "trainer.lora.rank=8", "trainer.sft.lr=1e-3")
    with pytest.raises(FileNotFoundError, match=r"the LoRA base .*/base is gone"):  # every rank raises, together
        orphan.load_checkpoint(str(tmp_path / "ckpt"))
    _close(orphan)


def test_lora_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lora needs trainer\.backend: fsdp2"):
        load_config(None, ["trainer.lora.rank=8", "trainer.backend=megatron"])
    with pytest.raises(ConfigError, match=r"sync: adapter needs rollout\.backend: vllm \(sglang"):
        load_config(None, ["trainer.lora.rank=8", "rollout.backend=sglang"])
    with pytest.raises(ConfigError, match=r"rank 4: vLLM serves adapters of rank 1, 8, 16"):
        load_config(None, ["trainer.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"weight_sync_delta with trainer\.lora\.sync: adapter"):
        load_config(None, ["trainer.lora.rank=8", "rollout.weight_sync_delta=true"])
    assert load_config(None, ["trainer.lora.rank=4", "trainer.lora.sync=merged", "rollout.backend=sglang"])
    with pytest.raises(ValueError, match="matched no linear layer"):
        lora.add_adapters(torch.nn.Sequential(torch.nn.Linear(2, 2)), load_config(
            None, ["trainer.lora.target_modules=[nope]"]).trainer.lora)  # fmt: skip
