"""A policy-gradient loop that learns through grctl: rollouts from a real `grctl serve`, the
update here on transformers' Qwen3, and each step's weights pushed back from memory.

    python examples/rl_loop.py                    # starts its own server (= grctl demo --rl)

    python examples/rl_loop.py --write-catalog rl_catalog.jsonl
    grctl serve --allow-weight-update --catalog rl_catalog.jsonl --port 30000 &
    python examples/rl_loop.py --url http://127.0.0.1:30000

The pieces, to read or copy (docs/rl-integration.md, "A loop that learns"):
grctl/cli/rl/task.py (the catalog, the users' hidden favourites, the reward),
grctl/cli/rl/trainer.py (the logprob recompute and the GRPO-style step) and
grctl/cli/rl/loop.py (rollout, train, WeightSync.run(state_dict, weight_version="step-k")).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from grctl.cli.demo import run_rl_demo
from grctl.cli.rl.loop import check, run_loop, summary, write_curve
from grctl.cli.rl.task import make_task
from grctl.cli.rl.trainer import DEFAULT_LR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started here)")
    ap.add_argument("--write-catalog", type=Path, help="write the task's catalog and exit")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group", type=int, default=8, help="samples per user and step")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--plot", type=Path, default=Path("rl_reward.png"))
    args = ap.parse_args()
    console = Console()
    if args.write_catalog:
        make_task().write_catalog(args.write_catalog)
        return
    if args.url is None:
        run_rl_demo(console, steps=args.steps, group=args.group, lr=args.lr, plot=args.plot)
        return
    rows = run_loop(
        args.url, make_task(), steps=args.steps, group=args.group, lr=args.lr, console=console
    )
    check(rows)
    console.print(summary(rows))
    write_curve(rows, args.plot)


if __name__ == "__main__":
    main()
