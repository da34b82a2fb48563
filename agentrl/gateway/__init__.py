"""The agent gateway: train agent programs written against the OpenAI API, token-exact, in the same pipeline.

- `server.Gateway`: the OpenAI-compatible chat-completions endpoint each env manager serves, one key per episode.
- `transcript.Transcript`: an episode's token-exact record (reused tokens, branches when the agent rewrites).
- `agents`: `async def agent(client, task)` programs run as episodes (`envs.<split>.<tag>.agent`).
- `commands`: agent programs in any language, run as jailed external commands (`agent: "cmd: ..."`).
- `demos`: the SFT warm start of an agent program (its own code, the env's expert answering for the model).
- `openai_api`: the wire format (request model, reply and error bodies).
"""
