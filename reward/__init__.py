"""agentrl.reward (installed from the top-level reward/ folder)."""
