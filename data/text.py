"""A word-level text tokenizer for the synthetic VLM tasks, built offline with Hugging Face ``tokenizers``.

The tasks have small closed vocabularies (questions plus one-word answers used as exact-match targets),
so a word-level model is exact and tiny: text is lower-cased, NFKC-normalised and split into words and
punctuation (``tokenizers.pre_tokenizers.Whitespace``: ``\\w+|[^\\w\\s]+``); each piece is one id. The
special tokens follow Qwen2-VL's names for the vision placeholders so that batches read like the
Hugging Face processor's output:

====================  ==  =================================================
``<pad>``             0   padding (``attention_mask`` 0, ``labels`` -100)
``<unk>``             1   never produced by ``encode`` (unknown words raise)
``<bos>``             2   start of every sequence
``<eos>``             3   end of the answer (a target, so the model learns to stop)
``<|vision_start|>``  4   before each image / video block
``<|vision_end|>``    5   after each block
``<|image_pad|>``     6   one per merged image patch
``<|video_pad|>``     7   one per merged video patch
====================  ==  =================================================

Word ids follow, sorted alphabetically, so the ids depend only on the set of words.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["SPECIAL_TOKENS", "WordTokenizer", "build_tokenizer"]

SPECIAL_TOKENS = (
    "<pad>",
    "<unk>",
    "<bos>",
    "<eos>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # pragma: no cover
        raise ImportError(
            "the text tokenizer needs `tokenizers`; install it with: pip install tokenizers==0.23.3"
        ) from err
    return tokenizers


def _pipeline(vocab: dict[str, int]):
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = tk.normalizers.Sequence([tk.normalizers.NFKC(), tk.normalizers.Lowercase()])
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


class WordTokenizer:
    """Word-level tokenizer over a closed vocabulary (a ``tokenizers.Tokenizer`` inside; picklable).

    ``encode(text)`` returns the word ids without special tokens and raises ValueError on a word outside
    the vocabulary (exact-match targets must never silently become ``<unk>``); ``decode(ids)`` joins the
    words with spaces, dropping special tokens unless asked.
    """

    def __init__(self, words: Iterable[str]):
        words = sorted({w for w in words} - set(SPECIAL_TOKENS))
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        vocab.update({w: len(SPECIAL_TOKENS) + i for i, w in enumerate(words)})
        self.words = tuple(words)
        self._vocab = vocab
        self._tok = _pipeline(vocab)
        self._id_to_token = {i: t for t, i in vocab.items()}
        for name in ("pad", "unk", "bos", "eos"):
            setattr(self, f"{name}_id", vocab[f"<{name}>"])
        self._cache: dict[str, tuple[int, ...]] = {}  # task texts repeat: encode each once
        self.vision_start_id = vocab["<|vision_start|>"]
        self.vision_end_id = vocab["<|vision_end|>"]
        self.image_token_id = vocab["<|image_pad|>"]
        self.video_token_id = vocab["<|video_pad|>"]

    # pickling: rebuild the Rust object from the word list
    def __getstate__(self) -> dict:
        return {"words": self.words}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["words"])

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def __len__(self) -> int:
        return self.vocab_size

    def split(self, text: str) -> list[str]:
        """The normalised words and punctuation pieces of ``text``."""
        normalized = self._tok.normalizer.normalize_str(text)
        return [piece for piece, _ in self._tok.pre_tokenizer.pre_tokenize_str(normalized)]

    def encode(self, text: str) -> list[int]:
        hit = self._cache.get(text)
        if hit is not None:
            return list(hit)
        enc = self._tok.encode(text, add_special_tokens=False)
        if self.unk_id in enc.ids:
            pieces = [p for p in self.split(text) if p not in self._vocab] or ["<unk>"]
            raise ValueError(
                f"words {pieces} of {text!r} are not in the tokenizer's vocabulary; "
                "build the tokenizer from texts that include them"
            )
        if len(self._cache) < 65536:
            self._cache[text] = tuple(enc.ids)
        return list(enc.ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i not in self._id_to_token]
        if bad:
            raise ValueError(f"ids {bad} are outside the vocabulary (size {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i >= len(SPECIAL_TOKENS)]
        return " ".join(self._id_to_token[i] for i in ids)

    def token_to_id(self, token: str) -> int:
        if token not in self._vocab:
            raise ValueError(f"{token!r} is not in the vocabulary")
        return self._vocab[token]

    def id_to_token(self, i: int) -> str:
        return self._id_to_token[int(i)]

    def to_tokenizers(self):
        """The underlying ``tokenizers.Tokenizer`` (e.g. to wrap in ``transformers.PreTrainedTokenizerFast``)."""
        return self._tok

    def save(self, path: str | os.PathLike) -> Path:
        """Write the word list as JSON (the ids are a pure function of it)."""
        path = Path(path)
        path.write_text(json.dumps({"words": list(self.words)}, indent=0))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WordTokenizer":
        return cls(json.loads(Path(path).read_text())["words"])


def build_tokenizer(texts: Iterable[str]) -> WordTokenizer:
    """A :class:`WordTokenizer` whose vocabulary is every word and punctuation piece of ``texts``."""
    probe = WordTokenizer(())
    words: set[str] = set()
    for text in texts:
        words.update(probe.split(text))
    if not words:
        raise ValueError("build_tokenizer needs at least one non-empty text")
    return WordTokenizer(words)
