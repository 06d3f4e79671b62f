"""Evaluation beyond the loss: retrieval metrics (mAP, CMC) over data-parallel ranks. Imports `dist`
(the collectives), `data`'s sampler and `errors`."""

from ndtrain.eval.retrieval import LabeledSet, evaluate_retrieval, retrieval_metrics

__all__ = ["LabeledSet", "evaluate_retrieval", "retrieval_metrics"]
