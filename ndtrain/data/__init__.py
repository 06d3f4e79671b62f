"""Data: tokenizers, document sources, fine-tuning records (sft.py), token files with a deterministic
train/val split and their fingerprint (identity.py), samples and samplers, the digits images. Imports `config`, `errors` and
`eval`'s labelled sets (digits): no strategy, model or run."""

from ndtrain.data.corpus import Corpus, TokenWindows, load_corpus
from ndtrain.data.prepare import TokenData, check_data, prepare_data
from ndtrain.data.sampler import DistributedSampler, eval_shard
from ndtrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "Corpus", "DistributedSampler", "HFTokenizer", "TokenData", "TokenWindows", "check_data",
           "eval_shard", "load_corpus", "load_tokenizer", "prepare_data"]
