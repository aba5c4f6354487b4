"""The user models of benchmarks/own_models.py: eight models unlike scrubnet's test zoo, each with the training
function its user wrote (``train(model, data) -> model``) and the recipe that states it.

All are small (a training takes well under a few seconds on one core) and trained on synthetic data: 8×8
images of four classes (a class pattern plus noise) or token sequences of four classes (class tokens among
noise tokens, padded, with an attention mask).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from scrubnet.recipe import TrainingRecipe

C, V, L = 4, 32, 10
N_TRAIN, N_TEST = 600, 300


# ------------------------------------------------------------------ data
def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (n, 1, 8, 8), y (n,)): a class pattern (one of four fixed random 8×8 images) plus noise."""
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(C, 1, 8, 8, generator=g)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    return 0.45 * patterns[y] + torch.randn(n, 1, 8, 8, generator=g), y


def tokens(n: int, seed: int) -> list[dict]:
    """Token sequences: three class tokens (of eight per class) among noise tokens, random length ≥ 6, zero
    padded; dict items with ``input_ids``, ``attention_mask``, ``labels``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    ids = torch.randint(1, V, (n, L), generator=g)
    pos = torch.rand(n, 6, generator=g).argsort(1)[:, :3]
    cls_tok = 1 + (y[:, None] * 7 + torch.randint(7, (n, 3), generator=g)) % (V - 1)
    noisy = torch.rand(n, 3, generator=g) < 0.25      # a quarter of the class tokens are noise: not separable
    cls_tok = torch.where(noisy, torch.randint(1, V, (n, 3), generator=g), cls_tok)
    ids.scatter_(1, pos, cls_tok)
    length = torch.randint(6, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < length[:, None]).long()
    ids = ids * mask
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": y[i]} for i in range(n)]


# ------------------------------------------------------------------ models
class TinyViT(nn.Module):
    """timm-style: a bare class token and position embedding (``nn.Parameter``), pre-norm blocks."""

    def __init__(self, dim: int = 24, patch: int = 4, depth: int = 1):
        super().__init__()
        self.patch = patch
        self.patch_embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, 1 + (8 // patch) ** 2, dim))
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, C)

    def forward(self, x):
        t = self.patch_embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls_token.expand(len(t), -1, -1), t], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(t))[:, 0])


class DSBlock(nn.Module):
    """Depthwise-separable residual block with GroupNorm and SiLU."""

    def __init__(self, ch: int):
        super().__init__()
        self.dw, self.pw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch), nn.Conv2d(ch, ch, 1)
        self.gn1, self.gn2 = nn.GroupNorm(4, ch), nn.GroupNorm(4, ch)

    def forward(self, x):
        return x + self.gn2(self.pw(F.silu(self.gn1(self.dw(x)))))


class GNCNN(nn.Module):
    def __init__(self, ch: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.GroupNorm(4, ch), nn.SiLU())
        self.blocks = nn.Sequential(DSBlock(ch), DSBlock(ch))
        self.head = nn.Linear(ch, C)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class FrozenBackbone(nn.Module):
    """A pretrained feature extractor (frozen) and a new head."""

    def __init__(self, ch: int = 16):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(4 * ch, C)

    def forward(self, x):
        return self.head(self.backbone(x))


class InvertedResidual(nn.Module):
    def __init__(self, ch: int, expand: int = 3):
        super().__init__()
        h = ch * expand
        self.body = nn.Sequential(nn.Conv2d(ch, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                                  nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                                  nn.Conv2d(h, ch, 1, bias=False), nn.BatchNorm2d(ch))

    def forward(self, x):
        return x + self.body(x)


class MobileNetLike(nn.Module):
    def __init__(self, ch: int = 12):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU6(),
                                      InvertedResidual(ch), InvertedResidual(ch))
        self.classifier = nn.Linear(ch, C)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


class LSTMNet(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(V, dim), nn.LSTM(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, C)

    def forward(self, input_ids, attention_mask):
        out, _ = self.lstm(self.emb(input_ids))
        last = attention_mask.sum(1) - 1
        return self.head(out[torch.arange(len(out)), last])


class AttnNet(nn.Module):
    """``nn.TransformerEncoder`` over token embeddings with a key padding mask, masked mean pooling."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, dim), nn.Embedding(L, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(dim, C)

    def forward(self, input_ids, attention_mask):
        t = self.emb(input_ids) + self.pos.weight[None, : input_ids.shape[1]]
        h = self.encoder(t, src_key_padding_mask=attention_mask == 0)
        m = attention_mask[..., None].float()
        return self.head((h * m).sum(1) / m.sum(1))


class TiedNet(nn.Module):
    """Tied weights: the decoder of a tiny autoencoder is the encoder's transpose, and the classifier's weight is
    the class-prototype embedding's (one tensor under two names in the state dict, as a HuggingFace language
    model ties its input embedding to its output projection: safetensors refuses to save such a state as it is)."""

    def __init__(self, hidden: int = 24):
        super().__init__()
        self.enc = nn.Linear(64, hidden)
        self.protos = nn.Embedding(C, hidden)
        nn.init.normal_(self.protos.weight, std=hidden ** -0.5)
        self.head = nn.Linear(hidden, C)
        self.head.weight = self.protos.weight                # tied: two names, one tensor

    def forward(self, x):
        code = torch.tanh(self.enc(x.flatten(1)))
        recon = F.linear(code, self.enc.weight.t())          # tied: the same weight, transposed
        return self.head(code + 0.1 * torch.tanh(self.enc(recon)))


def hf_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=L, num_labels=C, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


# ------------------------------------------------------------------ the users' training functions
def _batches(data, batch_size: int, g: torch.Generator):
    """The user's batches: tensors shuffled by ``g``, or a DataLoader's own (dict batches)."""
    if isinstance(data, DataLoader):
        for b in data:
            yield (b["input_ids"], b["attention_mask"]), b["labels"]
        return
    x, y = data
    for idx in torch.randperm(len(y), generator=g).split(batch_size):
        yield (x[idx],), y[idx]


def _logits(model, inputs):
    out = model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def make_train(r: TrainingRecipe) -> Callable:
    """The user's loop as the recipe states it (SGD or AdamW, constant or cosine per step, label smoothing);
    seeded by the global generator (the caller fixes it)."""

    def train(model: nn.Module, data) -> nn.Module:
        g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
        params = [p for p in model.parameters() if p.requires_grad]
        if r.optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=r.adamw_weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=r.lr, momentum=r.momentum, weight_decay=r.wd)
        n = len(data.dataset) if isinstance(data, DataLoader) else len(data[1])
        steps = r.epochs * math.ceil(n / r.batch_size)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if r.schedule == "cosine" else None
        model.train()
        for _ in range(r.epochs):
            for inputs, y in _batches(data, r.batch_size, g):
                opt.zero_grad()
                F.cross_entropy(_logits(model, inputs), y, label_smoothing=r.label_smoothing).backward()
                opt.step()
                if sched is not None:
                    sched.step()
        return model.eval()

    return train


def _recipe(**kw) -> TrainingRecipe:
    """A recipe (the fields of part A's recipe only when this scrubnet has them)."""
    fields = TrainingRecipe.__dataclass_fields__
    return TrainingRecipe(**{k: v for k, v in kw.items() if k in fields})


@dataclass
class UserModel:
    name: str
    build: Callable[[], nn.Module]
    recipe: TrainingRecipe
    kind: str            # "images" or "tokens"
    pretrain: bool = False

    def train_fn(self) -> Callable:
        return make_train(self.recipe)


def _r(**kw):
    """Recipes with the AdamW/cosine fields read with getattr by make_train on older recipes."""
    rec = _recipe(**kw)
    for k in ("optimizer", "schedule", "adamw_weight_decay"):
        if not hasattr(rec, k):
            object.__setattr__(rec, k, kw.get(k, {"optimizer": "sgd", "schedule": "constant"}.get(k, 0.0)))
    return rec


MODELS = [
    UserModel("vit", TinyViT, _r(lr=2e-3, epochs=20, batch_size=32, optimizer="adamw", schedule="cosine",
                                 adamw_weight_decay=0.05, label_smoothing=0.1), "images"),
    UserModel("gn-cnn", GNCNN, _r(lr=1e-2, epochs=20, batch_size=32, optimizer="adamw", schedule="cosine",
                                  adamw_weight_decay=0.01), "images"),
    UserModel("frozen-backbone", FrozenBackbone, _r(lr=0.05, momentum=0.9, wd=5e-4, epochs=20, batch_size=32),
              "images", pretrain=True),
    UserModel("hf-bert", hf_bert, _r(lr=5e-3, epochs=20, batch_size=32, optimizer="adamw",
                                     adamw_weight_decay=0.01), "tokens"),
    UserModel("lstm", LSTMNet, _r(lr=1e-2, epochs=20, batch_size=32, optimizer="adamw"), "tokens"),
    UserModel("attention", AttnNet, _r(lr=1e-2, epochs=20, batch_size=32, optimizer="adamw", schedule="cosine",
                                       adamw_weight_decay=0.01), "tokens"),
    UserModel("mobilenet", MobileNetLike, _r(lr=0.1, momentum=0.9, wd=5e-4, epochs=20, batch_size=32),
              "images"),
    UserModel("tied", TiedNet, _r(lr=0.05, momentum=0.9, wd=5e-4, epochs=25, batch_size=32), "images"),
]


def start_model(um: UserModel, seed: int = 0) -> nn.Module:
    """The model the user's training starts from: a seeded initialisation; the frozen-backbone model's backbone
    pretrained (on the same images with their labels permuted, a stand-in for another task) and frozen."""
    torch.manual_seed(seed)
    model = um.build()
    if um.pretrain:
        x, y = images(600, 99)
        pre = nn.Sequential(copy.deepcopy(model.backbone), nn.Linear(64, C))
        opt = torch.optim.SGD(pre.parameters(), lr=0.05, momentum=0.9)
        for _ in range(15):
            for idx in torch.randperm(len(y)).split(32):
                opt.zero_grad()
                F.cross_entropy(pre(x[idx]), (y[idx] + 1) % C).backward()
                opt.step()
        model.backbone.load_state_dict(pre[0].state_dict())
        for p in model.backbone.parameters():
            p.requires_grad_(False)
    return model


def loader(items: list[dict], shuffle: bool, seed: int = 0) -> DataLoader:
    return DataLoader(items, batch_size=32, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))
