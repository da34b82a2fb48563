"""The Sokoban agent of `sokoban_openai_agent`, written with an agent framework: pydantic-ai (the `agents` extra).

Why pydantic-ai: it speaks chat completions natively (`OpenAIChatModel`, so the gateway records every call as a
turn), declares tools from typed signatures as agentrl's own tools do, and installs beside agentrl's pins (the
OpenAI Agents SDK defaults to the Responses API and caps websockets below the version vLLM pins).

The framework runs the tool loop itself: the model calls `move`, pydantic-ai runs it and sends the result back,
until the model answers in text or the episode ends. Used as `agentrl.examples.sokoban_pydantic_ai_agent:agent`.
"""

from __future__ import annotations

from typing import Literal

from agentrl.examples.sokoban_openai_agent import expert_reply, rules


class _EpisodeOver(Exception):
    """Raised by the tool when the env ends the episode: stops the framework's loop."""


async def agent(client, task) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(task.model, provider=OpenAIProvider(openai_client=client))
    sokoban = Agent(model, system_prompt=rules(task.system_prompt) + "\nAnswer DONE when the level is solved.")

    @sokoban.tool_plain
    async def move(direction: Literal["Up", "Down", "Left", "Right"]) -> str:
        """Move the player one cell (pushing a box in the way); returns the new grid."""
        step = await task.step(f"<answer>{direction}</answer>")
        if step.done:
            raise _EpisodeOver
        return step.observation

    try:
        await sokoban.run(task.prompt)
    except _EpisodeOver:
        pass
    except UnexpectedModelBehavior:  # the model kept calling the tool wrongly: the episode ends as it stands
        pass
    return None  # the reward is the env's return


agent.expert_reply = expert_reply
