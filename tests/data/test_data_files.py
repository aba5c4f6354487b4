import numpy as np
import pytest
import torch

from scrubnet.data.files import DataFormatError, load_cifar, load_image_folder, safe_load_batch, write_cifar_batch
from scrubnet.data.registry import DataConfig, load_split


def _cifar_dir(tmp_path, n=30):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        write_cifar_batch(d / f"data_batch_{i}", rng.integers(0, 256, (n, 3072)), np.arange(n) % 10)
    write_cifar_batch(d / "test_batch", rng.integers(0, 256, (n, 3072)), np.arange(n) % 10)
    return tmp_path


def test_cifar_python_batches(tmp_path):
    root = _cifar_dir(tmp_path)
    x, y, xt, yt = load_cifar(root)
    assert x.shape == (150, 3, 32, 32) and xt.shape == (30, 3, 32, 32)
    assert torch.equal(y[:10], torch.arange(10))
    # standardised per channel on the training pool
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    s = load_split(DataConfig(dataset="cifar10", data_dir=str(root), core_classes=[5, 6], task_classes=[0, 1],
                              n_train_per_class=10, n_test_per_class=3, forget_class=0, forget_count=2))
    assert s.x.shape == (20, 3, 32, 32) and len(s.y_core) == 30 and len(s.forget_idx) == 2


def test_cifar_refuses_code_in_pickles(tmp_path):
    import pickle
    p = tmp_path / "evil"
    p.write_bytes(pickle.dumps(print))
    with pytest.raises(DataFormatError, match="refusing"):
        safe_load_batch(p)


def test_image_folder(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in ("alice", "bob", "carol"):
        (tmp_path / c).mkdir()
        for i in range(5):
            arr = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / c / f"{i}.png")
    x, y, xt, yt = load_image_folder(tmp_path)
    assert x.shape == (12, 3, 32, 32) and xt.shape == (3, 3, 32, 32)
    assert y.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and yt.tolist() == [0, 1, 2]
    (tmp_path / "alice" / "broken.png").write_bytes(b"no image")
    with pytest.raises(DataFormatError, match="cannot read image"):
        load_image_folder(tmp_path)


def test_image_folder_wrong_layout(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    with pytest.raises(DataFormatError, match="one sub-folder"):
        load_image_folder(tmp_path)
