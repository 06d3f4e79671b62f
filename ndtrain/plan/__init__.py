"""The planner: predicts memory and step time of every layout of a model on a cluster, pure arithmetic.

Modules, bottom up (formulas and sources in each docstring and in docs/planner.md):
    arch        model specs, exact parameter counts, FLOPs per token
    kernels     kernel profiles: the software stack a run's layers execute (`--kernels`)
    efficiency  the fitted GPU constants;  hardware  GPU presets, clusters and their links
    cpu_profile a calibrated CPU profile as a device;  jsonfile  reading the JSON files it is given
    layout      a layout (tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule) and its rules
    collectives α–β ring costs;  schedules  pipeline bubbles and in-flight micro-batches
    memory      bytes per rank;  gpu_compute  a micro-batch's compute;  timing  seconds per step
    search      enumerate, reject, rank;  report  table and JSON
    auto        `ndtrain train --layout auto`: the first-ranked layout for a run's config, as config keys
    published   published runs (published_run: what a row states; published_pytorch, published_megatron:
                the rows, by source);  fit  refits the GPU constants on them
    loso        leave-one-source-out and held-out validation;  ablation  one term out, judged by it
    validate    predicted vs measured `bench layouts` steps on this machine
    calibrate   measures this machine (the only module that starts processes), with calibrate_comm
                (collectives under load), calibrate_layers (the built-in Llama's pieces) and
                calibrate_elementwise (ndtrain's own element-wise layer ops)
    cli         `ndtrain plan`
Imports: `errors`, `config` (presets and option names) and, for `cli`, the shared flag parsers;
torch only inside the calibration (`calibrate_layers` and `calibrate_elementwise` time `models.llama`'s
layers and ops, `calibrate_comm` uses torch.distributed, all loaded in the measuring processes). Never the engine, `parallel` or `run`.
"""
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster, Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.search import Candidate, Fixed, SearchResult, evaluate, search

__all__ = ["Candidate", "Cluster", "Fixed", "Hardware", "Layout", "ModelSpec", "SearchResult", "evaluate", "search"]
