"""A policy-gradient loop that learns through grctl: rollouts from a real `grctl serve`, the
update here on transformers' Qwen3, and each step's weights pushed back from memory.

    python examples/rl_loop.py                    # starts its own server (= grctl demo --rl)

    python examples/rl_loop.py --write-catalog rl_catalog.jsonl
    grctl serve --allow-weight-update --catalog rl_catalog.jsonl \\
        --port 30000 &
    python examples/rl_loop.py --url http://127.0.0.1:30000

The pieces, to read or copy (docs/rl-integration.md, "A loop that learns"):
grctl/cli/rl/task.py (the catalog, the users' hidden favourites, the reward),
grctl/cli/rl/trainer.py (the catalog replay of the behaviour logprobs, the unordered set
estimator, the KL to a frozen reference, the clipped ratios) and grctl/cli/rl/loop.py
(rollout, exact evaluation, train, WeightSync.run(state_dict, weight_version="step-k")).
"""

from __future__ import annotations

import os

# idle OpenMP threads sleep instead of spinning on the cores the server needs: read once, when
# the OpenMP runtime starts, so before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402

from grctl.cli.demo import run_rl_demo  # noqa: E402
from grctl.cli.rl.loop import check, report, run_loop, write_curve  # noqa: E402
from grctl.cli.rl.task import make_task  # noqa: E402
from grctl.cli.rl.trainer import DEFAULT_LR, ESTIMATORS, Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started here)")
    ap.add_argument("--write-catalog", type=Path, help="write the task's catalog and exit")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group", type=int, default=8, help="beams per user and step")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--estimator", choices=ESTIMATORS, default=ESTIMATORS[0])
    ap.add_argument("--threads", type=int, default=1, help="the trainer's torch threads")
    ap.add_argument("--plot", type=Path, default=Path("rl_reward.png"))
    args = ap.parse_args()
    console = Console()
    task = make_task()
    if args.write_catalog:
        task.write_catalog(args.write_catalog)
        return
    if args.url is None and args.estimator == ESTIMATORS[0] and args.threads == 1:
        run_rl_demo(console, steps=args.steps, group=args.group, lr=args.lr, plot=args.plot)
        return
    if args.url is None:
        ap.error("--estimator and --threads need --url (a server started by hand)")
    trainer = Trainer(task, lr=args.lr, estimator=args.estimator, threads=args.threads)
    rows = run_loop(
        args.url, task, steps=args.steps, group=args.group, trainer=trainer, console=console
    )
    check(rows)
    report(console, rows)
    write_curve(rows, args.plot)


if __name__ == "__main__":
    main()
