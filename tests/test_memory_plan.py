"""The memory plan: parameter counts, the verdict and its remedies, `agentrl plan`, the refusal in `agentrl train`,
and the estimate against the measured peak memory of one real trainer step on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl import memory_plan as mp
from agentrl.cli import main
from agentrl.config import Config, ConfigError, load_config
from agentrl.config.schema import LoraConfig

ROOT = Path(__file__).parents[1]
CLUSTER = ROOT / "examples" / "sokoban_cluster.yaml"
GiB = mp.GiB


def _model_params(config) -> int:
    """Exact parameter count of an HF model built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "qwen3_untied"])
def test_param_count_is_exact(kind) -> None:
    from transformers import Qwen2Config, Qwen3Config

    cls = Qwen2Config if kind == "qwen2" else Qwen3Config
    config = cls(
        vocab_size=640, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=kind != "qwen3_untied",
    )  # fmt: skip
    assert mp.dims_from_config(config.to_dict(), kind).params == _model_params(config)


def test_tiny_model_dims(tiny_model_path) -> None:
    from transformers import AutoConfig

    assert mp.load_dims(tiny_model_path).params == _model_params(AutoConfig.from_pretrained(tiny_model_path))


@pytest.mark.parametrize(
    ("model_id", "published"),
    [("Qwen/Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen/Qwen2.5-7B-Instruct", 7.61e9), ("Qwen/Qwen3-8B", 8.19e9)],
)
def test_built_in_dims_match_published_sizes(model_id, published) -> None:
    dims = mp.known_dims(model_id)
    assert dims is not None and dims.name == model_id and "built-in" in dims.source
    assert abs(dims.params / published - 1) < 0.02


def test_sizes_and_counts_parse() -> None:
    assert mp.parse_bytes("80GiB") == 80 * GiB == mp.parse_bytes("80G")
    assert mp.parse_bytes("512MiB") == 512 << 20
    assert mp.parse_count("7B") == 7_000_000_000 and mp.parse_count("500M") == 500_000_000
    with pytest.raises(ConfigError):
        mp.parse_bytes("lots")


def test_unknown_hub_id_offline_is_one_line_or_uses_params() -> None:
    with pytest.raises(ConfigError, match="--params"):
        mp.load_dims("nobody/no-such-model-xyz")
    dims = mp.load_dims("nobody/no-such-model-xyz", params="7B")
    assert "--params" in dims.source and abs(dims.params / 7e9 - 1) < 0.15


def test_cluster_example_fits_80gib() -> None:
    cfg = load_config(CLUSTER)
    plan = mp.make_plan(cfg, mp.load_dims(cfg.model.path), "cuda", 80 * GiB)
    assert plan.settings["precision"] == "bf16" and plan.settings["activation checkpointing"] == "on"
    assert not plan.problems


def test_refusal_names_remedies_that_fit() -> None:
    """A 7B model on 4 ranks of 40 GiB: the line names the settings to change, and each remedy with a value
    makes the trainer fit on its own."""
    cfg = load_config(CLUSTER, ["model.path=Qwen/Qwen2.5-7B-Instruct", "trainer.micro_batch_tokens=8192",
                                "envs.max_total_tokens=8192", "rollout.max_model_len=8192"])  # fmt: skip
    dims = mp.load_dims(cfg.model.path)
    (line,) = mp.make_plan(cfg, dims, "cuda", 40 * GiB).problems
    assert line.startswith("trainer rank needs") and "of 40.0 GiB: " in line
    assert "raise trainer.num_ranks to" in line and "lower trainer.micro_batch_tokens to" in line
    assert line.endswith("or trainer.cpu_offload=true")
    ranks = int(line.split("raise trainer.num_ranks to ")[1].split(",")[0])
    tokens = int(line.split("lower trainer.micro_batch_tokens to ")[1].split(",")[0].split()[0])
    for key, value in (("num_ranks", ranks), ("micro_batch_tokens", tokens)):
        alt = cfg.model_copy(deep=True)
        setattr(alt.trainer, key, value)
        alt.envs.max_total_tokens = min(alt.envs.max_total_tokens, alt.trainer.micro_batch_tokens)
        assert mp.trainer_plan(alt, dims, True).total <= 40 * GiB
    ckpt_off = load_config(CLUSTER, ["trainer.activation_checkpointing=false"])
    (line,) = mp.make_plan(ckpt_off, mp.load_dims(cfg.model.path), "cuda", 24 * GiB).problems
    assert "set trainer.activation_checkpointing=true" in line


def test_components_follow_the_settings() -> None:
    cfg = load_config(CLUSTER)
    dims = mp.load_dims(cfg.model.path)

    def total(name: str, c: Config) -> float:
        return sum(x.bytes for x in mp.trainer_plan(c, dims, True).components if x.name == name)

    two = cfg.model_copy(deep=True)
    two.trainer.num_ranks = 8
    assert total("optimizer", two) == pytest.approx(total("optimizer", cfg) / 2)
    off = cfg.model_copy(deep=True)
    off.trainer.activation_checkpointing = False
    assert total("activations", off) > 5 * total("activations", cfg)
    kl = cfg.model_copy(deep=True)
    kl.trainer.algorithm.kl_coef = 0.1
    kl.trainer.algorithm.advantage = "gae"
    names = [c.name for c in mp.trainer_plan(kl, dims, True).components]
    assert "reference model" in names and "critic" in names
    offload = cfg.model_copy(deep=True)
    offload.trainer.cpu_offload = True
    assert total("weights", offload) == 0 < total("weights", cfg)
    adapters = cfg.model_copy(deep=True)
    adapters.trainer.lora = LoraConfig(rank=16)  # Qwen2.5-0.5B: 24 layers x 16 x (in + out) of 7 linears = 8.8M
    assert dims.lora_params(16, adapters.trainer.lora.target_modules) == 8_798_208
    assert total("optimizer", adapters) == pytest.approx(total("optimizer", cfg) * 8_798_208 / dims.params)
    assert total("gradients", adapters) < total("gradients", cfg) / 50
    warm = adapters.model_copy(deep=True)  # a full warm start fine-tunes every weight first: full FT's peak
    warm.trainer.sft.enabled = True
    assert total("optimizer", warm) == total("optimizer", cfg)
    warm.trainer.lora.warm_start = "adapters"
    assert total("optimizer", warm) == total("optimizer", adapters)
    delta = cfg.model_copy(deep=True)
    delta.rollout.weight_sync_delta = True
    for accelerator, copies in ((False, 1), (True, 0)):  # on a device the copy is in host memory: not planned
        engine = mp.engine_plan(delta, dims, accelerator, 80 * GiB)
        weights = sum(x.bytes for x in engine.components if x.name == "weights")
        assert sum(x.bytes for x in engine.components if x.name == "delta-sync copy") == copies * weights


def _cpu_run_configs() -> list[Path]:
    """The shipped run configs on the built-in tiny model (the others name accelerator models; tools.yaml is a
    serve-tools file)."""
    paths = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "tests/configs/tiny_pipeline.yaml"]
    tiny = [p for p in paths if "builtin:tiny" in p.read_text() or "\nmodel:" not in p.read_text()]
    return [p for p in tiny if p.name != "tools.yaml"]


@pytest.mark.parametrize("path", _cpu_run_configs(), ids=lambda p: p.name)
def test_cpu_run_configs_fit_a_24gib_machine(path, tiny_model_path) -> None:
    cfg = load_config(path)
    assert cfg.model.path == "builtin:tiny"
    plan = mp.make_plan(cfg, mp.load_dims(tiny_model_path), "cpu", 24 * GiB)
    assert not plan.problems


def test_plan_command_prints_per_rank_table(capsys) -> None:
    assert main(["plan", str(CLUSTER), "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "per trainer rank (x4)" in out and "per rollout engine (x4)" in out and "fits" in out
    assert main(["plan", str(CLUSTER), "--device-memory", "8GiB"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", str(CLUSTER), "model.path=nobody/no-such-model-xyz"]) == 2
    assert "--params" in capsys.readouterr().err


def test_train_refuses_a_plan_that_cannot_fit_before_any_actor(tmp_path) -> None:
    env = {**os.environ, mp.DEVICE_MEMORY_ENV: "256MiB"}
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl", "train", "tests/configs/tiny_pipeline.yaml", f"logging.run_dir={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    print(f"refused in {elapsed:.1f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentrl: config error: memory plan:")
    assert "of 0.2 GiB host RAM" in lines[0] and "rollout.kv_cache_gib" in lines[0]
    assert elapsed < 30  # an engine or Ray start alone takes longer on these machines
    assert not run_dir.exists()


# ---- estimate vs measurement -----------------------------------------------------------------------------------

MEASURE = """
import json, random, socket, sys, threading, time
import psutil
import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (imported before the baseline)
from agentrl.config.schema import Config
from agentrl.trainer.worker import TrainerRank
from agentrl.types import Sample

path, rows, length, ckpt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "ckpt"
cfg = Config()
cfg.trainer.micro_batch_tokens = cfg.envs.max_total_tokens = rows * length
cfg.trainer.precision, cfg.trainer.activation_checkpointing = "fp32", ckpt
rng = random.Random(0)
samples = [
    Sample([rng.randint(3, 600) for _ in range(length)], [0] + [1] * (length - 1), [-1.0] * length, [0] * length,
           float(i % 2), "g0", f"e{i}")
    for i in range(rows)
]
rank = TrainerRank(cfg.model_dump(by_alias=True), path, 0, 1)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
# The peak of the resident set, sampled: the process's own high-water mark (ru_maxrss) may be set by an import
# before the baseline and then hide the step entirely.
me, peak, done = psutil.Process(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], me.memory_info().rss)
        time.sleep(0.002)
base = me.memory_info().rss
sampler = threading.Thread(target=sample)
sampler.start()
rank.setup("127.0.0.1", port)
for _ in range(2):  # the second step runs with AdamW's state allocated: the steady state the plan describes
    rank.train_step(samples)
done.set()
sampler.join()
print(json.dumps({"cfg": cfg.model_dump(by_alias=True), "increase": peak[0] - base}))
rank.shutdown()
"""


def _random_qwen3(out: Path, tokenizer_dir: str) -> str:
    """A ~31M-parameter random Qwen3 with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(
        vocab_size=640, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize(
    ("model", "rows", "length", "ckpt"),
    [("tiny", 8, 512, "full"), ("qwen3_31m", 4, 256, "full"), ("qwen3_31m", 4, 256, "ckpt")],
)
@pytest.mark.heavy
def test_estimate_within_2x_of_measured_peak(model, rows, length, ckpt, tiny_model_path, tmp_path) -> None:
    """Peak RSS increase of one RL step (model load included) in a fresh process vs the plan without its runtime
    allowance (the baseline already holds Python + torch). Measured here (sampled RSS): tiny 252-264 MiB vs
    179 MiB estimated; 31M 1018-1024 MiB vs 1058 MiB; 31M with activation checkpointing 773-774 MiB vs 623 MiB."""
    path = tiny_model_path if model == "tiny" else _random_qwen3(tmp_path / "m", tiny_model_path)
    env = {**os.environ, "AGENTRL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, path, str(rows), str(length), ckpt],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = Config.model_validate(result["cfg"])
    plan = mp.trainer_plan(cfg, mp.load_dims(path), accelerator=False)
    estimate = plan.total - mp.RUNTIME_BYTES
    measured = result["increase"]
    print(f"{model} {ckpt}: measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB")
    assert 0.5 * measured <= estimate <= 2.0 * measured


def test_megatron_plan_splits_states_as_megatron_does() -> None:
    """Megatron TP2 x DP2 in bf16 (Qwen2.5-7B): a rank holds half the model in bf16, fp32 main grads of that half,
    and a quarter of the fp32 main params + moments (distributed optimizer): ~6P bytes, not FSDP2's 16P / 4 ranks; its
    unchunked fp32 vocab-parallel logits are counted."""
    dims = mp.load_dims("Qwen/Qwen2.5-7B")
    overrides = ["trainer.num_ranks=4", "trainer.precision=bf16", "trainer.micro_batch_tokens=8192"]
    fsdp = load_config(None, overrides)
    mega = load_config(None, [*overrides, "trainer.backend=megatron", "trainer.megatron.tensor_parallel=2"])
    P = dims.params

    def parts(c: Config) -> dict[str, float]:
        return {x.name: x.bytes for x in mp.trainer_plan(c, dims, True).components}

    m, f = parts(mega), parts(fsdp)
    assert m["weights"] == pytest.approx(2 * P / 2) and m["gradients"] == pytest.approx(4 * P / 2)
    assert m["optimizer"] == pytest.approx(12 * P / 2 / 2)
    assert "gathered params" not in m and f["weights"] == pytest.approx(4 * P / 4)
    states = m["weights"] + m["gradients"] + m["optimizer"]
    assert states == pytest.approx(6 * P) and states > 1.4 * (f["weights"] + f["gradients"] + f["optimizer"])
    T, V = 8192, dims.vocab
    assert m["logits"] == pytest.approx(T * (V // 2) * (2 * 2 + 16)) and m["logits"] > f["logits"]
    replicated = load_config(None, [*overrides, "trainer.backend=megatron", "trainer.megatron.tensor_parallel=2",
                                    "trainer.megatron.distributed_optimizer=false"])  # fmt: skip
    assert parts(replicated)["optimizer"] == pytest.approx(12 * P / 2)
    assert m["activations"] < f["activations"]  # heads and MLP width split over TP


def test_device_memory_reads_nvml_without_a_cuda_context(monkeypatch) -> None:
    """The driver plans before the trainer starts: it must not open a CUDA context (~0.5 GiB) on device 0, where
    trainer rank 0 then runs. A stand-in NVML module (no GPU here) answers, and torch.cuda is never asked."""
    import types

    import torch

    calls = []
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(f"index {i}") or "h",
        nvmlDeviceGetHandleByUUID=lambda u: calls.append(f"uuid {u}") or "h",
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=143 * GiB),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv(mp.DEVICE_MEMORY_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: pytest.fail("opened a CUDA context"))
    assert mp.device_memory("cuda") == (143 * GiB, "cuda:0 NVIDIA H200")
    assert calls == ["init", "index 3", "shutdown"]
