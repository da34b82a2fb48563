"""agentrl.envserve: registered text envs served over the OpenEnv protocol (`agentrl serve-envs`).

`protocol` holds the wire shapes (OpenEnv 0.10's WebSocket messages), `server` the FastAPI app of one worker,
`workers` the process pool behind one port (SO_REUSEPORT) with memory-based recycling. The client side, the
`agentrl/OpenEnv-v0` env, lives in `agentrl.envs.remote_openenv`.
"""
