"""Hand-written classifiers of the kinds users bring (none from scrubnet's zoo), the synthetic data they are
trained on, and the plain training loop (SGD + ordinary weight decay, no pull toward any start)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

C = 3


class ResBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)
        self.conv2, self.bn2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResCNN(nn.Module):
    """Conv + BatchNorm stem, two residual blocks, global pooling, a head named ``fc``."""

    def __init__(self, ch: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock(ch), ResBlock(ch))
        self.fc = nn.Linear(ch, C)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class TinyViT(nn.Module):
    """Patch embedding, one pre-norm transformer block whose attention calls F.scaled_dot_product_attention,
    mean pooling; the head is found through ``get_classifier()`` (timm's convention)."""

    def __init__(self, dim: int = 8, heads: int = 2, patch: int = 4):
        super().__init__()
        self.patch, self.heads = patch, heads
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(4, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.out = nn.Linear(dim, C)

    def get_classifier(self):
        return self.out

    def forward(self, x):
        b = x.shape[0]
        p = x.unfold(2, self.patch, self.patch).unfold(3, self.patch, self.patch).reshape(b, -1, self.patch ** 2)
        t = self.embed(p) + self.pos
        q, k, v = self.qkv(self.norm1(t)).reshape(b, -1, 3, self.heads, t.shape[-1] // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        t = t + self.proj(a.transpose(1, 2).reshape(b, -1, t.shape[-1]))
        t = t + self.mlp(self.norm2(t))
        return self.out(t.mean(1))


class NormMLP(nn.Module):
    """Linear → LayerNorm → GELU → Linear → GroupNorm → GELU, head named ``classifier``."""

    def __init__(self, d: int = 64, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                  nn.Linear(hidden, hidden), nn.GroupNorm(4, hidden), nn.GELU())
        self.classifier = nn.Linear(hidden, C)

    def forward(self, x):
        return self.classifier(self.body(x))


def images(n: int, seed: int, n_mislabelled: int = 0):
    """(x, y, forget_idx): 1×8×8 images, class = one of 3 templates + noise; the first ``n_mislabelled`` samples
    get a wrong label (a model memorises them; a model retrained without them does not)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(C, 1, 8, 8, generator=torch.Generator().manual_seed(1234))
    y = torch.arange(n) % C
    x = templates[y] + 0.8 * torch.randn(n, 1, 8, 8, generator=g)
    forget_idx = torch.arange(n_mislabelled)
    y = y.clone()
    y[forget_idx] = (y[forget_idx] + 1) % C
    return x, y, forget_idx


def train_plain(model: nn.Module, x, y, *, epochs: int, lr: float, wd: float, batch_size: int = 32, seed: int = 0):
    """SGD with momentum and ordinary weight decay, lr cosine-annealed to 0 (so it ends near a minimum)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    steps = epochs * math.ceil(len(y) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(y), generator=g).split(batch_size):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()
