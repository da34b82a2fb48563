"""Agent programs for the gateway tests, written as a user would: the plain `openai` SDK against the gateway."""

from __future__ import annotations

import asyncio
import json

from agentrl.gateway.agents import register_agent

MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move the player one cell.",
        "parameters": {
            "type": "object",
            "properties": {"direction": {"type": "string", "enum": ["Up", "Down", "Left", "Right"]}},
            "required": ["direction"],
        },
    },
}


async def sokoban(client, task) -> None:
    """Plays Sokoban: a `move` tool call steps the env, plain text is stepped as the env's own action format."""
    messages = [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": task.prompt}]
    for _ in range(20):
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=[MOVE])
        message = reply.choices[0].message
        messages.append(message)
        if message.tool_calls:
            for call in message.tool_calls:
                direction = json.loads(call.function.arguments).get("direction", "")
                step = await task.step(f"<answer>{direction}</answer>")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": step.observation})
                if step.done:
                    return None
        else:
            step = await task.step(message.content or "")
            if step.done:
                return None
            messages.append({"role": "user", "content": step.observation})
    return None


@register_agent("tests/crashing")
async def crashing(client, task) -> float:
    await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.prompt}])
    raise RuntimeError("the agent's own bug")


async def hanging(client, task) -> float:
    await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.prompt}])
    await asyncio.sleep(3600)
    return 1.0


async def scored(client, task) -> dict:
    """One call; its reward and a metric come back in a dict."""
    reply = await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.prompt}])
    return {"reward": float(len(reply.choices[0].message.content or "") % 3), "said_something": 1.0}


async def silent(client, task) -> float:
    return 1.0


def not_async(client, task) -> float:
    return 1.0


async def plain(client, task) -> None:
    """Answers in the env's own action format: the model's text is the action."""
    observation = task.prompt
    while True:
        messages = [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": observation}]
        reply = await client.chat.completions.create(model=task.model, messages=messages)
        step = await task.step(reply.choices[0].message.content or "")
        if step.done:
            return None
        observation = step.observation


plain.expert_reply = lambda action: action


def count_task(seed: int) -> dict:
    """A generated task source: `generator: tests.agents_fixtures:count_task`."""
    return {"prompt": f"What is {seed} + {seed}?", "answer": 2 * seed, "seed": seed}
