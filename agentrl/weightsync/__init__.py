"""How a new policy's weights travel from trainer rank 0 to the engine workers over a collective group (gloo on
CPU, NCCL on CUDA, HCCL on Ascend), without Ray or vLLM (the GPU smoke imports it on a node that has neither).

- `buckets`: the flat-bucket format both ends share, and the weight-sync group itself.
- `send`: the sender, walked by every trainer rank (the gathers) while rank 0 broadcasts.
- `receive`: the receiver, run by each engine worker.
- `delta`: per bucket, only what changed since the last sync (rollout.weight_sync_delta).

Who calls them: `agentrl.trainer.weight_publish` (the trainer rank's side), `agentrl.rollout.vllm_worker` (vLLM's
worker extension, which loads what arrives) and `agentrl.run.weights` (the driver, which forms the group and
drains the engines around a sync).
"""
