"""Published training runs, the planner's check at cluster scale: every row read in a source it cites.

The rows (`published_pytorch.py`, `published_megatron.py`) and what they are (`published_run.py`).
A source is a fit source (the constants of `efficiency.py` are fitted on all of them; `loso.py`
validates leave-one-source-out) or held out (`Source.held_out`: never used in any fit, decided when
the source was added, before its predictions were looked at).
"""

from __future__ import annotations

from ndtrain.plan import published_megatron, published_pytorch
from ndtrain.plan.published_run import PublishedRun, Source

RUNS: tuple[PublishedRun, ...] = published_pytorch.RUNS + published_megatron.RUNS
SOURCES: tuple[Source, ...] = tuple(dict.fromkeys(run.source for run in RUNS))

# Layouts of one model a source compares: (what, rows fastest first as measured).
ORDERINGS: tuple[tuple[str, tuple[PublishedRun, ...]], ...] = (
    ("BigScience 181B trials (TP4 chosen over TP8 and TP2)", published_megatron.BLOOM_TRIALS),
    ("Korthikanti 2022: selective + SP faster than full recompute", published_megatron.KORTHIKANTI_RUNS),
)


def fit_runs() -> list[PublishedRun]:
    return [run for run in RUNS if not run.source.held_out]


def held_out_runs() -> list[PublishedRun]:
    return [run for run in RUNS if run.source.held_out]


def by_name(source_key: str, name: str) -> PublishedRun:
    return next(run for run in RUNS if run.source.key == source_key and run.name == name)
