"""Build the project's own tiny model: a byte-level BPE tokenizer trained on env/tool text and a Qwen3 model.

No hub downloads are possible on our machines, so agentrl makes its own model. `builtin:tiny` resolves to a
cache directory built on first use (under a file lock, so concurrent actors build it once). The build is
deterministic for a seed: same tokenizer, same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

BUILDER_VERSION = 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Ordinary added tokens: one id each, kept by decode(skip_special_tokens=True).
TAG_TOKENS = [
    "<answer>", "</answer>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip
# Grid cells stay single tokens: a cell symbol is its own pre-token unless it is part of a lowercase word.
GRID_CELL_PATTERN = r"[#_√.@*]|(?<![a-z])[OXPSGFHT](?![a-z])"


@dataclass(frozen=True)
class TinySpec:
    layers: int = 2
    hidden: int = 128
    intermediate: int = 384
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0


def _base_corpus(rng: random.Random) -> list[str]:
    """Generic text the envs and tools produce: grids, actions, tags, tool calls, numbers."""
    texts: list[str] = []
    cells = "#_OX√PS"
    for _ in range(400):
        h, w = rng.randint(4, 10), rng.randint(4, 10)
        rows = ["#" * w] + ["#" + "".join(rng.choice(cells) for _ in range(w - 2)) + "#" for _ in range(h - 2)]
        texts.append("\n".join([*rows, "#" * w]))
    actions = ["Up", "Down", "Left", "Right", "up", "down", "left", "right", "higher", "lower"]
    for _ in range(400):
        texts.append(f"<answer>{rng.choice(actions)}</answer>")
        texts.append(f"<answer>{rng.randint(0, 1000)}</answer>")
    for _ in range(300):
        a, b = rng.randint(0, 9999), rng.randint(1, 999)
        op = rng.choice("+-*/")
        texts.append(
            f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"}}}}\n</tool_call>'
        )
        texts.append(f'<tool_response>\n{{"result": {a + b}}}\n</tool_response>')
        texts.append(f"What is {a} {op} {b}? The answer is \\boxed{{{a + b}}}.")
    # The chat template's role headers: merged, they cost 3 tokens instead of 15 in every turn-wise prompt.
    texts += ["system\n", "user\n", "assistant\n", "tool\n"] * 200
    return texts


def _env_corpus(seed: int) -> list[str]:
    """Text the registered agentrl envs produce (prompts, observations, answers), when envs provide it."""
    try:
        import gymnasium as gym

        import agentrl.envs  # noqa: F401  (registers the built-in envs)
    except Exception:
        return []
    texts: list[str] = []
    for env_id in sorted(gym.registry):
        if not env_id.startswith("agentrl/"):
            continue
        try:
            env = gym.make(env_id).unwrapped
            provider = getattr(env, "tokenizer_corpus", None)
            if provider is not None:
                texts.extend(provider(num_episodes=20, seed=seed))
        except Exception:
            continue
    return texts


def build_corpus(seed: int = 0) -> list[str]:
    return _base_corpus(random.Random(seed)) + _env_corpus(seed)


def train_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE with pre-split grid cells and digits, wrapped with a ChatML chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GRID_CELL_PATTERN), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TAG_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    template = (Path(__file__).parent / "chat_template.jinja").read_text()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=template,
        model_max_length=4096,
    )


def build_tiny_model(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write tokenizer + Qwen3 config + float32 weights to out_dir (save_pretrained format)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(build_corpus(spec.seed), spec.vocab)
    vocab = ((len(tokenizer) + 63) // 64) * 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "agentrl_tiny.json").write_text(json.dumps({"builder_version": BUILDER_VERSION, **asdict(spec)}))
    return out


_KEYS: dict[tuple, str] = {}


def _registered_env_ids() -> tuple[str, ...]:
    try:
        import gymnasium as gym

        import agentrl.envs  # noqa: F401  (registers the built-in envs)
    except Exception:
        return ()
    return tuple(sorted(e for e in gym.registry if e.startswith("agentrl/")))


def _cache_key(spec: TinySpec) -> str:
    """Hash of the builder, the spec and the corpus text; memoised per registered-env set, because rendering
    the corpus instantiates every env (seconds) and the trainer, engines and CLI all resolve the path."""
    memo = (asdict(spec).__repr__(), _registered_env_ids())
    if memo not in _KEYS:
        corpus = build_corpus(spec.seed)
        _KEYS[memo] = hashlib.sha256(json.dumps([BUILDER_VERSION, asdict(spec), corpus]).encode()).hexdigest()[:12]
    return _KEYS[memo]


def resolve_model_path(path: str, cache_dir: str = "~/.cache/agentrl/models", revision: str | None = None) -> str:
    """A local folder on this node for `model.path`: an existing path is returned as is; `builtin:tiny` -> a built
    model dir (built once, under a lock); a hub id `org/name` (or `org/name@revision`, as `model_ref` hands it to
    actors) -> its snapshot at `revision` in this node's HF cache (see agentrl.models.hub); else a ConfigError."""
    from agentrl.models import hub

    if Path(path).expanduser().exists():
        return path
    if hub.is_hub_id(path):
        return hub.snapshot_path(path, revision)
    if not path.startswith("builtin:"):
        from agentrl.config.errors import ConfigError

        raise ConfigError(f"model.path {path} is neither a local folder nor a hub id (org/name)")
    name = path.split(":", 1)[1]
    if name != "tiny":
        raise ValueError(f"unknown builtin model {name!r} (known: tiny)")
    from filelock import FileLock

    spec = TinySpec()
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"tiny-{_cache_key(spec)}"
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
            try:
                build_tiny_model(tmp, spec)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
