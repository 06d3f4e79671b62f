"""The planner: predicts memory and step time of every layout of a model on a cluster, pure arithmetic.

Modules, bottom up (formulas and sources in each docstring and in docs/planner.md):
    arch        model specs, exact parameter counts, FLOPs per token
    hardware    GPU presets, calibrated CPU profiles, clusters and their links
    layout      a layout (tp, pp, dp, cp, zero, mbs, vpp, recompute, sp, schedule) and its rules
    collectives α–β ring costs;  schedules  pipeline bubbles and in-flight micro-batches
    memory      bytes per rank;  timing  seconds per step;  search  enumerate, reject, rank
    report      table and JSON;  published  published runs;  validate  predicted vs measured
    calibrate   measures this machine (the only module that starts processes);  cli  `ndtrain plan`
Nothing here uses torch.distributed except `calibrate`.
"""

from ndtrain.plan.arch import ModelSpec
from ndtrain.plan.hardware import Cluster, Hardware
from ndtrain.plan.layout import Layout
from ndtrain.plan.search import Candidate, Fixed, SearchResult, evaluate, search

__all__ = ["Candidate", "Cluster", "Fixed", "Hardware", "Layout", "ModelSpec", "SearchResult", "evaluate", "search"]
