"""File-based datasets, read from a local directory (never downloaded).

* **CIFAR-10/100** in the standard "python version" layout: ``data_batch_1..5`` + ``test_batch``
  (CIFAR-10) or ``train`` + ``test`` (CIFAR-100, ``fine_labels``), either directly in ``data_dir`` or in
  its ``cifar-10-batches-py`` / ``cifar-100-python`` sub-folder. These files are pickles; they are read
  with a restricted unpickler that only admits plain containers and NumPy array reconstruction, so a
  malicious file cannot run code.
* **Image folder** (face data such as Lacuna): one sub-folder per class/identity holding image files.
  If ``data_dir`` has ``train/`` and ``test/`` sub-folders they are used as the pools; otherwise every
  class's images are split deterministically (sorted names; every 5th image → test). Images are
  converted to RGB and resized to 32×32.

Inputs are float32 (n, 3, 32, 32), standardised per channel with the training pool's mean and std.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import torch

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
    ("__builtin__", "object"), ("builtins", "object"), ("_codecs", "encode"),  # bytes in protocol-2 pickles
}


class DataFormatError(ValueError):
    """A data directory that is not in the expected format."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise DataFormatError(f"refusing to load {module}.{name} from a data file: not a CIFAR batch")


def safe_load_batch(path: Path) -> dict:
    """Read one CIFAR python batch with the restricted unpickler; keys decoded to ``str``."""
    try:
        with open(path, "rb") as f:
            d = _RestrictedUnpickler(f, encoding="bytes").load()
    except DataFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure means the wrong format
        raise DataFormatError(f"{path} is not a CIFAR python batch: {e}") from None
    if not isinstance(d, dict):
        raise DataFormatError(f"{path} is not a CIFAR python batch (no dict inside)")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}


def _standardise(x: np.ndarray, xt: np.ndarray):
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    sd = x.std(axis=(0, 2, 3), keepdims=True) + 1e-8
    return torch.from_numpy(((x - mu) / sd).astype(np.float32)), torch.from_numpy(((xt - mu) / sd).astype(np.float32))


def load_cifar(data_dir: str | Path, name: str = "cifar10"):
    """(x_train, y_train, x_test, y_test) of CIFAR-10 or CIFAR-100 from the python batches."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataFormatError(f"data directory not found: {root}")
    sub = root / ("cifar-10-batches-py" if name == "cifar10" else "cifar-100-python")
    if sub.is_dir():
        root = sub
    if name == "cifar10":
        train_files, test_files, key = [root / f"data_batch_{i}" for i in range(1, 6)], [root / "test_batch"], "labels"
        train_files = [p for p in train_files if p.is_file()]
        if not train_files:
            raise DataFormatError(f"{data_dir}: no data_batch_1..5 files (CIFAR-10 python format expected)")
    else:
        train_files, test_files, key = [root / "train"], [root / "test"], "fine_labels"
    missing = [p.name for p in train_files + test_files if not p.is_file()]
    if missing:
        raise DataFormatError(f"{data_dir}: missing {', '.join(missing)} ({name} python format expected)")

    def read(files):
        xs, ys = [], []
        for p in files:
            d = safe_load_batch(p)
            if "data" not in d or key not in d:
                raise DataFormatError(f"{p} lacks 'data' or '{key}': not a {name} python batch")
            data = np.asarray(d["data"], dtype=np.uint8)
            if data.ndim != 2 or data.shape[1] != 3072:
                raise DataFormatError(f"{p}: data has shape {data.shape}, expected (n, 3072)")
            xs.append(data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
            ys.append(np.asarray(d[key], dtype=np.int64))
        return np.concatenate(xs), np.concatenate(ys)

    x, y = read(train_files)
    xt, yt = read(test_files)
    xs, xts = _standardise(x, xt)
    return xs, torch.from_numpy(y), xts, torch.from_numpy(yt)


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".webp"}


def _read_class_dirs(root: Path) -> dict[str, list[Path]]:
    """Every class folder (hidden ones excluded) with its image files; a folder without images is kept (with
    an empty list) so that it still takes its place in the label order."""
    classes = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        classes[d.name] = sorted(f for f in d.iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES)
    return classes


def _load_images(files: list[Path], size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(files), 3, size, size), dtype=np.float32)
    for i, f in enumerate(files):
        try:
            with Image.open(f) as im:
                arr = np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32) / 255.0
        except (UnidentifiedImageError, OSError) as e:
            raise DataFormatError(f"cannot read image {f}: {e}") from None
        out[i] = arr.transpose(2, 0, 1)
    return out


def load_image_folder(data_dir: str | Path, size: int = 32, test_every: int = 5):
    """(x_train, y_train, x_test, y_test) from one folder per class. Label = position of the folder in the
    sorted list of *all* class folders, empty ones included: a folder without images never shifts the labels
    of the others (its class just has no samples, which the split rule then reports if it needs them)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataFormatError(f"data directory not found: {root}")
    if (root / "train").is_dir() and (root / "test").is_dir():
        tr, te = _read_class_dirs(root / "train"), _read_class_dirs(root / "test")
        names = sorted(set(tr) | set(te))
        train_files = [(f, names.index(c)) for c in tr for f in tr[c]]
        test_files = [(f, names.index(c)) for c in te for f in te[c]]
    else:
        cls = _read_class_dirs(root)
        names = sorted(cls)
        train_files, test_files = [], []
        for c in names:
            for i, f in enumerate(cls[c]):
                (test_files if i % test_every == test_every - 1 else train_files).append((f, names.index(c)))
    if len(names) < 2 or not train_files or not test_files:
        raise DataFormatError(f"{data_dir}: expected one sub-folder of images per class (at least two classes, "
                              f"with enough images for a train and a test pool)")
    x = _load_images([f for f, _ in train_files], size)
    xt = _load_images([f for f, _ in test_files], size)
    xs, xts = _standardise(x, xt)
    return (xs, torch.as_tensor([c for _, c in train_files], dtype=torch.long),
            xts, torch.as_tensor([c for _, c in test_files], dtype=torch.long))


def write_cifar_batch(path: str | Path, data: np.ndarray, labels, key: str = "labels") -> None:
    """Write a CIFAR-format python batch (for fixtures): ``data`` uint8 (n, 3072)."""
    buf = io.BytesIO()
    pickle.dump({b"data": np.asarray(data, dtype=np.uint8), key.encode(): list(map(int, labels))}, buf, protocol=2)
    Path(path).write_bytes(buf.getvalue())
