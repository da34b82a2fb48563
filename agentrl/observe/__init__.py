"""What a run shows: metrics and their sinks (JSONL, TensorBoard, trackers, the plot), the console view, and the
metrics computed from a step's batch (`step_metrics`). The run's logged episodes are `agentrl.run.episode_log`;
the browser view of a run dir is `agentrl.viewer`."""
