"""Evaluation beyond the loss: retrieval metrics (mAP, CMC) over data-parallel ranks."""

from ndtrain.eval.retrieval import LabeledSet, evaluate_retrieval, retrieval_metrics

__all__ = ["LabeledSet", "evaluate_retrieval", "retrieval_metrics"]
