"""Per-sample Jacobian rows: the layer-hook path against one-sample-at-a-time autograd (its slow twin)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.mlforget import rows
from scrubnet.mlforget.finetune import split_batch, user_weight_names
from scrubnet.models.lora import LoRA
from tests.mlforget.test_forgettable import pretrained_cnn, tiny_bert, token_batch


def reference_rows(net, names, x, c):
    """J (B, c, p), one sample and one logit at a time by plain autograd."""
    params = dict(net.named_parameters())
    out = []
    for i in range(len(x)):
        per_k = []
        for k in range(c):
            logits = net(*x[i:i + 1].call_args()[0], **x[i:i + 1].call_args()[1]).logits \
                if hasattr(x, "call_args") else net(x[i:i + 1])
            g = torch.autograd.grad(logits[0, k], [params[n] for n in names])
            per_k.append(torch.cat([t.reshape(-1) for t in g]))
        out.append(torch.stack(per_k))
    return torch.stack(out)


def functional_args(net):
    params = {n: p.detach() for n, p in net.named_parameters()}
    buffers = dict(net.named_buffers())
    return params, buffers


def test_hook_rows_equal_autograd_on_bert_lora_with_masks():
    bert, names, _ = user_weight_names(tiny_bert(num_labels=3),
                                       LoRA(["query", "value"], rank=2, modules_to_save=["classifier"]))
    bert.eval()
    with torch.no_grad():   # B ≠ 0, so the rows of A-side layers upstream are not trivially zero downstream
        for n, p in bert.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    x, _ = split_batch(token_batch(6))
    params, buffers = functional_args(bert)
    assert rows._covering_layers(bert, names) is not None
    j = rows.per_sample_jacobian(bert, params, buffers, names, x, 3)
    assert rows._HOOKS_AGREE[bert][tuple(names)] is True      # the hook path was taken
    for p in bert.parameters():
        p.requires_grad_(True)
    ref = reference_rows(bert, names, x, 3)
    assert j.shape == ref.shape and torch.allclose(j, ref, rtol=1e-10, atol=1e-12)


def test_hook_rows_on_conv_batchnorm_and_a_shared_layer():
    net = pretrained_cnn()
    names = ["conv2.weight", "conv2.bias", "bn1.weight", "fc.weight"]
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    params, buffers = functional_args(net)
    j = rows.per_sample_jacobian(net, params, buffers, names, x, int(net(x[:1]).shape[1]))
    assert rows._HOOKS_AGREE[net][tuple(names)] is True
    ref = reference_rows(net, names, x, j.shape[1])
    assert torch.allclose(j, ref, rtol=1e-10, atol=1e-12)

    class Twice(nn.Module):   # one layer called twice: the rows sum over both calls
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4).double()
            self.head = nn.Linear(4, 3).double()

        def forward(self, x):
            return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))

    tw = Twice().eval()
    x = torch.randn(4, 4, dtype=torch.float64)
    params, buffers = functional_args(tw)
    j = rows.per_sample_jacobian(tw, params, buffers, ["inner.weight", "head.bias"], x, 3)
    assert rows._HOOKS_AGREE[tw][("inner.weight", "head.bias")] is True
    assert torch.allclose(j, reference_rows(tw, ["inner.weight", "head.bias"], x, 3), rtol=1e-10, atol=1e-12)


def test_a_weight_used_outside_its_layer_falls_back_to_per_sample_rows():
    class Sneaky(nn.Module):  # the head's weight is also used functionally: the hook sees only one use
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3).double()

        def forward(self, x):
            return self.head(x) + 0.5 * F.linear(x.flip(1), self.head.weight)

    net = Sneaky().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    params, buffers = functional_args(net)
    j = rows.per_sample_jacobian(net, params, buffers, ["head.weight"], x, 3)
    assert rows._HOOKS_AGREE[net][("head.weight",)] is False   # the probe refused the hook path
    assert torch.allclose(j, reference_rows(net, ["head.weight"], x, 3), rtol=1e-10, atol=1e-12)


def test_a_bare_parameter_takes_the_per_sample_path():
    class Scaled(nn.Module):   # a parameter outside any layer: no kernel covers it
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3).double()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

        def forward(self, x):
            return self.head(x) * self.scale

    net = Scaled().eval()
    names = ["head.weight", "scale"]
    assert rows._covering_layers(net, names) is None and rows._covering_layers(net, ["head.weight"]) is not None
    x = torch.randn(5, 4, dtype=torch.float64)
    params, buffers = functional_args(net)
    j = rows.per_sample_jacobian(net, params, buffers, names, x, 3)
    assert net not in rows._HOOKS_AGREE
    assert torch.allclose(j, reference_rows(net, names, x, 3), rtol=1e-10, atol=1e-12)
