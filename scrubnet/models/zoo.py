"""Architectures of the papers, sized for small inputs.

* ``MLP`` — d-256-256-c (ReLU), the default on MNIST-1D.
* ``CNN1D`` — three 1-D conv layers (BatchNorm before ReLU) + global average pooling, for MNIST-1D.
* ``CNN2D`` — small 2-D CNN with BatchNorm (digits 8×8, or 32×32 images).
* ``AllCNN`` — the All-CNN of the papers, BatchNorm before every non-linearity, with a width multiplier.
* ``ResNet18`` — CIFAR ResNet-18 (3×3 stem, no max-pool) with a width multiplier (0.4 = the authors').
"""
from __future__ import annotations

import torch
from torch import nn


class _EvalMode:
    """Context manager: put a module in eval mode and restore its previous train/eval flags afterwards."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        return self.model

    def __exit__(self, *exc):
        for m, flag in self.flags:
            m.training = flag
        return False


def eval_mode(model: nn.Module) -> _EvalMode:
    """``with eval_mode(model): ...`` runs the block with every submodule in eval mode, then restores them."""
    return _EvalMode(model)


class MLP(nn.Module):
    def __init__(self, in_shape, num_classes: int, hidden: int = 256, depth: int = 2, act: str = "relu"):
        super().__init__()
        d = 1
        for s in in_shape:
            d *= int(s)
        layers: list[nn.Module] = [nn.Flatten()]
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), _act(act)]
            d = hidden
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(d, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def _act(name: str) -> nn.Module:
    if name == "relu":
        return nn.ReLU()
    if name == "leaky_relu":
        return nn.LeakyReLU(0.01)
    raise ValueError(f"unknown activation {name!r}")


class CNN1D(nn.Module):
    def __init__(self, in_shape, num_classes: int, channels: int = 32):
        super().__init__()
        in_ch = 1 if len(in_shape) == 1 else int(in_shape[0])
        c = channels
        self.features = nn.Sequential(
            nn.Conv1d(in_ch, c, 5, padding=2), nn.BatchNorm1d(c), nn.ReLU(),
            nn.Conv1d(c, c, 3, padding=1, stride=2), nn.BatchNorm1d(c), nn.ReLU(),
            nn.Conv1d(c, 2 * c, 3, padding=1, stride=2), nn.BatchNorm1d(2 * c), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.head = nn.Linear(2 * c, num_classes)

    def forward(self, x):
        if x.ndim == 2:
            x = x.unsqueeze(1)
        return self.head(self.features(x))


class CNN2D(nn.Module):
    def __init__(self, in_shape, num_classes: int, channels: int = 16):
        super().__init__()
        in_ch = int(in_shape[0])
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * c, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def _conv_bn_relu(cin, cout, k, stride=1):
    return [nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class AllCNN(nn.Module):
    """conv 96-96-192(s2)-192-192-192(s2)-192-192(1×1), each BN+ReLU, global average pool, linear."""

    def __init__(self, in_shape, num_classes: int, width: float = 1.0):
        super().__init__()
        a, b = max(1, int(round(96 * width))), max(1, int(round(192 * width)))
        cin = int(in_shape[0])
        layers = (_conv_bn_relu(cin, a, 3) + _conv_bn_relu(a, a, 3) + _conv_bn_relu(a, b, 3, 2)
                  + _conv_bn_relu(b, b, 3) + _conv_bn_relu(b, b, 3) + _conv_bn_relu(b, b, 3, 2)
                  + _conv_bn_relu(b, b, 3) + _conv_bn_relu(b, b, 1))
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(b, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


class _BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18: widths 64·w, 128·w, 256·w, 512·w; [2, 2, 2, 2] basic blocks."""

    def __init__(self, in_shape, num_classes: int, width: float = 1.0):
        super().__init__()
        ws = [max(1, int(round(c * width))) for c in (64, 128, 256, 512)]
        cin = int(in_shape[0])
        self.stem = nn.Sequential(nn.Conv2d(cin, ws[0], 3, 1, 1, bias=False), nn.BatchNorm2d(ws[0]), nn.ReLU())
        blocks, prev = [], ws[0]
        for i, w in enumerate(ws):
            for j in range(2):
                blocks.append(_BasicBlock(prev, w, 2 if (j == 0 and i > 0) else 1))
                prev = w
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(prev, num_classes)

    def forward(self, x):
        return self.head(self.pool(self.layers(self.stem(x))))


MODELS = {"mlp": MLP, "cnn1d": CNN1D, "cnn2d": CNN2D, "allcnn": AllCNN, "resnet18": ResNet18}


def build_model(name: str, in_shape, num_classes: int, seed: int = 0, **kwargs) -> nn.Module:
    """Instantiate ``MODELS[name]`` with weights initialised from ``seed`` (global RNG left untouched)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](tuple(in_shape), num_classes, **kwargs)


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Put every BatchNorm layer in eval mode: running statistics are used and no longer updated.

    Call after ``model.train()`` (which would switch them back). Affine γ/β stay trainable."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def replace_head(model: nn.Module, num_classes: int, seed: int = 0) -> nn.Module:
    """Swap ``model.head`` for a fresh ``nn.Linear`` with ``num_classes`` outputs (seeded init)."""
    old = model.head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(old.in_features, num_classes)  # initialised on the CPU: same weights on every device
    model.head = head.to(device=old.weight.device, dtype=old.weight.dtype)
    return model


#: attribute names under which models keep their final classifier (ours: ``head``; torchvision: ``fc`` or
#: ``classifier``; timm: ``head``, ``fc`` or ``classifier``), in the order they are tried
CLASSIFIER_NAMES = ("head", "fc", "classifier")


def find_classifier(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """(dotted name, module) of the model's final ``nn.Linear``: the submodule ``name`` when given (dotted
    paths allowed, e.g. ``"classifier.1"``), else the first of :data:`CLASSIFIER_NAMES` the model has, else
    the module the model's ``get_classifier()`` returns (timm's convention). A
    container (``nn.Sequential``) found there stands for its last ``nn.Linear``. ``ValueError`` naming the
    attributes tried when there is none."""
    modules = dict(model.named_modules())
    candidates = [name] if name is not None else list(CLASSIFIER_NAMES)
    for cand in candidates:
        mod = modules.get(cand)
        if mod is None:
            continue
        if isinstance(mod, nn.Linear):
            return cand, mod
        linears = [(f"{cand}.{k}", m) for k, m in mod.named_modules() if isinstance(m, nn.Linear)]
        if linears:
            return linears[-1]
    if name is None and callable(getattr(model, "get_classifier", None)):  # timm's convention
        found = model.get_classifier()
        for cand, mod in modules.items():
            if mod is found and cand:
                return find_classifier(model, cand)
    if name is not None:
        raise ValueError(f"the model has no nn.Linear classifier named {name!r}")
    raise ValueError(f"cannot find the model's classifier: no nn.Linear under {', '.join(CLASSIFIER_NAMES)} "
                     "nor from get_classifier(); "
                     "give its name with the method option classifier=NAME")
