"""agentrl.envs (installed from the top-level envs/ folder)."""
