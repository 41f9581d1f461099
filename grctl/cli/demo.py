"""`grctl demo`: the whole weight-sync loop against a real server, in well under a minute;
`grctl demo --rl`, an RL loop that learns through one (grctl/cli/rl/); and
`grctl demo --rl --two-stage`, one whose policy reasons, then recommends (a tiny Qwen3 the
server loads from a checkpoint written here; grctl/cli/rl/two_stage_*.py). --json: one JSON
document on stdout (the steps and a summary), the tables on stderr.

Starts `grctl serve` on the built-in model (--allow-weight-update, a free loopback port),
generates, pushes a perturbed copy of the model by the tensor path, verifies it, restores the
original by the disk path, verifies again, and prints versions, outputs and timings. Any step
that fails raises GrctlError (exit 1). With --rl: the RL task's catalog is served instead, the
loop runs for --steps steps, and GrctlError is raised when a rollout carries another label than
its step's weights or its logprobs differ from the trainer's. torch, the sync and the loop are
imported inside the functions, so that the other commands and --help do without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from grctl.cli.options import Json
from grctl.cli.output import command_output, console, err_console
from grctl.client.http import GRClient
from grctl.errors import GrctlError

PROMPT = [1, 17, 300, 600, 900]  # bos, a text token, then one semantic ID
MAX_NEW_TOKENS = 6


def demo(
    device: Annotated[str, typer.Option(help="Device of the demo server.")] = "cpu",
    rl: Annotated[
        bool, typer.Option("--rl", help="Run the RL loop instead (docs/rl-integration.md).")
    ] = False,
    two_stage: Annotated[
        bool,
        typer.Option(
            "--two-stage",
            help="--rl: reason, then recommend (multi-stage rollouts, the two-stage estimator).",
        ),
    ] = False,
    steps: Annotated[int, typer.Option(min=1, help="--rl: training steps.")] = 20,
    group: Annotated[
        int, typer.Option(min=2, help="--rl: samples per user and step (one stage).")
    ] = 8,
    reasoning: Annotated[
        int,
        typer.Option(min=1, help="--rl --two-stage: reasoning samples per user and step."),
    ] = 4,
    beams: Annotated[
        int, typer.Option(min=2, max=16, help="--rl --two-stage: item beams per reasoning.")
    ] = 4,
    lr: Annotated[
        Optional[float],
        typer.Option(min=0.0, help="--rl: Adam's learning rate (default: the trainer's)."),
    ] = None,
    plot: Annotated[
        Path,
        typer.Option(help="--rl (one stage): the reward curve's PNG (written if matplotlib is)."),
    ] = Path("rl_reward.png"),
    json: Json = False,
) -> None:
    """Start a server, generate, push perturbed weights (tensor), restore them (disk), verify.
    With --rl: train a policy through it, pushing each step's weights from memory; with
    --rl --two-stage: a policy that reasons, then recommends."""
    if two_stage and not rl:
        raise typer.BadParameter("--two-stage needs --rl", param_hint="--two-stage")
    out_console = err_console if json else console
    with command_output("demo", json) as out:
        if rl and two_stage:
            rows, summ = run_two_stage_demo(
                out_console, device=device, steps=steps, reasoning=reasoning, beams=beams, lr=lr
            )
            doc = {"mode": "rl-two-stage", "steps": [r.to_json() for r in rows]}
        elif rl:
            rows = run_rl_demo(
                out_console, device=device, steps=steps, group=group, lr=lr, plot=plot
            )
            from grctl.cli.rl.loop import summary

            summ = summary(rows)
            doc = {"mode": "rl", "steps": [rl_row_doc(r) for r in rows]}
        else:
            rows = run_demo(out_console, device=device)
            summ = {"total_s": rows[-1][3]}
            doc = {
                "mode": "weight-sync",
                "steps": [
                    {"step": a, "weight_version": v, "output_ids": ids, "seconds": t}
                    for a, v, ids, t in rows[:-1]
                ],
            }
        out.emit({"ok": True, **doc, "summary": summ})


def rl_row_doc(row) -> dict:
    """One step of `grctl demo --rl` as JSON: its figures and stats, not its beams."""
    doc = dataclasses.asdict(row)
    doc.pop("groups")
    return doc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def demo_server(
    device: str,
    log_path: Path,
    catalog: Path,
    start_timeout: float = 60.0,
    model_path: Path | None = None,
) -> Iterator[str]:
    """`grctl serve` on a free loopback port with `catalog` and --allow-weight-update, on the
    built-in model or the checkpoint at `model_path`; yields its URL, stops it on exit."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "grctl",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--allow-weight-update",
        "--weight-version",
        "builtin",
        "--catalog",
        str(catalog),
        *(["--model-path", str(model_path)] if model_path is not None else []),
    ]
    package_root = str(Path(__file__).resolve().parents[2])  # `-m grctl` finds this grctl
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        with GRClient(url, timeout=1.0) as gr:
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise GrctlError(f"the demo server exited with {proc.returncode}:\n{tail}")
                try:
                    gr.health()
                    break
                except GrctlError as exc:
                    if time.monotonic() > deadline:
                        msg = f"the demo server did not start in {start_timeout} s"
                        raise GrctlError(msg) from exc
                    time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """The built-in model as an HF checkpoint, and a perturbed copy of it."""
    import torch

    from grctl.weights.loader import export_hf, load_model

    model = load_model(None)
    original = export_hf(model, root / "original")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return original, export_hf(model, root / "perturbed")


def run_demo(console: Console, device: str = "cpu") -> list[tuple]:
    """Returns the table rows (step, version, output ids, seconds) it printed."""
    from grctl.client.sync import WeightSync

    rows: list[tuple] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grctl-demo-") as tmp:
        root = Path(tmp)
        original, perturbed = write_checkpoints(root)
        items = write_catalog(root / "catalog.jsonl")
        with (
            demo_server(device, root / "server.log", root / "catalog.jsonl") as url,
            GRClient(url) as gr,
        ):
            console.print(f"demo server at {url} ({device}); checkpoints in {root}")
            console.print(catalog_table(gr, items))

            def generate(step: str, seconds: float) -> list[int]:
                out = gr.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS, use_catalog=False)
                rows.append((step, out.meta_info.weight_version, out.output_ids, seconds))
                return out.output_ids

            before = generate("generate (built-in)", 0.0)
            with WeightSync(url, transport="tensor", bucket_mb=4, verify=True) as sync:
                pushed = sync.run(perturbed, weight_version="perturbed")
            after_push = generate(
                f"tensor push: {pushed.num_buckets} buckets, verified", pushed.timings["total"]
            )
            with WeightSync(url, transport="disk", verify=True) as sync:
                restored = sync.run(original, weight_version="restored")
            after_restore = generate("disk restore, verified", restored.timings["total"])
        rows.append(("total", "", "", time.perf_counter() - t_start))
    console.print(demo_table(rows))
    if after_restore != before:
        raise GrctlError(f"restored weights generate {after_restore}, not {before}")
    if after_push == before:
        console.print("[yellow]note:[/yellow] the perturbed model generated the same ids")
    return rows


def write_catalog(path: Path, num_items: int = 2000) -> dict[tuple[int, ...], str]:
    """Items of the built-in model's three semantic-ID levels; {token path: item id}."""
    import torch

    from grctl.model.builtin import NUM_TEXT_TOKENS, SID_CODES, SID_LEVELS

    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, SID_CODES, (num_items, SID_LEVELS), generator=gen)
    codes += NUM_TEXT_TOKENS + SID_CODES * torch.arange(SID_LEVELS)
    items = {tuple(row): f"item-{i}" for i, row in enumerate(codes.tolist())}
    lines = (json.dumps({"item_id": i, "token_ids": list(p)}) for p, i in items.items())
    path.write_text("\n".join(lines) + "\n")
    return items


def catalog_table(gr: GRClient, items: dict[tuple[int, ...], str]) -> Table:
    """Beam search of width 4 over 3 tokens, with the served catalog and without it."""
    status = gr.catalog_status()
    table = Table(
        title=f"beam 4, 3 tokens: catalog v{status.version} ({status.num_items} items) or not",
        title_justify="left",
    )
    for col in ("search", "rank", "output_ids", "item", "score"):
        table.add_column(col)
    for label, use in (("catalog", True), ("free", False)):
        out = gr.generate(PROMPT, max_new_tokens=3, n=4, use_catalog=use)
        served = out.meta_info.item_results or []
        for rank, beam in enumerate(out.meta_info.beam_results):
            item = served[rank].item_id if use else items.get(tuple(beam.output_ids))
            item = item or "[red]not an item[/red]"
            score = f"{beam.meta_info.sequence_score:.2f}"
            table.add_row(label if rank == 0 else "", str(rank), str(beam.output_ids), item, score)
    return table


def demo_table(rows: list[tuple]) -> Table:
    table = Table(title="grctl demo", title_justify="left")
    for col in ("step", "weight_version", f"output_ids (greedy, {MAX_NEW_TOKENS} tokens)", "s"):
        table.add_column(col)
    for step, version, ids, seconds in rows:
        table.add_row(step, version, str(ids), f"{seconds:.2f}")
    return table


def run_rl_demo(
    console: Console,
    *,
    device: str = "cpu",
    steps: int = 20,
    group: int = 8,
    lr: float | None = None,
    plot: Path | None = Path("rl_reward.png"),
) -> list:
    """The RL loop against a server started here with the task's catalog; returns its rows.
    The server's own entry point starts it with OMP_WAIT_POLICY=passive (unless set,
    grctl/threads.py): its idle OpenMP threads sleep instead of spinning on the cores the
    trainer's step needs (grctl/cli/rl/trainer.py)."""
    try:
        import transformers  # noqa: F401  the trainer's side of the loop is transformers' Qwen3
    except ImportError:
        raise GrctlError(
            "grctl demo --rl trains transformers' Qwen3, which is not installed",
            hint="pip install transformers (or, from a checkout, pip install -e '.[rl]')",
        ) from None
    from grctl.cli.rl.loop import check, report, run_loop, write_curve
    from grctl.cli.rl.task import make_task
    from grctl.cli.rl.trainer import DEFAULT_LR

    task = make_task()
    lr = DEFAULT_LR if lr is None else lr
    with tempfile.TemporaryDirectory(prefix="grctl-rl-") as tmp:
        root = Path(tmp)
        catalog = task.write_catalog(root / "catalog.jsonl")
        with demo_server(device, root / "server.log", catalog) as url:
            console.print(
                f"demo server at {url} ({device}): {len(task.items)} items, "
                f"{task.num_users} users x {group} beams per step"
            )
            rows = run_loop(url, task, steps=steps, group=group, lr=lr, console=console)
    check(rows)
    report(console, rows)
    if plot is not None:
        written = write_curve(rows, plot)
        console.print(f"curves: {written}" if written else "no curves: matplotlib missing")
    return rows


def run_two_stage_demo(
    console: Console,
    *,
    device: str = "cpu",
    steps: int = 20,
    reasoning: int = 4,
    beams: int = 4,
    lr: float | None = None,
) -> tuple[list, dict]:
    """The two-stage loop (grctl/cli/rl/two_stage_loop.py) against a server started here on
    the toy's model and catalog; returns its rows and summary. GrctlError when a sample mixed
    weight versions, a group came back aborted, or the replay differs from grctl's logprobs."""
    try:
        import transformers  # noqa: F401  the toy's model and trainer are transformers' Qwen3
    except ImportError:
        raise GrctlError(
            "grctl demo --rl --two-stage trains transformers' Qwen3, which is not installed",
            hint="pip install transformers (or, from a checkout, pip install -e '.[rl]')",
        ) from None
    from grctl.cli.rl.two_stage_loop import (
        DEFAULT_LR,
        TwoStageTrainer,
        check,
        report,
        run_two_stage_loop,
    )
    from grctl.cli.rl.two_stage_task import TwoStageTask

    task = TwoStageTask()
    trainer = TwoStageTrainer(task, lr=DEFAULT_LR if lr is None else lr)
    with tempfile.TemporaryDirectory(prefix="grctl-rl2-") as tmp:
        root = Path(tmp)
        catalog = task.write_catalog(root / "catalog.jsonl")
        model = task.write_model(trainer.model, root / "model")
        with demo_server(device, root / "server.log", catalog, model_path=model) as url:
            console.print(
                f"demo server at {url} ({device}): a {len(task.items)}-item catalog, "
                f"{task.num_users} users x {reasoning} reasonings x {beams} beams per step"
            )
            rows = run_two_stage_loop(
                url,
                task,
                steps=steps,
                reasoning_n=reasoning,
                beams=beams,
                trainer=trainer,
                console=console,
            )
    check(rows, reasoning, task.num_users)
    return rows, report(console, rows)
