"""`agentrl view RUN_DIR`: a run's curves, config and logged episodes in the browser (`agentrl.viewer.server`)."""
