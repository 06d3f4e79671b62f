"""Models: a Llama-style byte-level language model."""

from ndtrain.models.llama import Llama, build_model, count_parameters

__all__ = ["Llama", "build_model", "count_parameters"]
