"""The tokenizer side of data preparation: train a byte-level BPE, or load a tokenizer.json."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trinity_train.errors import DataError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MIN_BPE_VOCAB = 256 + 2  # every byte, EOS and PAD
# Tried in order when a user-supplied tokenizer does not name its end-of-document token.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


def train_byte_level_bpe(text_batches: Iterable[list[str]], vocab_size: int,
                         num_documents: int | None = None) -> Tokenizer:
    """A GPT-2-style byte-level BPE: every byte is a token, so no text is ever out of vocabulary."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = [EOS_TOKEN, PAD_TOKEN]
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"a byte-level BPE needs a vocabulary of at least {MIN_BPE_VOCAB} "
                        f"(bytes plus specials), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(_texts(text_batches), trainer, length=num_documents)
    return tokenizer


def _texts(batches: Iterable[list[str]]) -> Iterator[str]:
    for batch in batches:
        yield from batch


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer file '{path}' does not exist; pass a tokenizer.json, "
                        "or --train-tokenizer VOCAB to train one on the input")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for any unreadable file
        raise DataError(f"'{path}' is not a `tokenizers` tokenizer.json ({e})") from None


def find_eos_id(tokenizer: Tokenizer, eos_token: str | None = None) -> tuple[str, int]:
    """The end-of-document token appended to every document, and its id."""
    candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    if eos_token:
        raise DataError(f"the tokenizer has no token '{eos_token}'; pass --eos-token with one it has")
    raise DataError(f"the tokenizer has none of the usual end-of-document tokens "
                    f"({', '.join(_EOS_CANDIDATES)}); name its EOS token with --eos-token")


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """One more than the largest id: what the token dtype and the embedding must hold (ids may have gaps)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
