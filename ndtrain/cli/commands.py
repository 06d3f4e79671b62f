"""The `ndtrain` command: train, generate, export, inspect, bench, plan.

`ndtrain train` validates the whole configuration in the launching process (so mistakes end in
one line and exit status 2 before any worker starts: cli/prepare.py), then either runs as a worker
(when torchrun started this process) or launches `--nproc` local workers through torchrun's elastic
agent, each re-running the same command line. Started by mpirun or srun, every process runs the
command: rank 0 validates and prepares while the others wait, then each is a worker (cli/external.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import typing
from pathlib import Path
from typing import Any, Callable

from ndtrain.cli import flags as cli_flags
from ndtrain.cli.flags import parse_bool
from ndtrain.config import TrainConfig, parse_override
from ndtrain.errors import UserError
from ndtrain.run.config_checks import resolve_config

# Everyday flags and the config key each one sets; the help adds the key, its allowed values and
# its config default (cli_flags.add_config_flag).
TRAIN_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--nproc": ("launch.nproc", int, "local worker processes to start"),
    "--max-restarts": ("launch.max_restarts", int, "restarts of the worker group after a worker dies"),
    "--dp": ("parallel.dp", int, "data-parallel degree, 0 = what the world leaves"),
    "--tp": ("parallel.tp", int, "tensor-parallel degree"),
    "--pp": ("parallel.pp", int, "pipeline-parallel degree"),
    "--cp": ("parallel.cp", int, "context-parallel degree"),
    "--zero": ("parallel.zero", int, "ZeRO stage"),
    "--precision": ("parallel.precision", str, "compute dtype (fp32 master weights)"),
    "--recompute": ("parallel.recompute", str, "activation recomputation"),
    "--sp": ("parallel.sequence_parallel", parse_bool, "sequence parallelism with tp"),
    "--schedule": ("parallel.pp_schedule", str, "pipeline schedule"),
    "--vpp": ("parallel.pp_virtual", int, "virtual pipeline stages per rank (interleaved)"),
    "--layout": ("parallel.layout", str, "manual: the layout flags as given; auto: the planner's fastest layout that "
                 "fits this machine (given layout flags stay fixed; docs/planner.md)"),
    "--profile": ("parallel.layout_profile", str, "the calibrated CPU profile --layout auto plans with "
                  "(`ndtrain plan --calibrate --model PRESET --out PATH`)"),
    "--dp-mode": ("parallel.dp_mode", str, "ddp (processes) or single-process (classic DataParallel over replicas)"),
    "--ps.servers": ("ps.servers", int, "parameter-server ranks, 0 = off"),
    "--ps.mode": ("ps.mode", str, "parameter-server consistency"),
    "--ps.staleness": ("ps.staleness", int, "ssp staleness bound (steps)"),
    "--ps.slow-worker": ("ps.slow_worker", str, "RANK:FACTOR, one worker FACTOR× slower"),
    "--model": ("model.preset", str, "model: a built-in preset or hf:PATH (a folder with a transformers config.json)"),
    "--init-from": ("model.init_from", str, "start from these weights: an HF save_pretrained folder or a .safetensors file"),
    "--seq-len": ("model.seq_len", int, "tokens per sequence"),
    "--steps": ("schedule.steps", int, "optimizer steps"),
    "--global-batch": ("schedule.global_batch", int, "sequences per optimizer step, over all dp ranks"),
    "--micro-batch": ("schedule.micro_batch", int, "sequences per micro-batch (accumulation covers the rest)"),
    "--lr": ("optim.lr", float, "peak learning rate (after warmup, before the decay)"),
    "--optim": ("optim.name", str, "optimizer (torch.optim; adafactor needs zero=0 and tp=1)"),
    "--lr-scheduler": ("schedule.lr_scheduler", str, "learning rate after the warmup: cosine or linear decay to "
                       "schedule.min_lr_ratio·lr, constant, or wsd (stable, then linear decay over the last "
                       "schedule.decay_fraction of the steps)"),
    "--warmup-steps": ("schedule.warmup_steps", int, "linear warmup steps, below --steps; none = 30 (a task preset's "
                       "own), capped at steps // 10 with a warning when the run is not longer"),
    "--eval-every": ("log.eval_every", int, "validate every N steps, 0 = only at the end"),
    "--out": ("log.out", str, "run directory"),
    "--seed": ("seed", int, "seed of init and data order"),
    "--save-every": ("checkpoint.save_every", int, "checkpoint every N steps, 0 = only at the end"),
    "--lora-r": ("lora.r", int, "LoRA rank: trainable rank-r adapters on --lora-targets, the rest frozen; 0 = no LoRA"),
    "--lora-alpha": ("lora.alpha", float, "LoRA scale numerator: the adapters' output is scaled by alpha/r"),
    "--lora-targets": ("lora.targets", cli_flags.parse_names, "comma-separated ends of the linear layers' names to adapt "
                       "(wq,wv for the built-in Llama, q_proj,v_proj for a Hugging Face one)"),
    "--lora-dropout": ("lora.dropout", float, "dropout on the LoRA adapters' input"),
    "--data": ("data.path", str, "text file, folder of text files, or .jsonl with a 'text' field; none = the "
               "standard library's source"),
    "--data-kind": ("data.kind", str, "what a record of --data is: auto (the first record's keys decide), text, "
                    "chat, instruction or completion"),
    "--loss-on": ("data.loss_on", str, "fine-tuning targets: assistant (every assistant turn; an instruction's "
                  "output, a completion), completion (the last assistant turn) or all"),
    "--max-length": ("data.max_length", int, "tokens of the longest fine-tuning example kept whole, its EOS counted; "
                     "none = seq-len + 1"),
    "--overlong": ("data.overlong", str, "an example longer than --max-length: truncate or drop"),
    "--packing": ("data.packing", parse_bool, "pack examples whole into seq-len windows (false: one padded example "
                  "a sample)"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `ndtrain: error: ...`, exit status 2 (not usage + error),
    and whose help shows every option's default (its subcommands' parsers are of this class too)."""

    def __init__(self, *args: Any, formatter_class: type = cli_flags.HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"ndtrain: error: {self.prog}: {message} (see {self.prog} --help)\n")



def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="ndtrain", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model (no arguments: the embedded default run)")
    train.add_argument("config", nargs="?", help="TOML config file (optional)")
    for flag, (key, kind, help_text) in TRAIN_FLAGS.items():
        cli_flags.add_config_flag(train, flag, key, kind, help_text)
    train.add_argument("--resume", action="store_true", help="continue from the run directory's newest checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="delete the run directory's checkpoints and metrics and start over [checkpoint.overwrite]")
    train.add_argument("--check", action="store_true",
                       help="validate the configuration, the run directory and the data, print the resolved "
                            "config as TOML and exit 0 without training")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override any config key, e.g. --set optim.lr=3e-4 (repeatable; default: none)")

    gen = commands.add_parser("generate", help="sample text from a trained run (KV cache, stops at the tokenizer's EOS)")
    gen.add_argument("run_dir", type=Path, help="a run directory with a checkpoint")
    gen.add_argument("--prompt", default="def ", metavar="TEXT", help="text to continue (default: 'def ')")
    gen.add_argument("--max-new-tokens", type=int, default=300, metavar="N",
                     help="tokens to sample at most (fewer when the end-of-sequence token comes first)")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T", help="softmax temperature (0: greedy)")
    gen.add_argument("--top-k", type=int, default=40, metavar="K", help="sample among the K most likely tokens (0: all)")
    gen.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the run tokenizer's chat template (ChatML "
                          "without one, as training renders chat records) and print only the reply")

    export = commands.add_parser("export", help="write a run's model as one safetensors file (config in its metadata) "
                                                "or, with --format hf, as a Hugging Face save_pretrained folder")
    export.add_argument("run_dir", type=Path, help="a run directory with a checkpoint")
    export.add_argument("out", type=Path, metavar="OUT", help="OUT.safetensors, or a new folder with --format hf or peft")
    export.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                        help="safetensors: one file; hf: config.json + model.safetensors (+ tokenizer), LoRA adapters "
                             "merged; peft: a LoRA run's adapters as a peft adapter folder")

    inspect = commands.add_parser("inspect", help="a run's model, layout, step, tokens and newest checkpoint's tensors")
    inspect.add_argument("run_dir", type=Path, help="a run directory")

    from ndtrain.bench import cli as bench_cli
    from ndtrain.plan import cli as plan_cli

    bench = commands.add_parser("bench", help="ours vs the PyTorch-native equivalent, alternating runs")
    bench_cli.add_arguments(bench)
    plan = commands.add_parser("plan", help="predict memory and step time of every layout; recommend one")
    plan_cli.add_arguments(plan)
    report = commands.add_parser("report", help="one self-contained HTML page of a run directory or of bench-results/")
    report.add_argument("directory", type=Path, metavar="RUN_DIR|BENCH_DIR",
                        help="a run directory (with metrics.jsonl) or a folder of `ndtrain bench` JSON results")
    report.add_argument("--out", type=Path, default=None, metavar="FILE.html", help="default: DIR/report.html")
    return parser


def train_config(args: argparse.Namespace) -> TrainConfig:
    overrides = train_overrides(args)
    cfg = resolve_config(args.config, overrides)
    from ndtrain.launch import speaks_for_the_run

    warning = cli_flags.preset_override_warning(args.config, overrides)
    if warning is not None and speaks_for_the_run():  # once, from the launching process (or rank 0)
        print(f"ndtrain: warning: {warning}", file=sys.stderr, flush=True)
    return cfg


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the command line sets (flags, then `--set`), over the config file's."""
    overrides: dict[str, Any] = {}
    for flag, (key, _, _) in TRAIN_FLAGS.items():
        value = getattr(args, cli_flags.flag_dest(flag))
        if value is not None:
            overrides[key] = value
    if args.resume:
        overrides["checkpoint.resume"] = True
    if args.overwrite:
        overrides["checkpoint.overwrite"] = True
    overrides.update(parse_override(item) for item in args.set)
    return overrides


def version_line() -> str:
    """`ndtrain X.Y.Z (torch A.B.C)`, what `ndtrain --version` prints."""
    import torch

    from ndtrain import __version__

    return f"ndtrain {__version__} (torch {torch.__version__})"


def run_train(args: argparse.Namespace, argv: list[str]) -> int:
    from ndtrain.cli import layout_auto
    from ndtrain.cli.prepare import prepare_run
    from ndtrain.dist.launchers import detect
    from ndtrain.launch import in_worker, launch_local

    launch = detect(os.environ)
    if launch.external:  # mpirun or srun started this process and its peers
        from ndtrain.cli.external import join_external

        status, store, joined = join_external(
            lambda: layout_auto.refuse_outside_launcher(train_config(args), launch.launcher), args.check, launch,
            nproc_given(args))
        if status is not None or joined is None:
            return 2 if status is None else status
        return train_worker(joined, store=store)
    cfg = train_config(args)
    if in_worker():  # our launcher hands its workers the chosen layout (layout_auto.worker_argv)
        return train_worker(layout_auto.refuse_outside_launcher(cfg, "torchrun"))
    choice = None
    if cfg.parallel.layout == "auto":
        given = layout_auto.given_layout_keys(args.config, train_overrides(args))
        cfg, choice = layout_auto.plan_run(cfg, given, args.check)
        argv = layout_auto.worker_argv(argv, choice)
    prepare_run(cfg, args.check, cfg.launch.nproc)
    warmup = cfg.warmup_warning()  # once the run is accepted: a refused run's error stays its only line
    if warmup is not None:
        print(f"ndtrain: warning: {warmup}", file=sys.stderr, flush=True)
    if args.check:
        return 0
    run_dir = Path(cfg.log.out)
    if choice is not None:
        layout_auto.write_prediction(run_dir, choice)
    if cfg.launch.nproc == 1:
        status = train_worker(cfg)
    else:
        status = launch_local(argv, cfg.launch.nproc, cfg.launch.max_restarts, run_dir)
    if choice is not None and status == 0:
        layout_auto.report_measured(run_dir, choice)
    return status


def nproc_given(args: argparse.Namespace) -> bool:
    """`--nproc` or `--set launch.nproc=N` on the command line."""
    return getattr(args, cli_flags.flag_dest("--nproc")) is not None or any(
        parse_override(item)[0] == "launch.nproc" for item in args.set)


def train_worker(cfg: TrainConfig, store: Any = None) -> int:
    """Train in this process; exit status 0, 2 (a user error or a failure that would recur), 1 (a bug or
    a lost peer: restartable) or 128+N (stopped by signal N, checkpoint written); the rule is
    ndtrain/failures.py's. Output: console and RUN_DIR/logs/rank_N.log (see console.py). `store`: the
    rendezvous store an mpirun or srun launch has joined (cli/external.py); start-up's deadline then
    counts from now, not from the process start (rank 0 prepared the run meanwhile)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ndtrain.console import WorkerConsole, log, report_user_error
    from ndtrain.engine import NonFiniteError
    from ndtrain.failures import lost_peer, recurring_cause
    from ndtrain.launch import die_with_parent, in_worker, set_worker_threads
    from ndtrain.dist.mesh import init
    from ndtrain.dist.phases import process_started
    from ndtrain.run.preemption import Preempted, exit_status
    from ndtrain.run.lock import run_lock
    from ndtrain.run.shared_dir import check_shared_run_dir
    from ndtrain.trainer import Trainer

    started = process_started() if store is None else time.monotonic()  # start-up's deadline counts from here
    if in_worker():
        die_with_parent()
    set_worker_threads(cfg.launch.threads)
    with WorkerConsole() as console:
        try:
            ctx = init(cfg.parallel, started=started, store=store)
        except UserError as e:
            report_user_error(str(e))
            return 2
        try:
            with run_lock(Path(cfg.log.out), ctx):
                console.attach_rank_log(Path(cfg.log.out))
                check_shared_run_dir(Path(cfg.log.out), ctx)  # several hosts: one folder for all
                Trainer(cfg, ctx).run()
        except NonFiniteError as e:
            e.newest_checkpoint = _newest_checkpoint(Path(cfg.log.out) / "checkpoints")
            report_user_error(str(e))
            return 2
        except Preempted as e:
            if ctx.is_main:
                log.warning(f"ndtrain: {e.message()}")
            return exit_status(e.signum)
        except (Exception, CheckpointException) as e:
            cause = recurring_cause(e)
            if cause is not None and isinstance(e, UserError) and e.__cause__ is None:
                report_user_error(cause)  # the message is all there is to say
                return 2
            if cause is not None:
                console.log_only(e, "a failure a restart would meet again")
                report_user_error(cause if console.log_path is None else f"{cause} (traceback in {console.log_path})")
                return 2
            if lost_peer(e):
                console.log_only(e, "a peer was lost")
                return 1
            console.crash(e)
            return 1
        finally:
            ctx.destroy()
    return 0


def _newest_checkpoint(directory: Path) -> str:
    """The name of what a re-run would resume from (the newest verified checkpoint), for a message."""
    from ndtrain.checkpoint.manifest import choose

    newest = choose(directory).path
    return newest.name if newest else "none (a re-run starts over)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return run_train(args, argv)
        if args.command == "generate":
            from ndtrain.generate import generate_text

            print(generate_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                                chat=args.chat))
            return 0
        if args.command == "export" and args.format == "peft":
            from ndtrain.checkpoint.export_peft import export_peft

            checkpoint, files = export_peft(args.run_dir, args.out)
            print(f"ndtrain: exported the LoRA adapters of {checkpoint} to {args.out} ({', '.join(files)})")
            return 0
        if args.command == "export" and args.format == "hf":
            from ndtrain.checkpoint.export_hf import export_hf

            checkpoint, files = export_hf(args.run_dir, args.out)
            print(f"ndtrain: exported {checkpoint} to {args.out} ({', '.join(files)})")
            return 0
        if args.command == "export":
            from ndtrain.checkpoint.export import export_safetensors

            checkpoint, count = export_safetensors(args.run_dir, args.out)
            print(f"ndtrain: exported {count} tensors of {checkpoint} to {args.out}")
            return 0
        if args.command == "inspect":
            from ndtrain.run.inspect import inspect_run

            print(inspect_run(args.run_dir))
            return 0
        if args.command == "plan":
            from ndtrain.plan import cli as plan_cli

            return plan_cli.main(args)
        if args.command == "report":
            from ndtrain.report.page import write_report

            print(f"ndtrain: report written to {write_report(args.directory, args.out)}")
            return 0
        from ndtrain.bench import cli as bench_cli

        return bench_cli.main(args)
    except UserError as e:
        from ndtrain.launch import in_worker, speaks_for_the_run

        if args.command == "train" and in_worker():  # every rank raised it: printed once
            from ndtrain.console import report_user_error

            report_user_error(str(e))
        elif speaks_for_the_run():  # under mpirun or srun: rank 0 prints what every rank raised
            print(f"ndtrain: error: {e}", file=sys.stderr)
        return 2
