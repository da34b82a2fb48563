"""The training run: its driver (`train`), the loop, the parts it drives, start-up checks, the warm start,
validation, the sample buffer and the run state a resume reads."""
