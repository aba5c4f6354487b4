"""The user's own data, from the command line: an ``.npz`` file or an image folder.

**.npz** (``numpy.savez``): arrays ``x_train`` (n, ...) and ``y_train`` (n,), optionally ``x_test`` and
``y_test`` (both or neither). A causal language model's labels may be token labels of the shape of
``x_train`` (n, T): the answer tokens, −100 where no loss is taken. Further model inputs are named arrays ``train_<name>`` (n, ...) — and
``test_<name>`` when there is a test set, for the same names — passed to the model as the keyword argument
``<name>`` (e.g. ``x_train`` = token ids, ``train_attention_mask``, ``train_token_type_ids``; the model is
called as ``model(x, attention_mask=..., token_type_ids=...)``). No other array is accepted. Floating arrays
are given to the model as float32; integer arrays keep their dtype (token ids stay int64; unsigned types
wider than 8 bits become int64) and boolean extras stay boolean; nothing is scaled or standardised: store
the inputs the way the model was trained on them. Labels must be an integer array. The file is read with
``allow_pickle=False``.

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
from scrubnet.models.call import Inputs, ModelInputs

NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


class UserDataError(ValueError):
    """Data that is not in the documented format (message names the array and the problem)."""


@dataclass
class UserData:
    """Training data D (``x``, ``y``) and an optional test set; ``fingerprint`` identifies the arrays."""

    x: Inputs
    y: Tensor
    x_test: Inputs | None
    y_test: Tensor | None
    fingerprint: str
    source: str

    def check_labels(self, num_classes: int) -> None:
        """Refuse labels outside [0, num_classes) (``num_classes``: the model's outputs)."""
        for name, y in (("y_train", self.y), ("y_test", self.y_test)):
            if y is None or len(y) == 0:
                continue
            if y.dim() == 2:  # token labels: -100 marks the positions without a loss
                y = y[y != -100]
                if len(y) == 0:
                    raise UserDataError(f"{self.source}: {name} holds no answer token (every label is -100)")
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


def _as_tensor(a: np.ndarray, name: str, source: str, main: bool) -> Tensor:
    """An input array as the model gets it: float32 for floats (and a boolean main input), integers kept."""
    if a.dtype.kind not in "fiub":
        raise UserDataError(f"{source}: {name} must be a numeric array, got dtype {a.dtype}")
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f" or (a.dtype.kind == "b" and main):
        t = torch.from_numpy(a.astype(np.float32, copy=False))
        if not bool(torch.isfinite(t).all()):
            raise UserDataError(f"{source}: {name} contains non-finite values (NaN or inf)")
        return t
    if a.dtype.kind == "u" and a.dtype.itemsize > 1:
        a = a.astype(np.int64)
    return torch.from_numpy(a)


def _check_pair(x: np.ndarray, y: np.ndarray, xs: str, ys: str, source: str,
                extras: dict[str, np.ndarray] | None = None) -> tuple[Inputs, Tensor]:
    if x.dtype.kind not in "fiub" or x.ndim < 2:
        raise UserDataError(f"{source}: {xs} must be a numeric array of shape (n, ...), got dtype {x.dtype} "
                            f"and shape {x.shape}")
    if y.ndim == 2 and x.ndim == 2 and y.shape == x.shape:
        pass  # token labels of a causal LM: the answer tokens, -100 where no loss
    elif y.ndim != 1:
        raise UserDataError(f"{source}: {ys} must have shape (n,) (or, token labels of a causal LM, the shape of "
                            f"{xs}), got {y.shape}")
    if y.dtype.kind not in "iu":
        raise UserDataError(f"{source}: {ys} must hold integer class labels, got dtype {y.dtype} "
                            "(store them with .astype('int64'))")
    if len(x) != len(y):
        raise UserDataError(f"{source}: {xs} holds {len(x)} samples, {ys} {len(y)} labels")
    xt = _as_tensor(x, xs, source, main=True)
    ex = {}
    for name, a in (extras or {}).items():
        if a.ndim < 1 or len(a) != len(x):
            raise UserDataError(f"{source}: {xs.split('_')[1]}_{name} holds "
                                f"{len(a) if a.ndim else 'no'} samples, {xs} {len(x)}")
        ex[name] = _as_tensor(a, f"{xs.split('_')[1]}_{name}", source, main=False)
    return (ModelInputs(xt, ex) if ex else xt), torch.from_numpy(y.astype(np.int64))


def _extra_names(names: list[str], path: Path) -> tuple[list[str], list[str]]:
    """(train extras, test extras) named ``train_<name>`` / ``test_<name>``; anything else is refused."""
    other = sorted(set(names) - set(NPZ_ARRAYS))
    bad = [k for k in other if not (k.startswith(("train_", "test_")) and k.split("_", 1)[1].isidentifier())]
    if bad:
        raise UserDataError(f"{path}: unexpected array(s) {', '.join(bad)}; the file holds x_train, y_train, "
                            "optionally x_test, y_test, and further model inputs as train_<name> (and "
                            "test_<name>), e.g. train_attention_mask")
    train = [k.split("_", 1)[1] for k in other if k.startswith("train_")]
    test = [k.split("_", 1)[1] for k in other if k.startswith("test_")]
    return train, test


def load_npz(path: Path) -> UserData:
    try:
        with np.load(path, allow_pickle=False) as f:
            names = list(f.files)
            train_ex, test_ex = _extra_names(names, path)
            order = [k for k in NPZ_ARRAYS if k in names] + [f"train_{k}" for k in train_ex] + \
                [f"test_{k}" for k in test_ex]
            arrays = {k: f[k] for k in order}
    except UserDataError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise UserDataError(f"{path} is not a readable .npz file (numpy.savez, no pickled objects): {e}") from None
    for k in ("x_train", "y_train"):
        if k not in arrays:
            raise UserDataError(f"{path} has no array {k!r} (it holds {', '.join(names) or 'nothing'})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise UserDataError(f"{path}: give both x_test and y_test, or neither")
    if test_ex and "x_test" not in arrays:
        raise UserDataError(f"{path}: test_{test_ex[0]} is given without x_test and y_test")
    if "x_test" in arrays and sorted(train_ex) != sorted(test_ex):
        raise UserDataError(f"{path}: the extra inputs of the training set ({', '.join(train_ex) or 'none'}) "
                            f"and of the test set ({', '.join(test_ex) or 'none'}) differ: give train_<name> "
                            "and test_<name> for the same names")
    x, y = _check_pair(arrays["x_train"], arrays["y_train"], "x_train", "y_train", str(path),
                       {k: arrays[f"train_{k}"] for k in train_ex})
    if len(y) < 2:
        raise UserDataError(f"{path}: x_train holds {len(y)} sample(s); at least 2 are needed")
    xt = yt = None
    if "x_test" in arrays:
        xt, yt = _check_pair(arrays["x_test"], arrays["y_test"], "x_test", "y_test", str(path),
                             {k: arrays[f"test_{k}"] for k in train_ex})
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
