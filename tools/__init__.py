"""agentrl.tools (installed from the top-level tools/ folder)."""
