"""Expert demonstrations from the envs, as training samples, for the SFT warm start of a (tiny) model.

Env code runs here in the driver, outside the env managers' isolation, so a demo episode whose env raises is
skipped and counted (like a failed RL episode), never the end of the run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError
from agentrl.config.schema import Config, TrainEnvConfig
from agentrl.envmanager.chat import ChatTokens
from agentrl.envmanager.manager import FirstOfKind
from agentrl.envs import make_env
from agentrl.types import Sample, group_id_for

DEMO_SEED_OFFSET = 2_000_000  # disjoint from training (0...) and validation (validation.seed_start...) seeds


class Demos(list[Sample]):
    """The demo samples; `failed_episodes` counts the demo episodes skipped because their env raised."""

    failed_episodes: int = 0


def expert_samples(cfg: Config, tokenizer: Any, episodes: int, tick: Callable[[], None] = lambda: None) -> Demos:
    """Play each train env's expert and turn its turns into samples shaped like RL samples (same prompts).
    A failing episode is skipped (the first failure of each kind is logged); raises ConfigError when all fail.
    tick() is called after each episode (the console's progress)."""
    chat = ChatTokens(tokenizer)
    samples = Demos()
    tags = list(cfg.envs.train.items())
    log_failure, first_error = FirstOfKind("SFT warm start"), ""
    for i in range(episodes):
        tag, spec = tags[i % len(tags)]
        try:
            samples += _demo_episode(cfg, chat, tokenizer.eos_token_id, tag, spec, i)
        except Exception as err:  # the env's own bug: skip this demo, keep the others
            samples.failed_episodes += 1
            error = f"{type(err).__name__}: {err}"
            first_error = first_error or f"envs.train.{tag} ({spec.env_id}): {error}"
            log_failure(f"demo episode {i} of envs.train.{tag} ({spec.env_id})", error)
        tick()
    if episodes and samples.failed_episodes == episodes:
        raise ConfigError(f"trainer.sft: all {episodes} expert demo episodes failed; the first: {first_error}")
    return samples


def _demo_episode(cfg: Config, chat: ChatTokens, eos_id: int, tag: str, spec: TrainEnvConfig, i: int) -> list[Sample]:
    """One expert episode's turns as samples (all or nothing: a failing episode gives no samples)."""
    samples: list[Sample] = []
    env = make_env(spec.env_id, **spec.kwargs)
    obs, _ = env.reset(seed=DEMO_SEED_OFFSET + spec.seed_start + i)
    messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
    for _ in range(spec.max_turns or env.max_steps):
        action = env.expert_action()
        if action is None:
            break
        if cfg.envs.sample_mode == "step":
            window = messages[:1] + messages[max(1, len(messages) - 1 - 2 * cfg.envs.step_history_window) :]
            prompt = chat.prompt_ids(window)
        else:
            prompt = chat.prompt_ids(messages)
        answer = [*chat.encode(action), eos_id]
        samples.append(
            Sample(
                prompt + answer,
                [0] * len(prompt) + [1] * len(answer),
                [0.0] * (len(prompt) + len(answer)),
                [-1] * (len(prompt) + len(answer)),
                reward=0.0,
                group_id=group_id_for("demo", tag, i),
                episode_id=group_id_for("demo", tag, i),
            )
        )
        obs, _, terminated, truncated, _ = env.step(action)
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
        if terminated or truncated:
            break
    return samples


def warm_start_cache(cfg: Config, model_path: str) -> Path | None:
    """Where `trainer.sft.cache` keeps the warm-started weights (an HF model dir) for this model, train envs, prompt
    form and SFT settings; None when the run does no cached warm start. The key leaves out the seed, so runs that
    differ only in their RL seed start from one warm start (what a comparison over seeds wants)."""
    sft = cfg.trainer.sft
    if not (sft.enabled and sft.cache and sft.steps > 0):
        return None
    from agentrl import __version__

    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_path).glob("*.safetensors")
    )  # a local model edited in place is a new key
    key = {
        "agentrl": __version__,
        "model": [str(Path(model_path).resolve()), cfg.model.revision, cfg.model.tokenizer, weights],
        "sft": sft.model_dump(exclude={"cache"}),
        "train_envs": {tag: spec.model_dump() for tag, spec in cfg.envs.train.items()},
        "prompts": [cfg.envs.sample_mode, cfg.envs.step_history_window],
        "trainer": cfg.trainer.model_dump(include={"backend", "num_ranks", "precision", "micro_batch_tokens"}),
        # The warm start runs at trainer.sft.lr, constant: the RL lr and schedule do not change it.
        "optim": cfg.trainer.optim.model_dump(exclude={"lr", "schedule", "warmup_steps"}),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.model.cache_dir).expanduser() / f"warmstart-{digest}"


def is_cached(path: Path | None) -> bool:
    return path is not None and (path / "model.safetensors").exists() and (path / "config.json").exists()
