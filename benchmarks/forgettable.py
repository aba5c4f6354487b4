"""Forgettable fine-tuning against ordinary fine-tuning, and deletion requests against retraining.

Two pretrained networks — a small transformer encoder (a HuggingFace BertForSequenceClassification from a
config) and a ResNet-style CNN — are pretrained (all weights, cross-entropy) on a core task and fine-tuned on a
user task with 10 classes (validation 2,000 samples, test 5,000): ordinarily (Adam on CE, the same user weights,
the learning rate picked on validation), forgettably (:func:`scrubnet.mlforget.finetune.forgettable_finetune`)
linearised at the point that the never-deleted core (``--core-fraction`` of the user samples, default 10 %)
fine-tunes to (µ and the core's learning rate picked on validation), forgettably linearised at the pretrained
point, and forgettably on the head only (both at the chosen µ). Then 10 sequential deletion requests of
1 % of the samples each (never core samples); after each, the exact retraining on D_r (same objective, from
scratch) is timed and compared.

    python benchmarks/forgettable.py            # N = 10,000 user samples per model (slow on a laptop)
    python benchmarks/forgettable.py --small    # N = 400: a minute or two

Prints, per model: test_error_ordinary, test_error_forgettable, test_error_forgettable_pretrained_point,
test_error_head_only, accuracy_gap_points (forgettable − ordinary, in points),
then per request: exact_max_rel_diff (max |w' − ŵ| / max |ŵ|) and request_speedup (retrain s / request s).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from scrubnet.mlforget.finetune import accuracy, forgettable_finetune, ordinary_finetune
from scrubnet.mlforget.model import forget_request, retrain_user_weights
from scrubnet.mlforget.primal import primal_cost
from scrubnet.models.call import ModelInputs
from scrubnet.models.lora import LoRA

C = 10


class Block(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(ch, ch, 3, padding=1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class ResNetish(nn.Module):
    def __init__(self, ch=8):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.block1, self.block2 = Block(ch), Block(ch)
        self.proj = nn.Linear(ch, 32)
        self.fc = nn.Linear(32, C)

    def forward(self, x):
        h = self.block2(nn.functional.max_pool2d(self.block1(torch.relu(self.stem(x))), 2))
        return self.fc(torch.relu(self.proj(h.mean((2, 3)))))


def images(n, protos, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    return (protos[y] + 1.0 * torch.randn(n, 3, 12, 12, generator=g, dtype=torch.float64)), y


def tokens(n, task, seed, length=10, vocab=40):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, length), generator=g)
    mask = (torch.arange(length)[None] < torch.randint(3, length + 1, (n, 1), generator=g)).long()
    ids = ids * mask
    key = ids[:, 0] if task == "user" else (ids * mask).sum(1)  # user task: the first token; core: the sum
    return ModelInputs(ids, {"attention_mask": mask}), (key % C).long()


def pretrain(net, x, y, epochs, lr=3e-3):
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        for i in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(*x[i].call_args()[0], **x[i].call_args()[1]).logits
                                        if isinstance(x, ModelInputs) else net(x[i]), y[i]).backward()
            opt.step()
    return net.eval()


def models(n, small):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    core_p, user_p = (torch.randn(C, 3, 12, 12, generator=g, dtype=torch.float64) for _ in range(2))
    cnn = pretrain(ResNetish().double(), *images(3000 if small else 20000, core_p, 1), 3 if small else 8)
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=16, num_labels=C, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    bert = pretrain(BertForSequenceClassification(cfg).double(), *tokens(3000 if small else 20000, "core", 1),
                    3 if small else 8)
    return [("cnn", cnn, ["fc", "proj"], images(n, user_p, 2), images(2000, user_p, 4), images(5000, user_p, 3)),
            ("transformer", bert, LoRA(["query", "value"], rank=2, modules_to_save=["classifier"]),
             tokens(n, "user", 2), tokens(2000, "user", 4), tokens(5000, "user", 3))]


def tuned_ordinary(net, uw, x, y, xv, yv, lrs, epochs):
    """The yardstick: ordinary fine-tuning of the same user weights, the learning rate picked on validation."""
    best = None
    for lr in lrs:
        m = ordinary_finetune(net, x, y, user_weights=uw, lr=lr, epochs=epochs)
        acc = accuracy(m, xv, yv)
        print(f"  ordinary lr={lr:g}: validation error {1 - acc:.4f}")
        if best is None or acc > best[0]:
            best = (acc, lr, m)
    return best[2], best[1]


def tuned_forgettable(net, uw, x, y, xv, yv, n_core, core_lrs, epochs, mus):
    """The forgettable model, its core learning rate and µ picked on validation as the yardstick's lr is: the
    largest µ whose validation error is within half a point of the best (a larger ridge is better conditioned,
    and differences below half a point are noise at 2,000 validation samples)."""
    tried = []
    for core_lr in core_lrs if n_core else (None,):
        for mu in sorted(mus, reverse=True):
            st = forgettable_finetune(net, x, y, C, user_weights=uw, mu=mu, sigma=0.0,
                                      core_ids=range(n_core) if n_core else None,
                                      core_train={"lr": core_lr, "epochs": 2 * epochs})
            err = 1 - accuracy(st.model, xv, yv)
            print(f"  forgettable core_lr={core_lr:g} mu={mu:g}: validation error {err:.4f}", flush=True)
            tried.append((err, -mu, st, core_lr, mu))
    best = min(t[0] for t in tried)
    _, _, st, core_lr, mu = min((t for t in tried if t[0] <= best + 0.005), key=lambda t: (t[1], t[0]))
    return st, core_lr, mu


def run(name, net, uw, train, val, test, mus, k, core_fraction, epochs):
    (x, y), (xv, yv), (xt, yt) = train, val, test
    ordinary, lr = tuned_ordinary(net, uw, x, y, xv, yv, (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1), epochs)
    err_o = 1 - accuracy(ordinary, xt, yt)
    n_core = int(round(core_fraction * len(y)))
    t0 = time.perf_counter()
    # the first n_core samples are the never-deleted core: the model is linearised where they fine-tune it
    state, core_lr, mu = tuned_forgettable(net, uw, x, y, xv, yv, n_core, (lr, lr / 3), epochs, mus)
    tune_s = time.perf_counter() - t0
    head = forgettable_finetune(net, x, y, C, user_weights="head", mu=mu)
    pre = forgettable_finetune(net, x, y, C, user_weights=uw, mu=mu, sigma=0.0)
    err_f = 1 - accuracy(state.model, xt, yt)
    err_p, err_h = 1 - accuracy(pre.model, xt, yt), 1 - accuracy(head.model, xt, yt)
    print(f"[{name}] N={len(y)} core={n_core} user_weights={state.model.num_linearized} ordinary_lr={lr:g} "
          f"core_lr={core_lr:g} mu={mu:g} train_s={state.train_info.get('train_seconds', float('nan')):.2f} "
          f"(tuning {tune_s:.0f} s)")
    print(f"[{name}] test_error_ordinary: {err_o:.4f}\n[{name}] test_error_forgettable: {err_f:.4f}\n"
          f"[{name}] test_error_forgettable_pretrained_point: {err_p:.4f}\n"
          f"[{name}] test_error_head_only: {err_h:.4f}\n[{name}] accuracy_gap_points: {100 * (err_f - err_o):.2f}")
    block = bool(state.primal is not None and state.primal.block)
    lin, h = state.space(x)   # the solve space: the suffix after a frozen prefix and its cached features
    est = primal_cost(lin, h[:256], y[:256], C, state.config.target_scale, block, len(y) - k, k)
    deletable = torch.arange(n_core, len(y))
    order = deletable[torch.randperm(len(deletable), generator=torch.Generator().manual_seed(5))]
    cpu = []
    for r in range(10):
        ids = order[r * k:(r + 1) * k].tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        forget_request(state, x, y, ids, sigma=0.0)
        req_s, req_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        w_hat = retrain_user_weights(state, x, y)
        ret_s = time.perf_counter() - t0
        cpu.append((req_cpu, time.process_time() - c0))
        w = state.model.delta_flat().detach()
        diff = float((w - w_hat).abs().max() / w_hat.abs().max())
        print(f"[{name}] request {r + 1}: forgot {k}, exact_max_rel_diff: {diff:.2e} request_s {req_s:.3f} "
              f"retrain_s {ret_s:.3f} request_speedup: {ret_s / req_s:.1f}", flush=True)
    req_cpu, ret_cpu = (sorted(v)[len(v) // 2] for v in zip(*cpu))
    print(f"[{name}] cost model (CPU s): request estimated {est.details['request_seconds']:.4f} / measured "
          f"{req_cpu:.4f} (median), build estimated {est.details['build_seconds']:.3f} / measured {ret_cpu:.3f} "
          f"(the retrain on D_r, median)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="N = 400 user samples per model")
    ap.add_argument("--n", type=int, default=None, help="user samples per model (default 10,000; --small 400)")
    ap.add_argument("--mu", default="1e-4,1e-5,1e-6,1e-7", help="µ values tried (picked on validation)")
    ap.add_argument("--core-fraction", type=float, default=0.1,
                    help="share of the user samples that are never deleted (the point of linearisation)")
    ap.add_argument("--epochs", type=int, default=None, help="ordinary fine-tuning epochs (default 10; --small 20)")
    ap.add_argument("--only", choices=["cnn", "transformer"], default=None)
    a = ap.parse_args()
    n = a.n or (400 if a.small else 10_000)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name, net, uw, train, val, test in models(n, a.small):
        if a.only in (None, name):
            run(name, net, uw, train, val, test, [float(v) for v in a.mu.split(",")], max(1, n // 100), a.core_fraction,
                a.epochs or (20 if a.small else 10))


if __name__ == "__main__":
    main()
