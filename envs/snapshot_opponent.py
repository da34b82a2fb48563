"""A frozen policy snapshot as a fixed opponent: `opponent: snapshot:PATH` in a TextArena game's kwargs.

PATH is a model folder in Hugging Face format: the run's warm start (`RUN_DIR/warm-start`, or its `trainer.sft.cache`
entry), or a checkpoint exported with `agentrl export CKPT OUT --merged`. The snapshot plays its seat greedily on
CPU inside the env, with the same prompt the policy gets (the env's system prompt, then the game's text for that
seat), so training against it is play against an earlier self that does not move. One copy per process and path,
shared by the envs of that process. For large models this costs the env manager a forward pass per opponent turn:
it is meant for the small policies a CPU run trains; on a GPU cluster, serve the snapshot and name a module:function
opponent that calls it.
"""

from __future__ import annotations

import functools
import random
import threading
from pathlib import Path
from typing import Any

PREFIX = "snapshot:"
_LOCK = threading.Lock()


@functools.cache
def _load(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(path) / "config.json").exists():
        raise ValueError(f"opponent snapshot {path!r} is not a model folder (no config.json): name a warm start or "
                         "a checkpoint exported with `agentrl export CKPT OUT --merged`")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    return tokenizer, model


class SnapshotOpponent:
    """Plays `(observation, rng) -> move` with a frozen model: greedy, at most `max_new_tokens` tokens."""

    def __init__(self, path: str, system_prompt: str, max_new_tokens: int = 16) -> None:
        with _LOCK:  # envs of one process build their opponents on several threads
            self.tokenizer, self.model = _load(str(Path(path).expanduser()))
        self.system_prompt, self.max_new_tokens = system_prompt, max_new_tokens

    def __call__(self, observation: str, rng: random.Random) -> str:
        import torch

        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": observation}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with _LOCK, torch.no_grad():  # one model shared by the process's env threads
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.pad_token_id)  # fmt: skip
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
