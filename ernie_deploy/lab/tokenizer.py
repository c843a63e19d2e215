"""A tokenizer for serving ERNIE-4.5 with random weights on real vLLM, made here (no hub).

Its vocabulary has exactly the model's `vocab_size` entries: with random weights the model samples ids from
the whole vocabulary, and a tokenizer much smaller than 103,424 cannot decode most of them, so completions
came back as empty text (measured, docs/lab.md). A word-level vocabulary of made-up syllable words gives
every id a printable word; the files are what `transformers` loads as a PreTrainedTokenizerFast.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: ERNIE-4.5's pad (0), bos (1) and eos (2) ids
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwxyz" for v in "aeiou"]


def _words() -> Iterator[str]:
    for length in itertools.count(1):
        for parts in itertools.product(_SYLLABLES, repeat=length):
            yield "".join(parts)


def tokenizer_files(vocab_size: int) -> dict[str, str]:
    """`tokenizer.json` and `tokenizer_config.json` for a vocabulary of `vocab_size` ids (deterministic)."""
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for word in itertools.islice(_words(), vocab_size - len(SPECIAL)):
        vocab[word] = len(vocab)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                 "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": SPECIAL[0]}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIAL[0], "bos_token": SPECIAL[1],
              "eos_token": SPECIAL[2], "pad_token": SPECIAL[0], "model_max_length": 131072}
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def write_tokenizer(model_dir: Path) -> None:
    """Write the tokenizer for the model whose config.json is in `model_dir` (rewritten only when changed)."""
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    for name, text in tokenizer_files(vocab_size).items():
        path = model_dir / name
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.rename(path)
