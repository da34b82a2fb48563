"""Expert demonstrations from the envs, as training samples, for the SFT warm start of a (tiny) model."""

from __future__ import annotations

from typing import Any

from agentrl.config.schema import Config
from agentrl.envmanager.chat import ChatTokens
from agentrl.envs import make_env
from agentrl.types import Sample, group_id_for

DEMO_SEED_OFFSET = 2_000_000  # disjoint from training (0...) and validation (validation.seed_start...) seeds


def expert_samples(cfg: Config, tokenizer: Any, episodes: int) -> list[Sample]:
    """Play each train env's expert and turn its turns into samples shaped like RL samples (same prompts)."""
    chat = ChatTokens(tokenizer)
    eos = [tokenizer.eos_token_id]
    samples: list[Sample] = []
    tags = list(cfg.envs.train.items())
    for i in range(episodes):
        tag, spec = tags[i % len(tags)]
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
            answer = chat.encode(action) + eos
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
