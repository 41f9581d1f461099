"""A policy that reasons, then recommends, learning through grctl: multi-stage rollouts from a
real `grctl serve`, the two-stage estimator's update here on transformers' Qwen3, and each
step's weights pushed back from memory.

    python examples/two_stage_rl_loop.py               # starts its own server (= grctl demo
                                                       # --rl --two-stage)

    python examples/two_stage_rl_loop.py --write-model toy --write-catalog toy.jsonl
    grctl serve --allow-weight-update --model-path toy --catalog toy.jsonl --port 30000 &
    python examples/two_stage_rl_loop.py --url http://127.0.0.1:30000 [--json]

The pieces, to read or copy (docs/rl-integration.md, "A loop that learns through two
stages"): grctl/cli/rl/two_stage_task.py (the toy model, catalog and reward, the exact
enumeration) and grctl/cli/rl/two_stage_loop.py (the multi-stage rollout, the replay of both
stages, grctl.rl.two_stage's estimate, WeightSync.run(state_dict, weight_version="step-k")).
"""

from __future__ import annotations

import os

# idle OpenMP threads sleep instead of spinning on the cores the server needs: read once, when
# the OpenMP runtime starts, so before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402

from grctl.cli.demo import run_two_stage_demo  # noqa: E402
from grctl.cli.rl.two_stage_loop import (  # noqa: E402
    DEFAULT_LR,
    TwoStageTrainer,
    check,
    report,
    run_two_stage_loop,
)
from grctl.cli.rl.two_stage_task import TwoStageTask, toy_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server on the toy's model (else one is started)")
    ap.add_argument("--write-model", type=Path, help="write the toy's checkpoint and exit")
    ap.add_argument("--write-catalog", type=Path, help="write the toy's catalog and exit")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reasoning", type=int, default=4, help="reasonings per user and step")
    ap.add_argument("--beams", type=int, default=4, help="item beams per reasoning")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--json", action="store_true", help="the steps as JSON on stdout")
    args = ap.parse_args()
    task = TwoStageTask()
    if args.write_model or args.write_catalog:
        if args.write_model:
            task.write_model(toy_model(), args.write_model)
        if args.write_catalog:
            task.write_catalog(args.write_catalog)
        return
    console = Console(stderr=True) if args.json else Console()
    kw = {"steps": args.steps, "reasoning": args.reasoning, "beams": args.beams, "lr": args.lr}
    if args.url is None:
        rows, summary = run_two_stage_demo(console, **kw)
    else:
        trainer = TwoStageTrainer(task, lr=args.lr)
        rows = run_two_stage_loop(
            args.url,
            task,
            steps=args.steps,
            reasoning_n=args.reasoning,
            beams=args.beams,
            trainer=trainer,
            console=console,
        )
        check(rows, args.reasoning, task.num_users)
        summary = report(console, rows)
    if args.json:
        doc = {"steps": [r.to_json() for r in rows], "summary": summary}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
