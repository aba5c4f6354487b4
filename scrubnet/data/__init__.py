"""Datasets and the core / D / D_r / D_f / D_test split rule."""
from scrubnet.data.splits import Split, SplitError, make_split, select_forget, validate_forget_ids
from scrubnet.data.registry import DATASETS, DataConfig, load_split

__all__ = ["Split", "SplitError", "make_split", "select_forget", "validate_forget_ids", "DATASETS", "DataConfig",
           "load_split"]
