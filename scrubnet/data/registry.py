"""Build a :class:`Split` by dataset name, with the papers' default split for each dataset."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from scrubnet._config import strict_from_dict
from scrubnet.data import files
from scrubnet.data.embedded import digits_pools, mnist1d_pools
from scrubnet.data.splits import Split, make_split

DATASETS = ("mnist1d", "digits", "cifar10", "cifar100", "imagefolder")


@dataclass
class DataConfig:
    """Which data and which split. Classes are given in the dataset's own labels; ``forget_class`` in
    task indexing (0 = first task class). Defaults: the embedded MNIST-1D experiment (README, "The embedded
    default experiment")."""

    dataset: str = "mnist1d"
    data_dir: str | None = None
    core_classes: list[int] = field(default_factory=lambda: [5, 6, 7, 8, 9])
    task_classes: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    n_train_per_class: int = 100
    n_test_per_class: int = 100
    core_per_class: int | None = None
    forget_class: int | None = 0
    forget_count: int | None = 25
    forget_ids: list[int] | None = None
    data_seed: int = 0            # fixes which samples enter D, D_test, core and D_f
    num_samples: int = 8000       # MNIST-1D generator pool size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, prefix: str = "") -> "DataConfig":
        """Checked: types as annotated, and the ranges of :data:`DATA_RANGES`."""
        return strict_from_dict(cls, d, "data", prefix, DATA_RANGES)


#: allowed ranges of the :class:`DataConfig` values
DATA_RANGES = {"core_classes": ">= 0", "task_classes": ">= 0", "n_train_per_class": ">= 1",
               "n_test_per_class": ">= 1", "core_per_class": ">= 1", "forget_class": ">= 0", "forget_count": ">= 1",
               "forget_ids": ">= 0", "data_seed": ">= 0", "num_samples": ">= 1"}


def load_pools(cfg: DataConfig):
    """(x_train, y_train, x_test, y_test) pools for ``cfg.dataset``."""
    name = cfg.dataset
    if name == "mnist1d":
        return mnist1d_pools(cfg.num_samples)
    if name == "digits":
        return digits_pools()
    if name in ("cifar10", "cifar100", "imagefolder"):
        if not cfg.data_dir:
            raise ValueError(f"dataset {name!r} needs --data-dir pointing at its files")
        if name == "imagefolder":
            return files.load_image_folder(cfg.data_dir)
        return files.load_cifar(cfg.data_dir, name)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def load_split(cfg: DataConfig) -> Split:
    """Load the pools and apply the split rule of :func:`scrubnet.data.splits.make_split`."""
    x, y, xt, yt = load_pools(cfg)
    fc, fn, fids = cfg.forget_class, cfg.forget_count, cfg.forget_ids
    if fids is not None:
        fc = fn = None
    return make_split(x, y, xt, yt, core_classes=cfg.core_classes, task_classes=cfg.task_classes,
                      n_train_per_class=cfg.n_train_per_class, n_test_per_class=cfg.n_test_per_class,
                      core_per_class=cfg.core_per_class, forget_class=fc, forget_count=fn, forget_ids=fids,
                      seed=cfg.data_seed, name=cfg.dataset)
