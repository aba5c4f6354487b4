"""A shared zoo of tiny hand-written classifiers of every architecture scrubnet must handle, with a batch of
inputs for each (float64 where the model takes floats).

``ZOO`` maps a name to a factory returning ``(model, x)``: ``x`` is a Tensor or a ``ModelInputs`` with
``N_SAMPLES`` samples; every model returns logits (or an object carrying them) with ``C`` classes.
Built under a fixed seed, in float64, in eval mode.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.models.call import ModelInputs

C = 3
N_SAMPLES = 4
VOCAB, SEQ = 11, 5


class RNNClassifier(nn.Module):
    """Integer tokens → embedding → LSTM or GRU → last hidden state → linear head."""

    def __init__(self, cell: str = "lstm", dim: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, C)

    def forward(self, tokens):
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder (2 layers): in eval mode without grad, torch takes its fused fast path."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(3, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, C)

    def forward(self, x):
        return self.head(self.enc(self.inp(x)).mean(1))


class MHAClassifier(nn.Module):
    """nn.MultiheadAttention used directly (its out_proj weight is used functionally, never called)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.inp = nn.Linear(3, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, C)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a).mean(1))


class SDPAGroupNormClassifier(nn.Module):
    """Conv + GroupNorm, then a hand-written attention through F.scaled_dot_product_attention."""

    def __init__(self, ch: int = 4):
        super().__init__()
        self.conv = nn.Conv1d(3, ch, 3, padding=1)
        self.gn = nn.GroupNorm(2, ch)
        self.qkv = nn.Linear(ch, 3 * ch)
        self.head = nn.Linear(ch, C)

    def forward(self, x):                                   # x (N, SEQ, 3)
        h = F.relu(self.gn(self.conv(x.transpose(1, 2)))).transpose(1, 2)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        return self.head((h + a).mean(1))


class FrozenClassifier(nn.Module):
    """A frozen first layer (weight and bias), a trainable head whose bias is frozen too."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, C)
        for p in (self.body.weight, self.body.bias, self.head.bias):
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class SharedClassifier(nn.Module):
    """One weight shared by two Linear layers (tied), plus one Linear module called twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)
        self.b.weight = self.a.weight
        self.twice = nn.Linear(5, 5)
        self.head = nn.Linear(5, C)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.head(h)


class DictOutputClassifier(nn.Module):
    """Returns a mapping with ``logits`` (as HuggingFace-style outputs do)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, C))

    def forward(self, x):
        return OrderedDict(logits=self.net(x), hidden=x)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(5, 6), nn.ReLU())
        self.classifier = nn.Linear(6, C)

    def forward(self, x):
        return self.classifier(self.features(x))


class NestedClassifier(nn.Module):
    """wrapper.body.classifier."""

    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, x):
        return self.body(x)


def _tokens(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _seq(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, SEQ, 3, generator=g, dtype=torch.float64)


def _vec(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, 5, generator=g, dtype=torch.float64)


def tiny_bert():
    """A BertForSequenceClassification from a config (no download): hidden 16, 2 layers, 2 heads, vocab 50."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, num_labels=C,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.5)
    return BertForSequenceClassification(cfg)


def bert_inputs(n: int, g: torch.Generator, length: int = 6) -> ModelInputs:
    """Token ids with padding at the end of every other sample, and the attention mask that hides it."""
    ids = torch.randint(1, 50, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[::2, length - 2:] = 0
    return ModelInputs(ids, {"attention_mask": mask})


_FACTORIES = {
    "lstm": (lambda: RNNClassifier("lstm"), _tokens),
    "gru": (lambda: RNNClassifier("gru"), _tokens),
    "transformer_encoder": (EncoderClassifier, _seq),
    "mha": (MHAClassifier, _seq),
    "sdpa_groupnorm": (SDPAGroupNormClassifier, _seq),
    "frozen": (FrozenClassifier, _vec),
    "shared": (SharedClassifier, _vec),
    "dict_output": (DictOutputClassifier, _vec),
    "nested": (NestedClassifier, _vec),
    "bert": (tiny_bert, bert_inputs),
}

ZOO_NAMES = list(_FACTORIES)


def build(name: str, n: int = N_SAMPLES, seed: int = 0):
    """(model in float64 and eval mode, inputs of ``n`` samples) for the zoo entry ``name``."""
    torch.manual_seed(seed)
    make_model, make_x = _FACTORIES[name]
    model = make_model().double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    return model, make_x(n, g)
