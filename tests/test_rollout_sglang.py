"""SGLangEngine against a fake `sglang` module injected via sys.modules (SGLang itself needs CUDA).

These tests check our side only: the request we build for Engine.async_generate, the mapping of its result, abort,
and the gate + drain around update_weights_from_disk. A real SGLang run belongs on an accelerator.
"""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from agentrl.config.schema import RolloutConfig, SamplingConfig
from agentrl.rollout.base import EngineError
from agentrl.rollout.sglang_engine import SGLangEngine
from agentrl.rollout.sglang_protocol import parse_sglang_output, sglang_request


@dataclass
class FakeUpdateReq:
    model_path: str
    load_format: str | None = None


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.loaded: list[str] = []
        self.model_config = types.SimpleNamespace(dtype=torch.bfloat16)  # SGLang's ModelConfig resolves "auto"

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.engine.aborted.add(rid)

    async def update_weights_from_disk(self, obj: FakeUpdateReq, request: object) -> tuple[bool, str, int]:
        self.loaded.append(obj.model_path)
        return (not obj.model_path.endswith("bad"), "fake message", 0)


class FakeEngine:
    """Generates token i+100 at step i with log-prob -0.1*(i+1), one step per 5 ms, until done or aborted."""

    instances: ClassVar[list[FakeEngine]] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[dict] = []
        self.aborted: set[str] = set()
        self.tokenizer_manager = FakeTokenizerManager(self)
        FakeEngine.instances.append(self)

    async def async_generate(self, **kw) -> dict:
        self.calls.append(kw)
        out: list[int] = []
        reason: dict = {"type": "length", "length": kw["sampling_params"]["max_new_tokens"]}
        for i in range(kw["sampling_params"]["max_new_tokens"]):
            if kw["rid"] in self.aborted:
                reason = {"type": "abort", "message": "Abort in waiting queue"}
                break
            await asyncio.sleep(0.005)
            out.append(100 + i)
        pairs = [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)]
        meta = {"id": kw["rid"], "finish_reason": reason, "output_token_logprobs": pairs}
        return {"output_ids": out, "meta_info": meta}

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_sglang(monkeypatch):
    root = types.ModuleType("sglang")
    root.Engine = FakeEngine
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.UpdateWeightFromDiskReqInput = FakeUpdateReq
    for name, mod in {
        "sglang": root,
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.managers": types.ModuleType("sglang.srt.managers"),
        "sglang.srt.managers.io_struct": io_struct,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    # The start-up API guard reads SGLang's real module layout and version; it has its own tests with fakes of
    # that layout (test_api_guard.py), so here it is passed.
    from agentrl.rollout import api_guard

    monkeypatch.setattr(api_guard, "check_sglang", lambda: {"sglang": "fake"})
    FakeEngine.instances.clear()
    return FakeEngine


def test_sglang_request_and_output_mapping():
    """Pure mapping, no sglang module at all: SGLang's sampling names, EOS merged unless ignore_eos."""
    s = SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, max_tokens=5, stop_token_ids=[7], seed=3)
    req = sglang_request([1, 2], s, "r1", eos=[2])
    assert req["input_ids"] == [1, 2] and req["rid"] == "r1" and req["return_logprob"] is True
    sp = req["sampling_params"]
    assert sp["max_new_tokens"] == 5 and sp["top_k"] == -1 and sp["sampling_seed"] == 3
    assert sp["stop_token_ids"] == [2, 7] and sp["no_stop_trim"] is True
    ignore = sglang_request([1], SamplingConfig(ignore_eos=True, stop_token_ids=[7]), "r2", eos=[2])
    assert ignore["sampling_params"]["stop_token_ids"] == [7] and "sampling_seed" not in ignore["sampling_params"]
    ids, lps, reason = parse_sglang_output(
        {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [
            [-0.5, 5, None], [-1.5, 6, None]]}}
    )  # fmt: skip
    assert (ids, lps, reason) == ([5, 6], [-0.5, -1.5], "stop")
    with pytest.raises(EngineError):
        parse_sglang_output({"output_ids": [9], "meta_info": {"output_token_logprobs": [[-0.5, 5, None]]}})


async def test_generate_with_fake_sglang(fake_sglang, tiny_model_path):
    engine = SGLangEngine(tiny_model_path, RolloutConfig(max_model_len=512, engine_kwargs={"tp_size": 1}), seed=4)
    out = await engine.generate([1, 2, 3], SamplingConfig(max_tokens=4, temperature=1.0), "g1")
    fake = fake_sglang.instances[0]
    assert fake.kwargs["model_path"] == tiny_model_path and fake.kwargs["skip_tokenizer_init"] is True
    assert fake.kwargs["context_length"] == 512 and fake.kwargs["random_seed"] == 4 and fake.kwargs["tp_size"] == 1
    assert fake.calls[0]["input_ids"] == [1, 2, 3] and fake.calls[0]["return_logprob"] is True
    assert out.token_ids == [100, 101, 102, 103] and out.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert out.finish_reason == "length" and out.version == 0 and out.versions == [0] * 4
    assert (await engine.stats())["tokens_generated"] == 4


async def test_abort_and_update_weights_with_fake_sglang(fake_sglang, tiny_model_path):
    engine = SGLangEngine(tiny_model_path)
    long = SamplingConfig(max_tokens=10_000, ignore_eos=True)
    task = asyncio.ensure_future(engine.generate([1], long, "a1"))
    await asyncio.sleep(0.05)
    await engine.abort("a1")
    out = await asyncio.wait_for(task, 5)
    assert out.finish_reason == "abort" and not out.preempted and 0 < len(out.token_ids) < 10_000

    task = asyncio.ensure_future(engine.generate([1], long, "a2"))
    await asyncio.sleep(0.05)
    seconds = await engine.update_weights("/snap/v1", 1)
    pre = await asyncio.wait_for(task, 5)
    assert pre.finish_reason == "abort" and pre.preempted and pre.version == 0 and seconds >= 0
    assert fake_sglang.instances[0].tokenizer_manager.loaded == ["/snap/v1"]
    after = await engine.generate([1], SamplingConfig(max_tokens=2), "a3")
    assert after.version == 1 and (await engine.health())["version"] == 1

    with pytest.raises(EngineError, match="fake message"):
        await engine.update_weights("/snap/bad", 2)
    assert (await engine.stats())["version"] == 1, "a failed load must not bump the version"
    assert (await engine.health())["paused"] is False, "the gate reopens after a failed load"


async def test_sglang_reports_its_dtype_so_disk_snapshots_are_not_fp32(fake_sglang, tiny_model_path):
    """Without a dtype the disk sync wrote float32 snapshots: 30 GB a sync at 7B, where bf16 is 15 GB."""
    info = await SGLangEngine(tiny_model_path).weight_sync_info()
    assert info == {"collective": False, "dtype": "bfloat16", "workers": 1}
