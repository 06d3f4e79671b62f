"""Data: byte tokenizer, corpora with a deterministic train/val split, token windows and samplers."""

from ndtrain.data.corpus import Corpus, TokenWindows, load_corpus
from ndtrain.data.sampler import DistributedSampler, eval_shard
from ndtrain.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "DistributedSampler", "TokenWindows", "eval_shard", "load_corpus"]
