"""Pipeline parallel: stages cut from one model, micro-batches run by a schedule (see each module)."""

from ndtrain.parallel.pipeline.partition import is_pipeline_duplicate, split_model
from ndtrain.parallel.pipeline.runner import eval_pipeline, run_pipeline
from ndtrain.parallel.pipeline.schedules import SCHEDULES
from ndtrain.parallel.pipeline.timeline import Timeline, bubble_fraction, write_chrome_trace, write_png

__all__ = [
    "SCHEDULES", "Timeline", "bubble_fraction", "eval_pipeline", "is_pipeline_duplicate", "run_pipeline", "split_model",
    "write_chrome_trace", "write_png",
]
