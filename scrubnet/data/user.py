"""The user's own data, from the command line: an ``.npz`` file or an image folder.

**.npz** (``numpy.savez``): arrays ``x_train`` (n, ...) and ``y_train`` (n,), optionally ``x_test`` and
``y_test`` (both or neither); no other array. Inputs are given to the model as float32, as stored (no
scaling, no standardisation: store them the way the model was trained on them); labels must be an integer
array. The file is read with ``allow_pickle=False``.

**Image folder**: one sub-folder per class (:func:`scrubnet.data.files.load_image_folder`: RGB, 32×32,
standardised per channel; ``train/`` and ``test/`` sub-folders are used when present).

Checks on entry: equal lengths, at least two training samples, finite inputs, integer labels in
[0, num_classes) once the model's number of outputs is known (:meth:`UserData.check_labels`). Forget ids
are positions in ``x_train``.
"""
from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from scrubnet.data.files import load_image_folder

NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


class UserDataError(ValueError):
    """Data that is not in the documented format (message names the array and the problem)."""


@dataclass
class UserData:
    """Training data D (``x``, ``y``) and an optional test set; ``fingerprint`` identifies the arrays."""

    x: Tensor
    y: Tensor
    x_test: Tensor | None
    y_test: Tensor | None
    fingerprint: str
    source: str

    def check_labels(self, num_classes: int) -> None:
        """Refuse labels outside [0, num_classes) (``num_classes``: the model's outputs)."""
        for name, y in (("y_train", self.y), ("y_test", self.y_test)):
            if y is None or len(y) == 0:
                continue
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= num_classes:
                raise UserDataError(f"{self.source}: {name} holds labels in [{lo}, {hi}], the model has "
                                    f"{num_classes} outputs (labels must lie in [0, {num_classes}))")


def arrays_fingerprint(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over each array's name, dtype, shape and bytes, in the given order."""
    h = hashlib.sha256()
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _check_pair(x: np.ndarray, y: np.ndarray, xs: str, ys: str, source: str) -> tuple[Tensor, Tensor]:
    if x.dtype.kind not in "fiub" or x.ndim < 2:
        raise UserDataError(f"{source}: {xs} must be a numeric array of shape (n, ...), got dtype {x.dtype} "
                            f"and shape {x.shape}")
    if y.ndim != 1:
        raise UserDataError(f"{source}: {ys} must have shape (n,), got {y.shape}")
    if y.dtype.kind not in "iu":
        raise UserDataError(f"{source}: {ys} must hold integer class labels, got dtype {y.dtype} "
                            "(store them with .astype('int64'))")
    if len(x) != len(y):
        raise UserDataError(f"{source}: {xs} holds {len(x)} samples, {ys} {len(y)} labels")
    xt = torch.from_numpy(np.ascontiguousarray(x).astype(np.float32, copy=False))
    if not bool(torch.isfinite(xt).all()):
        raise UserDataError(f"{source}: {xs} contains non-finite values (NaN or inf)")
    return xt, torch.from_numpy(y.astype(np.int64))


def load_npz(path: Path) -> UserData:
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            extra = sorted(set(names) - set(NPZ_ARRAYS))
            if extra:
                raise UserDataError(f"{path}: unexpected array(s) {', '.join(extra)}; the file holds x_train, "
                                    "y_train and optionally x_test, y_test")
            arrays = {k: f[k] for k in NPZ_ARRAYS if k in names}
    except UserDataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise UserDataError(f"{path} is not a readable .npz file (numpy.savez, no pickled objects): {e}") from None
    for k in ("x_train", "y_train"):
        if k not in arrays:
            raise UserDataError(f"{path} has no array {k!r} (it holds {', '.join(names) or 'nothing'})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise UserDataError(f"{path}: give both x_test and y_test, or neither")
    x, y = _check_pair(arrays["x_train"], arrays["y_train"], "x_train", "y_train", str(path))
    if len(y) < 2:
        raise UserDataError(f"{path}: x_train holds {len(y)} sample(s); at least 2 are needed")
    xt = yt = None
    if "x_test" in arrays:
        xt, yt = _check_pair(arrays["x_test"], arrays["y_test"], "x_test", "y_test", str(path))
        if xt.shape[1:] != x.shape[1:]:
            raise UserDataError(f"{path}: x_test samples have shape {tuple(xt.shape[1:])}, x_train samples "
                                f"{tuple(x.shape[1:])}")
    return UserData(x, y, xt, yt, arrays_fingerprint(arrays), str(path))


def load_user_data(path: str | Path) -> UserData:
    """An ``.npz`` file or an image folder (module docstring)."""
    path = Path(path)
    if path.is_dir():
        x, y, xt, yt = load_image_folder(path)
        arrays = {"x_train": x.numpy(), "y_train": y.numpy(), "x_test": xt.numpy(), "y_test": yt.numpy()}
        return UserData(x, y, xt, yt, arrays_fingerprint(arrays), str(path))
    if not path.is_file():
        raise UserDataError(f"data not found: {path} (give an .npz file or an image folder)")
    return load_npz(path)
