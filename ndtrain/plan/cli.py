"""`ndtrain plan`: predict memory and step time of every layout of a model on a cluster; recommend one.

    ndtrain plan --model llama3-70b --gpus 64 --gpu h100-sxm --global-batch 512
    ndtrain plan --model hf:DIR [--seq N] ...    a Hugging Face folder's config.json (hf_config.py)
    ndtrain plan --arch gpt --layers 48 --hidden 6144 --heads 48 --vocab 51200 --seq-len 2048 ...
    ndtrain plan ... --tp 8 --pp 4 --dp 2 --cp 1 --zero 1 --micro-batch 1 --recompute selective --sp true
                 --schedule 1f1b      (every layout flag given: that one layout is evaluated)
    ndtrain plan ... --kernels fused-fp8         the software stack the layers run (kernels.py; default eager)
    ndtrain plan --calibrate [--out PATH] [--model NAME | --arch ...] [--gpus N]
                                                 measure this machine (and the model's layers)
    ndtrain plan --profile PATH --gpus 4 ...     plan local CPU processes with that profile
    ndtrain plan --validate                      leave-one-source-out and held-out check on published runs
    ndtrain plan --published                     every published row with its prediction
    ndtrain plan --fit-published                 refit the GPU efficiency constants on the fit sources
    ndtrain plan --ablation                      each term taken out, judged leave-one-source-out
    ndtrain plan --validate bench-results/layouts-n4.json --profile plan-profile.json
                                                 predicted vs measured step times of `bench layouts`

Public API: `add_arguments(parser)` declares the flags, `main(args) -> int` runs them (0 done,
1 nothing fits, 2 a user mistake, printed as one line `ndtrain: error: ...`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ndtrain.cli.flags import BOOL_METAVAR, parse_bool
from ndtrain.config import MODEL_PRESETS
from ndtrain.errors import UserError
from ndtrain.config.options import PP_SCHEDULES, RECOMPUTE_MODES, ZERO_STAGES
from ndtrain.config.parallel import DEFAULT_LAYOUT_PROFILE
from ndtrain.plan import ablation, arch, calibrate, fit, hf_config, kernels, loso, report, validate
from ndtrain.plan.cpu_profile import load_profile
from ndtrain.plan.hardware import GPUS, Cluster, gpu
from ndtrain.plan.search import Fixed, search

DEFAULT_PROFILE = Path(DEFAULT_LAYOUT_PROFILE)  # also what `ndtrain train --layout auto` reads
LOSO = Path()  # `--validate` with no file: the published runs' leave-one-source-out check


# Model names: ndtrain's own presets (as `train --model` and `bench --model` spell them), then the
# published models. `ndtrain-bench` and the like are read as `bench` (the spelling of earlier versions).
MODEL_NAMES = (*MODEL_PRESETS, *(name for name in arch.PRESETS if name.removeprefix("ndtrain-") not in MODEL_PRESETS))
OLD_PREFIX = "ndtrain-"


def model_name(text: str) -> str:
    """`--model` as given, with the old `ndtrain-PRESET` spelling read as `PRESET`."""
    rest = text.removeprefix(OLD_PREFIX)
    return rest if text.startswith(OLD_PREFIX) and rest in MODEL_PRESETS else text


class ModelChoices(tuple[str, ...]):
    """`--model`'s choices: the names, and any `hf:DIR` (argparse lists the names when refusing)."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and value.startswith(hf_config.PREFIX) or super().__contains__(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a preset, or --arch and its sizes)")
    model.add_argument("--model", type=model_name, choices=ModelChoices(MODEL_NAMES), metavar="NAME",
                       help=f"model: {', '.join(MODEL_NAMES)}, or hf:DIR (a Hugging Face folder's config.json) "
                       "(default: none; give it or --arch)")
    model.add_argument("--arch", choices=arch.ARCHS, help="architecture, with --layers --hidden --heads [--kv-heads] "
                       "[--ffn] --vocab --seq-len (default: none; give it or --model)")
    for flag, what in (("--layers", "transformer layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--vocab", "vocabulary size")):
        model.add_argument(flag, type=int, metavar="N", help=f"{what} (default: none; needed with --arch)")
    model.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads (default: --heads)")
    model.add_argument("--ffn", type=int, metavar="N", help="FFN width (default: 4·hidden for gpt, Llama's rule for llama)")
    model.add_argument("--seq-len", "--seq", dest="seq", type=int, metavar="N",
                       help="tokens per sequence (default: the model's; needed with --arch)")

    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, metavar="N",
                         help="number of GPUs, or local processes with --profile (default: none; required)")
    cluster.add_argument("--gpu", choices=tuple(GPUS), help="GPU type (default: none; give it or --profile)")
    cluster.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node")
    cluster.add_argument("--intra-bw", type=float, metavar="GB/S",
                         help="intra-node bandwidth per GPU, GB/s (default: the GPU's)")
    cluster.add_argument("--inter-bw", type=float, metavar="GB/S",
                         help="inter-node bandwidth per GPU, GB/s (default: the GPU's)")
    cluster.add_argument("--profile", type=Path, help="calibrated CPU profile (from --calibrate) instead of --gpu "
                         "(default: none)")
    cluster.add_argument("--kernels", choices=tuple(kernels.PROFILES), help="the software stack the GPU layers run: "
                         + "; ".join(f"{p.name}: {p.stack}" for p in kernels.PROFILES.values())
                         + f" (default: {kernels.DEFAULT.name}, ndtrain's own layers)")
    cluster.add_argument("--global-batch", type=int, metavar="N",
                         help="sequences per optimizer step (default: none; required)")

    fixed = parser.add_argument_group("layout (each one given is fixed, the rest searched; all given = one layout)")
    for flag in ("--tp", "--pp", "--dp", "--cp"):
        fixed.add_argument(flag, type=int, metavar="N", help=f"{flag[2:]} degree (default: searched)")
    fixed.add_argument("--zero", type=int, choices=ZERO_STAGES, help="ZeRO stage (default: searched)")
    fixed.add_argument("--micro-batch", "--mbs", dest="mbs", type=int, metavar="N",
                       help="sequences per micro-batch (default: searched)")
    fixed.add_argument("--vpp", type=int, metavar="N", help="virtual pipeline stages per rank (default: searched)")
    fixed.add_argument("--recompute", choices=RECOMPUTE_MODES, help="activation recomputation (default: searched)")
    fixed.add_argument("--sp", type=parse_bool, metavar=BOOL_METAVAR, help="sequence parallelism (default: searched)")
    fixed.add_argument("--schedule", choices=PP_SCHEDULES, help="pipeline schedule (default: searched; "
                       "naive and gpipe only when given)")

    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, metavar="N", help="layouts to show")
    out.add_argument("--json", action="store_true", help='print {"candidates": [...]} best first')
    out.add_argument("--explain", action="store_true", help="why rejected layouts fail, and the best layout's time term by term")
    out.add_argument("--published", action="store_true", help="every published run with its prediction")
    out.add_argument("--fit-published", action="store_true",
                     help="refit the GPU efficiency constants on the published fit sources and print them")
    out.add_argument("--ablation", action="store_true",
                     help="take each term of the GPU model out, refit, and print its leave-one-source-out errors")
    out.add_argument("--calibrate", action="store_true", help="measure this machine into a CPU profile; with --model/--arch also "
                     "that model's layers; --gpus N adds a process count to the default 1, 2, 4")
    out.add_argument("--validate", type=Path, metavar="RESULT", nargs="?", const=LOSO,
                     help="alone: the planner's leave-one-source-out and held-out errors on published runs; with "
                     "RESULT: compare with a `bench layouts` JSON result (needs --profile) (default: none)")
    out.add_argument("--out", type=Path, default=DEFAULT_PROFILE, help="profile path written by --calibrate")


def main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UserError as e:
        print(f"ndtrain: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.calibrate:
        model = _model(args) if (args.model or args.arch) else None
        if args.gpus is not None and args.gpus <= 0:
            raise UserError(f"--gpus {args.gpus} must be > 0")
        counts = calibrate.PROCESS_COUNTS + ((args.gpus,) if args.gpus else ())
        profile = calibrate.run(args.out, model, counts)
        print(calibrate.summary(profile))
        print(f"written {args.out}")
        return 0
    if args.published:
        print(report.published_table())
        return 0
    if args.fit_published:
        print(fit.fit())
        return 0
    if args.ablation:
        print(ablation.table([ablation.evaluate(variant) for variant in ablation.VARIANTS]))
        return 0
    if args.validate is LOSO:
        print(loso.report())
        return 0
    if args.validate is not None:
        return _validate(args.validate, args.profile)
    model = _model(args)
    cluster = _cluster(args)
    if args.global_batch is None:
        raise UserError("--global-batch is required: the number of sequences per optimizer step")
    if args.top <= 0:
        raise UserError(f"--top {args.top} must be > 0")
    result = search(model, cluster, args.global_batch, _fixed(args))
    fits = any(c.fits for c in result.candidates)
    if args.json:
        print(report.to_json(result, args.top))
    else:
        if args.model and args.model.startswith(hf_config.PREFIX):
            print(hf_config.describe(model))
        print(report.header(model, cluster, args.global_batch))
        print(report.table(result, args.top))
        if args.explain or not fits:
            print(report.explain(result))
        if args.explain and result.candidates:
            print(report.terms(result.candidates[0], model, cluster))
    if not fits:
        print("ndtrain: no layout fits in memory: the smallest are shown; add GPUs, recompute or ZeRO",
              file=sys.stderr)
        return 1
    return 0


def _validate(result: Path, profile: Path | None) -> int:
    if profile is None:
        raise UserError("--validate needs --profile PATH: write one with `ndtrain plan --calibrate`")
    bench = validate.load_bench(result)
    cluster = Cluster(load_profile(profile, bench.world), bench.world, bench.world)
    print(validate.table(bench, validate.predictions(bench, cluster)))
    return 0


def _model(args: argparse.Namespace) -> arch.ModelSpec:
    for flag in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag.replace('_', '-')} {value} must be > 0")
    if args.model and args.arch:
        raise UserError("give either --model PRESET or --arch with sizes, not both")
    if args.model and args.model.startswith(hf_config.PREFIX):
        return hf_config.read(Path(args.model.removeprefix(hf_config.PREFIX)), args.seq)
    if args.model:
        return arch.preset(OLD_PREFIX + args.model if args.model in MODEL_PRESETS else args.model, args.seq)
    if args.arch:
        return arch.explicit(args.arch, args.layers, args.hidden, args.heads, args.kv_heads, args.ffn,
                             args.vocab, args.seq)
    raise UserError("no model: give --model NAME (e.g. llama3-8b or bench) or --arch gpt|llama with its sizes")


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.gpus is None:
        raise UserError("--gpus is required: the number of GPUs (or local processes with --profile)")
    if args.profile is not None:
        if args.gpu:
            raise UserError("give either --gpu NAME or --profile PATH, not both")
        if args.kernels:
            raise UserError("--kernels describes a GPU software stack; a --profile runs ndtrain's own layers at the "
                            "rates --calibrate measured: drop --kernels")
        if args.gpus <= 0:
            raise UserError(f"--gpus {args.gpus} must be > 0")
        return Cluster(load_profile(args.profile, args.gpus), args.gpus, args.gpus)
    if not args.gpu:
        raise UserError("--gpu is required: a100-40gb, a100-80gb, h100-sxm or h200 (or --profile PATH)")
    stack = kernels.profile(args.kernels) if args.kernels else None
    return Cluster(gpu(args.gpu, args.intra_bw, args.inter_bw, stack), args.gpus, args.gpus_per_node)


def _fixed(args: argparse.Namespace) -> Fixed:
    return Fixed(args.tp, args.pp, args.dp, args.cp, args.zero, args.mbs, args.vpp, args.recompute, args.sp,
                 args.schedule)
