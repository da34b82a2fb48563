"""Record a real RL batch of each shipped example for the trainer's exactness tests (tests/data/batches/).

    python scripts/record_example_batches.py [--step 3] [--groups 4] [NAME ...]

Each example runs as its header says (math_tools with its calculator in-process instead of behind a tool server:
the same tool, the same samples; sokoban_remote_env against an `agentrl serve-envs` this script starts), warm
start and `--step` RL steps with `logging.save_batches=true`; the batch of step `--step` is cut to its first
`--groups` groups (the tests' time) and written to tests/data/batches/NAME.jsonl.gz. The warm starts are cached
(`trainer.sft.cache`): a second recording of an example skips its SFT.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.run.batch_files import batch_path, load_batch, save_batch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "batches"
EXAMPLES = {
    "agentic_sokoban": [],  # turn-wise, one turn per sample
    "sokoban_sync": [],  # trajectory-wise multi-turn Sokoban
    "math_tools": ['tools.sets.calculator.calculator={python: "agentrl.tools.calculator:calculator"}'],
    "sokoban_remote_env": [],  # turn-wise, the env behind an OpenEnv server
}
ENV_SERVER = ["serve-envs", "agentrl/SimpleSokoban-v0", "--port", "8810", "--workers", "2",
              "--env-kwargs", 'agentrl/SimpleSokoban-v0={"mark_revisits": true}']  # fmt: skip


def record(name: str, step: int, groups: int, work: Path) -> Path:
    run_dir = work / name
    args = [sys.executable, "-m", "agentrl", "train", str(ROOT / "examples" / f"{name}.yaml"), *EXAMPLES[name],
            f"trainer.total_steps={step}", "validation.every_steps=0", "checkpoint.every_steps=0",
            "trainer.sft.cache=true", "logging.save_batches=true", "logging.tensorboard=false",
            f"logging.run_dir={run_dir}"]  # fmt: skip
    server = None
    if name == "sokoban_remote_env":
        server = subprocess.Popen([sys.executable, "-m", "agentrl", *ENV_SERVER], stdout=subprocess.DEVNULL)
        time.sleep(5)
    try:
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    samples = load_batch(batch_path(run_dir / "batches", step))
    keep = list(dict.fromkeys(s.group_id for s in samples))[:groups]
    return save_batch(OUT / f"{name}.jsonl.gz", [s for s in samples if s.group_id in keep])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(EXAMPLES))
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for name in args.names:
            path = record(name, args.step, args.groups, Path(work))
            samples = load_batch(path)
            print(f"{path.relative_to(ROOT)}: {len(samples)} samples, {sum(len(s.token_ids) for s in samples)} tokens")


if __name__ == "__main__":
    main()
