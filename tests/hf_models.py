"""Tiny HuggingFace models built from a config (nothing downloaded) and token batches for them."""
from __future__ import annotations

import torch
from torch import nn


def tiny_bert(num_labels: int = 3, seed: int = 0, vocab: int = 50, hidden: int = 16, layers: int = 1):
    """A ``BertForSequenceClassification`` with random weights (seeded), eval mode, no dropout."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=2 * hidden, max_position_embeddings=32, num_labels=num_labels, initializer_range=0.3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    torch.manual_seed(seed)
    return BertForSequenceClassification(cfg).eval()


def token_batch(n: int, length: int = 8, vocab: int = 50, num_labels: int = 3, seed: int = 0) -> dict:
    """{input_ids, attention_mask, labels}: ids (n, L) int64, a right-padded mask (every row keeps ≥ 2 tokens,
    most rows some padding), labels (n,) int64 from the sum of the visible ids (learnable, depends on the mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, length), generator=g)
    lens = torch.randint(2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lens[:, None]).long()
    ids = ids * mask                       # padding token 0 where masked
    labels = (ids.sum(1) % num_labels).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Wrapper(nn.Module):
    """A user's wrapper: the HF model under ``bert`` (so its head is ``bert.classifier``, not found by name),
    returning the HF ``ModelOutput``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.bert = inner

    def forward(self, input_ids, attention_mask=None):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask)


def probe_labels(model: nn.Module, batch: dict, num_labels: int = 3, seed: int = 123) -> torch.Tensor:
    """Labels (n,) int64 a tiny random BERT's features carry: the terciles (for 3 labels; quantiles in general)
    of a seeded random projection of its pooled output — balanced classes the head can learn, so a fine-tune on
    them is above chance (the commands refuse a model at chance)."""
    with torch.no_grad():
        z = model.bert(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).pooler_output
    s = z.double() @ torch.randn(z.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cuts = torch.quantile(s, torch.arange(1, num_labels, dtype=torch.float64) / num_labels)
    return torch.bucketize(s, cuts).long()
