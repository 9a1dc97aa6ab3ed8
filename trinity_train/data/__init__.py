"""Data: `prepare-data` (documents -> token shards) and the deterministic data-parallel loader."""

from trinity_train.data.default_corpus import default_dataset
from trinity_train.data.ledger import SkipLedger
from trinity_train.data.loader import Batch, TrainLoader, ValidationLoader, build_loaders
from trinity_train.errors import DataError

__all__ = ["default_dataset", "build_loaders", "Batch", "TrainLoader", "ValidationLoader", "SkipLedger",
           "DataError"]
