"""Evaluation beyond the loss: retrieval metrics (mAP, CMC) over data-parallel ranks; next-token
perplexity and accuracy (token_metrics.py, what the engines' `evaluate` returns). Imports `dist`
(the collectives), `data`'s sampler and `errors`."""

from ndtrain.eval.retrieval import LabeledSet, evaluate_retrieval, retrieval_metrics

__all__ = ["LabeledSet", "evaluate_retrieval", "retrieval_metrics"]
