"""The tokenizer half of a Hugging Face export.

A run's tokenizer is the `tokenizer.json` of the prepared dataset it trained on. An export writes
it as a `transformers` fast tokenizer next to the weights, so `AutoTokenizer.from_pretrained` and
`pipeline("text-generation", ...)` work on the export directory as they do on a hub model.
"""

from __future__ import annotations

from pathlib import Path

from trinity_train.config import DataConfig
from trinity_train.data.loader import dataset_dirs
from trinity_train.data.shards import TOKENIZER_FILE
from trinity_train.data.tokenizer import PAD_TOKEN, find_eos_id, load_tokenizer
from trinity_train.errors import CheckpointError


def training_tokenizer_file(data_cfg: DataConfig) -> Path | None:
    """The tokenizer.json the run's data was prepared with, if it is still where the config says
    (relative data paths are read from the current directory, as the trainer reads them)."""
    for directory in dataset_dirs(data_cfg, build_default=False):  # a mix shares one tokenizer
        candidate = directory / TOKENIZER_FILE
        if candidate.is_file():
            return candidate
    return None


def write_hf_tokenizer(tokenizer_file: Path, out_dir: Path, model_vocab_size: int) -> dict[str, int]:
    """Write `tokenizer_file` into `out_dir` as a fast tokenizer; returns the special-token ids
    for the model's config.json."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = load_tokenizer(tokenizer_file)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > model_vocab_size:
        raise CheckpointError(f"tokenizer '{tokenizer_file}' has {vocab} tokens but the model's vocabulary "
                              f"is {model_vocab_size}: export the tokenizer the run trained with")
    eos_token, eos_id = find_eos_id(tokenizer)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token,
                                   pad_token=PAD_TOKEN if pad_id is not None else None)
    fast.save_pretrained(out_dir)
    ids = {"eos_token_id": eos_id}
    if pad_id is not None:
        ids["pad_token_id"] = pad_id
    return ids
