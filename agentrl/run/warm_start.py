"""The warm start: SFT on expert demonstrations from the envs (as training samples), and its cache.

Env code runs here in the driver, outside the env managers' isolation, so a demo episode whose env raises or
hangs (each call is bounded by `envs.call_timeout_s`) is skipped and counted (like a failed RL episode), never the
end of the run. Episodes are independent and play concurrently (`envs.env_threads` at a time), so a slow env does
not serialise the warm start; the samples keep episode order, whatever order the episodes end in.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError
from agentrl.config.schema import Config, EnvConfig, TrainEnvConfig
from agentrl.envmanager.chat import ChatTokens
from agentrl.envmanager.episode import Messages, tool_contents
from agentrl.envmanager.manager import FirstOfKind, build_toolboxes
from agentrl.envs import make_env
from agentrl.envs.env_calls import acall_with_timeout
from agentrl.tools.parsers import parse_tool_calls
from agentrl.types import Sample, group_id_for

DEMO_SEED_OFFSET = 2_000_000  # disjoint from training (0...) and validation (validation.seed_start...) seeds
DEMO_FORMAT = 2  # part of the warm-start cache key: 2 runs tool calls (1 stepped the env with them)
NOISE_SEED = 7_919  # the random moves of trainer.sft.expert_noise: one stream per demo episode


class Demos(list[Sample]):
    """The demo samples; `failed_episodes` counts the demo episodes skipped because their env raised."""

    failed_episodes: int = 0


def expert_samples(cfg: Config, tokenizer: Any, episodes: int, tick: Callable[[], None] = lambda: None) -> Demos:
    """Play each train env's expert and turn its turns into samples shaped like RL samples (same prompts: tool
    schemas in the system prompt, tool calls run through the configured tools and their results read back).
    A failing episode is skipped (the first failure of each kind is logged); raises ConfigError when all fail.
    tick() is called after each episode (the console's progress). Runs its own event loop: call it off one."""
    return asyncio.run(_expert_samples(cfg, tokenizer, episodes, tick))


async def _expert_samples(cfg: Config, tokenizer: Any, episodes: int, tick: Callable[[], None]) -> Demos:
    boxes = build_toolboxes(cfg, splits=("train",))
    chats = {sets: ChatTokens(tokenizer, box.schemas()) for sets, box in boxes.items()}
    chats[()] = ChatTokens(tokenizer)
    parse = functools.partial(parse_tool_calls, parser=cfg.tools.parser)
    tags = list(cfg.envs.train.items())
    log_failure, errors = FirstOfKind("SFT warm start"), []
    at_once = asyncio.Semaphore(cfg.envs.env_threads)
    agents = None  # agent programs play their own demos through a gateway (agentrl.gateway.demos)
    if any(spec.agent for _, spec in tags):
        from agentrl.gateway.demos import AgentDemos

        agents = AgentDemos(cfg, tokenizer, boxes, NOISE_SEED)
        await agents.start()

    async def play(i: int) -> list[Sample] | None:
        tag, spec = tags[i % len(tags)]
        sets = tuple(spec.tools)
        demo = _Demo(cfg, chats[sets], boxes.get(sets), parse, tokenizer.eos_token_id)
        async with at_once:
            try:
                if agents is not None and spec.agent:
                    return await agents.play(tag, spec, DEMO_SEED_OFFSET + spec.seed_start + i, i)
                return await demo.play(tag, spec, i)
            except Exception as err:  # the env's (or a tool's) own bug, or a hang: skip this demo, keep the others
                error = f"{type(err).__name__}: {err}"
                errors.append(f"envs.train.{tag} ({spec.env_id}): {error}")
                log_failure(f"demo episode {i} of envs.train.{tag} ({spec.env_id})", error)
                return None
            finally:
                tick()

    try:
        played = await asyncio.gather(*(play(i) for i in range(episodes)))
    finally:
        if agents is not None:
            await agents.aclose()
        for box in boxes.values():
            await box.aclose()
    samples = Demos()
    for episode in played:
        if episode is None:
            samples.failed_episodes += 1
        else:
            samples += episode
    if episodes and samples.failed_episodes == episodes:
        raise ConfigError(f"trainer.sft: all {episodes} expert demo episodes failed; the first: {errors[0]}")
    return samples


@dataclass
class _Demo:
    """One expert episode played the way an env manager plays a policy's (see agentrl.envmanager.episode)."""

    cfg: Config
    chat: ChatTokens
    box: Any  # the env's Toolbox, or None
    parse: Callable[[str], list]
    eos_id: int

    async def play(self, tag: str, spec: TrainEnvConfig, i: int) -> list[Sample]:
        """The episode's turns as samples (all or nothing: a failing episode gives no samples)."""
        episode_id = group_id_for("demo", tag, i)
        env = await self._call(make_env, spec.env_id, what="building the env", **spec.kwargs)
        obs, _ = await self._call(env.reset, seed=DEMO_SEED_OFFSET + spec.seed_start + i, what="env.reset")
        system = await self._call(env.system_prompt, what="env.system_prompt")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": obs}]
        turn_starts, calls_left = [1], self.cfg.tools.max_calls_per_episode
        noise, rng = self.cfg.trainer.sft.expert_noise, random.Random(NOISE_SEED * (i + 1))
        samples: list[Sample] = []
        if self.box is not None:
            await self.box.open_session(episode_id)
        try:
            for turn in range(spec.max_turns or env.max_steps):
                action = await self._call(env.expert_action, what="env.expert_action")
                if action is None:
                    break
                if noise and self.box is None and rng.random() < noise:
                    action = await self._call(env.random_action, rng, what="env.random_action")  # a mistake to
                    # recover from: played, not trained on
                else:
                    samples.append(self._sample(self._prompt(messages, turn_starts, turn), action, episode_id))
                messages.append({"role": "assistant", "content": action})
                calls = self.parse(action) if self.box is not None else []
                if calls:
                    allowed = min(self.cfg.tools.max_calls_per_turn, max(calls_left, 0))
                    contents = await tool_contents(self.box, calls, allowed, episode_id)
                    calls_left -= min(len(calls), allowed)
                    if hasattr(env, "observe_tool_results"):
                        await self._call(env.observe_tool_results, contents, what="env.observe_tool_results")
                    pending = [{"role": "tool", "content": c} for c in contents]
                else:
                    obs, _, terminated, truncated, _ = await self._call(env.step, action, what="env.step")
                    if terminated or truncated:
                        break
                    pending = [{"role": "user", "content": obs}]
                turn_starts.append(len(messages))
                messages += pending
        finally:
            if self.box is not None:
                await self.box.close_session(episode_id)
        return samples

    async def _call(self, fn: Callable, *args: Any, what: str, **kwargs: Any) -> Any:
        """An env call within `envs.call_timeout_s` (EnvCallTimeout after it: the episode is skipped)."""
        return await acall_with_timeout(fn, *args, timeout_s=self.cfg.envs.call_timeout_s, what=what, **kwargs)

    def _prompt(self, messages: Messages, turn_starts: list[int], turn: int) -> list[int]:
        envs = self.cfg.envs
        if envs.sample_mode == "turn":
            start = turn_starts[max(0, turn - envs.turn_history_window)]
            return self.chat.prompt_ids(messages[:1] + messages[start:])
        return self.chat.prompt_ids(messages)

    def _sample(self, prompt: list[int], action: str, episode_id: str) -> Sample:
        answer = [*self.chat.encode(action), self.eos_id]
        n = len(prompt) + len(answer)
        return Sample(
            prompt + answer, [0] * len(prompt) + [1] * len(answer), [0.0] * n, [-1] * n,
            reward=0.0, group_id=episode_id, episode_id=episode_id,
        )  # fmt: skip


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
        # what shapes a demo (the env, its kwargs, turn limit, seeds, tools, agent); not how RL groups episodes
        "train_envs": {
            tag: spec.model_dump(include=set(EnvConfig.model_fields)) for tag, spec in cfg.envs.train.items()
        },
        "prompts": [cfg.envs.sample_mode, cfg.envs.turn_history_window, DEMO_FORMAT],
        "tools": cfg.tools.model_dump(),  # schemas in the prompt, results read back
        "agents": _agent_sources(cfg),  # an agent program plays its own demos: its code shapes them
        "trainer": cfg.trainer.model_dump(include={"backend", "num_ranks", "precision", "micro_batch_tokens"}),
        # trainer.lora's full warm start is full fine-tuning's; an adapters-only one is another
        "lora": cfg.trainer.lora.model_dump() if cfg.trainer.lora and cfg.trainer.lora.warm_start != "full" else None,
        # The warm start runs at trainer.sft.lr, constant: the RL lr and schedule do not change it.
        "optim": cfg.trainer.optim.model_dump(exclude={"lr", "schedule", "warmup_steps"}),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cfg.model.cache_dir).expanduser() / f"warmstart-{digest}"


def _agent_sources(cfg: Config) -> dict[str, str]:
    """A digest of each train env's agent program's module source (its prompts and tool format are the demos')."""
    import inspect

    from agentrl.gateway.agents import resolve_agent

    digests = {}
    for spec in cfg.envs.train.values():
        if spec.agent and spec.agent not in digests:
            source = inspect.getsource(inspect.getmodule(resolve_agent(spec.agent)))
            digests[spec.agent] = hashlib.sha256(source.encode()).hexdigest()[:16]
    return digests


def is_cached(path: Path | None) -> bool:
    return path is not None and (path / "model.safetensors").exists() and (path / "config.json").exists()


async def warm_start(cfg: Config, parts: Any, view: Any, run_dir: Path) -> dict[str, float]:
    """The warm start: SFT on expert demos (the engines load their weights beside it), its weights then saved at
    `trainer.sft.cache`; a cached one is reused and skips it. Returns the metrics logged at step 0. With
    trainer.lora's full warm start, the fine-tuned weights become the adapters' base (saved in the cache, else in
    RUN_DIR/warm-start)."""
    from transformers import AutoTokenizer

    if parts.model_path == str(parts.warm_cache):
        return {"sft/cached": 1.0, "sft/seconds": 0.0, "sft/samples": 0.0}
    sft = cfg.trainer.sft
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or parts.model_path)
    with view.phase("warm start: expert demos", sft.episodes, "episodes") as tick:
        demos = await asyncio.to_thread(expert_samples, cfg, tokenizer, sft.episodes, tick)
    t0, metrics = time.perf_counter(), {}
    with view.phase("warm start: SFT", sft.steps, "steps") as tick:
        for step in range(sft.steps):
            start = (step * sft.batch_size) % max(1, len(demos) - sft.batch_size)
            parts.loading.check(wait=False)  # engines load beside the warm start: a failure ends it at once
            metrics = await asyncio.to_thread(parts.trainer.sft_step, demos[start : start + sft.batch_size])
            tick()
    lora = cfg.trainer.lora
    if lora is not None and lora.warm_start == "full":
        base = parts.warm_cache or run_dir / "warm-start"
        if base != parts.warm_cache:
            shutil.rmtree(base, ignore_errors=True)  # an earlier run's in this run dir
        await asyncio.to_thread(_save_warm_start, parts.trainer.end_warm_start, base)
    elif parts.warm_cache is not None:
        await asyncio.to_thread(_save_warm_start, parts.trainer.save_warm_start, parts.warm_cache)
    return {
        **metrics,
        "sft/seconds": time.perf_counter() - t0,
        "sft/samples": len(demos),
        "sft/failed_episodes": float(demos.failed_episodes),
    }


def _save_warm_start(save: Callable[[str], bool], path: Path) -> None:
    """Trainer rank 0 writes the warm-started weights into a temporary folder and renames it into place on its own
    node (a concurrent run with the same key may have saved it first, and a reader never sees half a model). A
    driver on another node that does not see it says so: later runs reuse it only from a model.cache_dir every
    node shares."""
    save(str(path))
    if not is_cached(path):
        print(
            f"agentrl: trainer.sft.cache: the warm start was saved at {path} on trainer rank 0's node, which "
            "this driver does not see: set model.cache_dir to a folder every node shares to reuse it",
            file=sys.stderr,
            flush=True,
        )
