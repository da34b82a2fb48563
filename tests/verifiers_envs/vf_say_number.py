"""A verifiers environment of the classic stack, as a verifiers user writes one (`load_environment`), for the
suite: the model is asked for a number, answers, is asked once more (a second turn), and the rubric scores whether
its last reply holds the number. Runs in verifiers' own virtualenv (agentrl.envs.verifiers_env)."""

import verifiers as vf
from datasets import Dataset


def _text(message) -> str:
    return str(message.get("content") if isinstance(message, dict) else getattr(message, "content", "")) or ""


class AskTwice(vf.MultiTurnEnv):
    def __init__(self, fail: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.fail = fail

    async def env_response(self, messages, state, **kwargs):
        if self.fail:
            raise RuntimeError("the env's own bug")
        return [{"role": "user", "content": "Say it once more."}]


def says_the_number(completion, answer, **kwargs) -> float:
    replies = [_text(m) for m in completion if (m.get("role") if isinstance(m, dict) else m.role) == "assistant"]
    return float(bool(replies) and answer in replies[-1])


def reply_count(completion, **kwargs) -> float:
    return float(sum((m.get("role") if isinstance(m, dict) else m.role) == "assistant" for m in completion))


def load_environment(turns: int = 2, examples: int = 8, fail: bool = False) -> vf.Environment:
    rows = [{"question": f"Say the number {i}.", "answer": str(i)} for i in range(examples)]
    rubric = vf.Rubric(funcs=[says_the_number, reply_count], weights=[1.0, 0.0])
    return AskTwice(
        fail=fail,
        dataset=Dataset.from_list(rows),
        system_prompt="Answer with the number only.",
        rubric=rubric,
        max_turns=turns,
    )
