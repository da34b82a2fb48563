"""A Sokoban agent written with the plain `openai` SDK, as a user would write one for any OpenAI-compatible server.

Its env is a `move` function tool: each turn the model sees the rules and the current grid and calls `move`; the
agent steps the env with the direction and keeps only the latest grid (a Markov agent, like the native example's
turn-wise prompts). agentrl trains it unchanged through the gateway (`examples/agent_sokoban_openai.yaml`):

    envs.train.sokoban.agent: agentrl.examples.sokoban_openai_agent:agent

`expert_reply` turns the env's expert move into the reply this agent expects from its model, so the SFT warm start
plays this agent's own code with the expert answering in the model's place (same prompts, same tool format).
"""

from __future__ import annotations

import json
import re

MOVE = {  # short: its schema is in every prompt
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {"type": "object", "properties": {"direction": {"enum": ["Up", "Down", "Left", "Right"]}}},
    },
}


def rules(system_prompt: str) -> str:
    """The env's goal and legend, with this agent's way to act instead of the env's answer format."""
    goal_and_legend = "\n".join(system_prompt.splitlines()[:2])
    return f"{goal_and_legend}\nMake one move per turn with the move tool."


async def agent(client, task) -> None:
    system = {"role": "system", "content": rules(task.system_prompt)}
    observation = task.prompt
    while True:
        reply = await client.chat.completions.create(
            model=task.model, messages=[system, {"role": "user", "content": observation}], tools=[MOVE]
        )
        message = reply.choices[0].message
        if message.tool_calls:
            direction = json.loads(message.tool_calls[0].function.arguments).get("direction", "")
            action = f"<answer>{direction}</answer>"
        else:
            action = message.content or ""  # no call: the env counts an invalid move
        step = await task.step(action)
        if step.done:
            return None  # the reward is the env's return
        observation = step.observation


def expert_reply(action: str) -> str:
    """The env expert's `<answer>Up</answer>` as this agent's model should say it: a `move` call."""
    found = re.search(r"<answer>(.*?)</answer>", action)
    direction = found.group(1).strip() if found else action.strip()
    return f'<tool_call>{{"name": "move", "arguments": {{"direction": "{direction}"}}}}</tool_call>'


agent.expert_reply = expert_reply
