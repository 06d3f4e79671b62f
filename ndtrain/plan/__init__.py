"""The planner: predicts memory and step time of every layout of a model on a cluster, pure arithmetic.

Modules, bottom up (formulas and sources in each docstring and in docs/planner.md):
    arch        model specs, exact parameter counts, FLOPs per token
    efficiency  the fitted GPU constants;  hardware  GPU presets, clusters and their links
    cpu_profile a calibrated CPU profile as a device;  jsonfile  reading the JSON files it is given
    layout      a layout (tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule) and its rules
    collectives α–β ring costs;  schedules  pipeline bubbles and in-flight micro-batches
    memory      bytes per rank;  gpu_compute  a micro-batch's compute;  timing  seconds per step
    search      enumerate, reject, rank;  report  table and JSON
    published   published runs;  fit  refits the GPU constants on them;  ablation  one term out
    validate    predicted vs measured
    calibrate   measures this machine (the only module that starts processes), with calibrate_comm
                (collectives under load) and calibrate_layers (the built-in Llama's pieces)
    cli         `ndtrain plan`
Imports: `errors`, `config` (presets and option names) and, for `cli`, the shared flag parsers;
torch only inside the calibration (`calibrate_layers` times `models.llama`'s layers, `calibrate_comm`
uses torch.distributed, both loaded in the measuring processes). Never the engine, `parallel` or `run`.
"""
from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster, Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.search import Candidate, Fixed, SearchResult, evaluate, search

__all__ = ["Candidate", "Cluster", "Fixed", "Hardware", "Layout", "ModelSpec", "SearchResult", "evaluate", "search"]
