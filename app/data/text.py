"""Text -> integer token ids, and a seeded generated text corpus for tests and demos.

The tokenizer is the hashing trick: lower-case, split into word tokens, and
map each token to ``1 + crc32(token) % (vocab_size - 1)``; id 0 is padding.
Why hashing rather than a vocabulary built in a first pass:

- it needs no pass over the data and no vocabulary file shipped to every
  worker: a Ray Data task can tokenize any block on its own, in any order,
  which is what streaming a dataset larger than memory needs;
- it is deterministic across processes and machines (crc32, unlike Python's
  salted ``hash``), so the same text gives the same ids on every worker and
  in every epoch;
- the cost is collisions: two words may share an id. With a vocabulary a few
  times larger than the number of distinct words that matter, that costs
  little accuracy (Weinberger et al. 2009); raise --vocab-size if it does.

Ids are carried as float32 like every other feature (one input signature for
all models; exact for ids below 2**24, which the config enforces) and the
transformer casts them back to integers.

No text corpus ships inside the installed packages (20 newsgroups and IMDB
are downloads), and nothing may be downloaded at run time, so the
built-in text dataset is generated: ``synthetic_corpus``.
"""

from __future__ import annotations

import re
import zlib
from typing import Iterable

import numpy as np

_WORD = re.compile(r"[a-z0-9']+")


def tokenize(texts: Iterable[str | None], vocab_size: int, sequence_length: int) -> np.ndarray:
    """(n, sequence_length) float32 token ids: truncated or padded with 0 at the end."""
    texts = list(texts)
    out = np.zeros((len(texts), sequence_length), dtype=np.float32)
    buckets = vocab_size - 1
    for i, text in enumerate(texts):
        words = _WORD.findall(text.lower())[:sequence_length] if text else []
        out[i, : len(words)] = [1 + zlib.crc32(w.encode()) % buckets for w in words]
    return out


def synthetic_corpus(rows: int, classes: int, seed: int, words_per_text: int = 24) -> tuple[list[str], np.ndarray]:
    """Seeded labelled sentences: mostly shared filler words, plus a few words typical of the class.

    Learnable but not in one step: a text shows only ~1 in 4 words from its
    class's topic list, the rest are shared, so the model must learn which
    words matter (word order carries no signal: a bag-of-words task that a
    transformer solves with its attention pooling).
    """
    rng = np.random.default_rng(seed + 2)
    filler = [f"word{i}" for i in range(200)]
    topics = [[f"topic{c}x{j}" for j in range(12)] for c in range(classes)]
    y = rng.integers(0, classes, size=rows, dtype=np.int64)
    texts = []
    for label in y:
        is_topic = rng.random(words_per_text) < 0.25
        words = [
            topics[label][rng.integers(12)] if t else filler[rng.integers(len(filler))] for t in is_topic
        ]
        texts.append(" ".join(words))
    return texts, y
