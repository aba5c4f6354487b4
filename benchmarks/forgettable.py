"""Forgettable fine-tuning against a converged ordinary fine-tuning, and deletion requests against the user's
real alternative (fine-tuning again without the rows).

Two networks are pretrained first on another task (all weights, cross-entropy, printed with their accuracy on
it): a ResNet-style CNN on 10 other image classes (other prototypes), and a HuggingFace BERT (from a config) on
another labelling of the same sequences (the last visible token mod 10; the user task: its range, ⌊t/4⌋). Then, per
seed (the user data drawn, the LoRA factors, the SGD order), each is fine-tuned on the user task (N user
samples, validation and test sets of their own):

* **ordinary** (the yardstick): the same user weights, Adam on the cross-entropy, in float32, *early stopping*
  on validation (up to ``--max-epochs``; stopped after ``--patience`` epochs in which neither the validation
  error nor the validation loss improved; the epoch of the best validation error kept), the learning rate picked on
  validation from a grid that widens by ×3 while its best sits on an edge;
* **forgettable** (:func:`~scrubnet.mlforget.finetune.forgettable_finetune`): linearised at the pretrained
  point or at the point a never-deleted core (``--core-fraction`` of the user samples) fine-tunes to (the
  core's rate from {lr, lr/3, lr/10} of the yardstick's), µ from a grid; point, core rate and µ picked on
  validation (the largest µ within half a point of the best), as the yardstick's rate is.

Printed per model and seed: the test errors (ordinary, forgettable, forgettable at the pretrained point, head
only), the gap, then ``--requests`` sequential deletion requests of 1 % of the samples (never core samples):
``exact_max_rel_diff`` after requests 1, 10 and the last (max |w − ŵ| / max |ŵ|, ŵ the exact refit on D_r),
and the CPU time of a request against the user's alternative — ordinary fine-tuning again on D_r from the
pretrained point with the yardstick's rate and epochs (one run, timed). Summary per model over the seeds:

    accuracy_gap_points G [lo, hi]      mean over seeds (forgettable − ordinary test error, points), 95 % t interval
    request_vs_user_finetune R [lo, hi] median over seeds [min, max] of (user fine-tune CPU s) / (request CPU s)
    exact_max_rel_diff E                worst over seeds, after the last request

    python benchmarks/forgettable.py                 # N = 1,000, 3 seeds (about 30 min on 2 shared cores)
    python benchmarks/forgettable.py --small         # N = 400, 1 seed, short pretraining: a smoke run

**Engines** (``--engines linearised,sharded,auto``, the default). A third model joins the CNN and BERT: a
GPT-2-style causal LM (from a config) pretrained on "the class of the FIRST token", fine-tuned on "the class
of the SECOND token" — a task that needs attention to move — read through its pretrained LM head (the label
words' logits at the answer position, :class:`~scrubnet.mlforget.preflight.AnswerLogits`), user weights LoRA
on attention (c_attn, attn.c_proj). Per model and seed, beside the linearised engine above:

* **sharded** (:func:`~scrubnet.mlforget.sharded.sharded_finetune`): ``--shards`` × ``--slices``, the
  yardstick's learning rate and epochs, in float32 as the yardstick; ``--requests`` sequential requests of
  ``--sharded-request`` samples (default 1: one person's row), their median CPU time against the same user
  re-fine-tune; ``exact_max_rel_diff`` after the last request against a sharded fine-tune run from scratch
  on D ∖ D_f with the same seeds, over every shard and slice checkpoint (0 when bit for bit);
* **auto**: the pre-flight (:func:`~scrubnet.mlforget.preflight.preflight`, on the training samples, the
  yardstick's rate, half its epochs) chooses an engine; the line reports the chosen engine's numbers.

One line per (model, engine) over the seeds::

    [MODEL] strategy S accuracy_gap_points G [lo, hi]; request_vs_user_finetune R; exact_max_rel_diff E

(``strategy auto=ENGINE``: the engine most seeds chose; each seed's choice is printed above it).

The run recorded in docs/decisions/forgettable.md (about 45 min wall on 2 heavily shared cores)::

    python benchmarks/forgettable.py --n 300 --seeds 3 --pretrain 8000,4 --max-epochs 25 --patience 4 \
        --no-core --mu 1e-3,1e-4,1e-5,1e-6 --requests 20
    python benchmarks/forgettable.py --sweep --only cnn --n 300 --seeds 3 --pretrain 8000,4 --max-epochs 25 --patience 4
    python benchmarks/forgettable.py --only causal-lm --n 300 --seeds 3 --pretrain 8000,4 --max-epochs 25 \
        --patience 4 --no-core --mu 1e-3,1e-4,1e-5,1e-6 --requests 20 --shards 2 --engines sharded,auto --preflight-full
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.mlforget.finetune import accuracy, forgettable_finetune, user_weight_names
from scrubnet.mlforget.preflight import AnswerLogits, choose_shards, preflight
from scrubnet.mlforget.sharded import sharded_finetune
from scrubnet.mlforget.ftstore import parse_user_weights
from scrubnet.mlforget.model import forget_request, retrain_user_weights
from scrubnet.models.call import ModelInputs, call_model
from scrubnet.models.lora import LoRA

C = 10
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57}


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
    lens = torch.randint(3, length + 1, (n, 1), generator=g)
    mask = (torch.arange(length)[None] < lens).long()
    ids = ids * mask
    # both read the last visible token; pretraining labels it mod 10, the user task by its range (another
    # class set over the same inputs, as the CNN's other prototypes)
    last = ids.gather(1, lens - 1)[:, 0]
    key = last // 4 if task == "user" else last
    return ModelInputs(ids, {"attention_mask": mask}), (key % C).long()


def logits(net, x):
    out = call_model(net, x)
    return out.logits if hasattr(out, "logits") else out


def pretrain(net, x, y, epochs, lr=3e-3):
    """All weights, Adam on the cross-entropy (train mode off: no dropout in these models)."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for i in torch.randperm(len(y), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(logits(net, x[i]), y[i]).backward()
            opt.step()
    return net.eval()


def pretrained_models(small, only=None):
    """[(name, network, data(n, seed) -> (train, val, test))], pretrained on their tasks (those in ``only``, a
    list of names, when given; the others are returned as None)."""
    want = (lambda name: only is None or name in only)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    pre_p, user_p = (torch.randn(C, 3, 12, 12, generator=g, dtype=torch.float64) for _ in range(2))
    n_pre, ep = PRETRAIN or ((3000, 3) if small else (20000, 8))
    t0 = time.process_time()
    x, y = images(n_pre if want("cnn") else 10, pre_p, 1)
    cnn = pretrain(ResNetish().double(), x, y, ep) if want("cnn") else None
    xt, yt = images(2000, pre_p, 9)
    if cnn is not None:
        print(f"[cnn] pretrained on its own 10 classes: {n_pre} images, {ep} epochs, test accuracy "
              f"{accuracy(cnn, xt, yt):.3f} ({time.process_time() - t0:.0f} CPU s)", flush=True)
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=16, num_labels=C, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    t0 = time.process_time()
    x, y = tokens(n_pre if want("transformer") else 10, "pretrain", 1)
    bert = pretrain(BertForSequenceClassification(cfg).double(), x, y, ep) if want("transformer") else None
    xt, yt = tokens(2000, "pretrain", 9)
    if bert is not None:
        print(f"[transformer] pretrained on the last-token task: {n_pre} sequences, {ep} epochs, test accuracy "
              f"{accuracy(bert, xt, yt):.3f} ({time.process_time() - t0:.0f} CPU s)", flush=True)

    lm, lm_tokens = pretrained_lm(small) if want("causal-lm") else (None, None)

    def cnn_data(n, seed):
        return images(n, user_p, 100 + seed), images(500, user_p, 200 + seed), images(2000, user_p, 300 + seed)

    def bert_data(n, seed):
        return tokens(n, "user", 100 + seed), tokens(500, "user", 200 + seed), tokens(2000, "user", 300 + seed)

    def lm_data(n, seed):
        return lm_tokens(n, 1, 100 + seed), lm_tokens(500, 1, 200 + seed), lm_tokens(2000, 1, 300 + seed)

    return [("cnn", cnn, cnn_data), ("transformer", bert, bert_data), ("causal-lm", lm, lm_data)]


#: the causal LM's sequences: 8 content tokens (ids 8..39), a separator (id 4), the answer (a label word)
LM_VOCAB, LM_SEP, LM_WORDS, LM_K = 40, 4, (0, 1, 2, 3), 4


def lm_sequences(n, position, seed):
    """(inputs for :class:`AnswerLogits`, class labels): the answer is the class (token mod 4) of the content
    token at ``position`` (0: pretraining, 1: the user task, which needs attention to move)."""
    g = torch.Generator().manual_seed(seed)
    content = torch.randint(8, LM_VOCAB, (n, 8), generator=g)
    y = content[:, position] % LM_K
    ids = torch.cat([content, torch.full((n, 1), LM_SEP), torch.tensor(LM_WORDS)[y][:, None]], 1)
    return ModelInputs(ids, {"answer_position": torch.full((n,), 9)}), y.long()


def pretrained_lm(small):
    """A GPT-2-style LM (from a config) pretrained with the loss on the answer token of position-0 sequences;
    returned wrapped as :class:`AnswerLogits` over the label words."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=LM_VOCAB, n_positions=12, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=LM_SEP, eos_token_id=LM_SEP)
    net = AnswerLogits(GPT2LMHeadModel(cfg).double(), LM_WORDS)
    n_pre, ep = PRETRAIN or ((3000, 3) if small else (20000, 8))
    t0 = time.process_time()
    x, y = lm_sequences(n_pre, 0, 1)
    net = pretrain(net, x, y, ep)
    xt, yt = lm_sequences(2000, 0, 9)
    xu, yu = lm_sequences(2000, 1, 9)
    print(f"[causal-lm] pretrained on the first token's class: {n_pre} sequences, {ep} epochs, test accuracy "
          f"{accuracy(net, xt, yt):.3f}; on the user task (second token) before fine-tuning "
          f"{accuracy(net, xu, yu):.3f} ({time.process_time() - t0:.0f} CPU s)", flush=True)
    return net, lambda n, pos, seed: lm_sequences(n, pos, seed)


def seeded_user_weights(spec: str):
    """The user weights of a command-line spec (``mlforget finetune --user-weights``), a LoRA's A drawn per seed."""
    uw = parse_user_weights(spec)
    return (lambda s: dataclasses.replace(uw, seed=s)) if isinstance(uw, LoRA) else (lambda s: uw)


def f32(x):
    """Inputs in float32 (token ids keep their dtype)."""
    return x.to(torch.float32) if isinstance(x, ModelInputs) or x.is_floating_point() else x


@torch.no_grad()
def val_loss(model, x, y) -> float:
    return float(sum(F.cross_entropy(logits(model, x[i:i + 500]), y[i:i + 500], reduction="sum")
                     for i in range(0, len(y), 500)) / len(y))


def early_stopped(net, uw, x, y, xv, yv, lr, seed, max_epochs, patience):
    """Ordinary fine-tuning of the user weights, Adam on CE, the epoch with the best validation error kept; in
    float32, as users fine-tune (the forgettable model is float64 for exact deletions).

    Returns (model, validation error, epochs to the best)."""
    x, xv = f32(x), f32(xv)
    model, names, _ = user_weight_names(copy.deepcopy(net).float(), uw)
    model.eval()
    chosen = set(names)
    params = [p for n, p in model.named_parameters() if n in chosen]
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    best = (1 - accuracy(model, xv, yv), 0, [p.detach().clone() for p in params])
    best_loss, last_gain = val_loss(model, xv, yv), 0
    for epoch in range(1, max_epochs + 1):
        for i in torch.randperm(len(y), generator=g).split(32):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(logits(model, x[i]), y[i]).backward()
            opt.step()
        err, loss = 1 - accuracy(model, xv, yv), val_loss(model, xv, yv)
        if not math.isfinite(loss):
            break
        if err < best[0]:
            best = (err, epoch, [p.detach().clone() for p in params])
        if err < best[0] or epoch == best[1] or loss < best_loss:
            last_gain, best_loss = epoch, min(loss, best_loss)
        if epoch - last_gain >= patience:  # neither the error nor the loss improved for `patience` epochs
            break
    with torch.no_grad():
        for p, b in zip(params, best[2]):
            p.copy_(b)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, best[0], best[1]


def tuned_ordinary(net, uw, x, y, xv, yv, seed, max_epochs, patience, tag):
    """The yardstick: :func:`early_stopped` over a rate grid that widens ×3 while its best is on an edge."""
    lrs, tried = [1e-3, 3e-3, 1e-2, 3e-2], {}
    while True:
        for lr in lrs:
            if lr not in tried:
                tried[lr] = early_stopped(net, uw, x, y, xv, yv, lr, seed, max_epochs, patience)
                print(f"{tag} ordinary lr={lr:g}: validation error {tried[lr][1]:.4f} at epoch {tried[lr][2]}",
                      flush=True)
        grid = sorted(tried)
        best = min(grid, key=lambda r: (tried[r][1], r))
        if best == grid[0] and best > 1e-5:
            lrs = [best / 3]
        elif best == grid[-1] and best < 1.0:
            lrs = [best * 3]
        else:
            model, err, epochs = tried[best]
            return model, best, err, epochs


def mu_scan(state, x, y, xv, yv, mus):
    """Validation error of the state's model refitted at each µ (one primal factor, a solve per µ)."""
    out = {}
    lin, h = state.space(x)
    keep = torch.ones(len(state.primal.ids), dtype=torch.bool)
    for mu in mus:
        w, _ = dataclasses.replace(state.primal, mu=mu).fit(lin, h, y[state.primal.ids], keep)
        state.model.set_delta_flat(w)
        out[mu] = 1 - accuracy(state.model, xv, yv)
    return out


def a_core_lrs(lr):
    """The points tried: the pretrained one, then the core fine-tuned at {lr, lr/3, lr/10} (``--no-core``: none)."""
    return (None,) if NO_CORE else (None, lr, lr / 3, lr / 10)


NO_CORE = False
PRETRAIN = None  # (samples, epochs) of every pretraining (``--pretrain``)


def tuned_forgettable(net, uw, x, y, xv, yv, n_core, lr, mus, epochs, tag):
    """Point (pretrained, or the core at {lr, lr/3, lr/10}) and µ picked on validation; the model refitted."""
    tried, C = [], int(logits(net, x[:1]).shape[1])  # the model's classes (the LM: its label words)
    for core_lr in a_core_lrs(lr):
        core = {"core_ids": range(n_core), "core_train": {"lr": core_lr, "epochs": max(10, epochs)},
                "check_core": False} if core_lr else {}
        st = forgettable_finetune(net, x, y, C, user_weights=uw, mu=max(mus), sigma=0.0, solver="primal", **core)
        for mu, err in mu_scan(st, x, y, xv, yv, mus).items():
            tried.append((err, mu, core_lr))
        print(f"{tag} forgettable at the {'core point, core lr ' + format(core_lr, 'g') if core_lr else 'pretrained point'}: "
              + ", ".join(f"µ {m:g} {e:.4f}" for e, m, c in tried if c == core_lr), flush=True)
    best = min(t[0] for t in tried)
    err, mu, core_lr = max((t for t in tried if t[0] <= best + 0.005), key=lambda t: (t[1], -t[0]))
    pre_mu = max((t for t in tried if t[2] is None), key=lambda t: (-t[0], t[1]))[1]
    core = {"core_ids": range(n_core), "core_train": {"lr": core_lr, "epochs": max(10, epochs)},
            "check_core": False} if core_lr else {}
    state = forgettable_finetune(net, x, y, C, user_weights=uw, mu=mu, sigma=0.0, solver="primal", **core)
    pre = forgettable_finetune(net, x, y, C, user_weights=uw, mu=pre_mu, sigma=0.0, solver="primal")
    try:
        head = forgettable_finetune(net, x, y, C, user_weights="head", mu=pre_mu, sigma=0.0, solver="primal")
    except ValueError:  # no head found by name (the causal LM reads its tied LM head)
        head = None
    return state, pre, head, core_lr, mu


def requests(state, net, uw, x, y, n_core, k, n_req, lr, epochs, seed, tag, user=True):
    """``n_req`` sequential requests of ``k`` samples; (E after the last, median request CPU s, user-alternative
    CPU s)."""
    order = torch.arange(n_core, len(y))[torch.randperm(len(y) - n_core, generator=torch.Generator().manual_seed(5))]
    cpu, diffs = [], {}
    for r in range(1, n_req + 1):
        c0 = time.process_time()
        forget_request(state, x, y, order[(r - 1) * k:r * k].tolist(), sigma=0.0)
        cpu.append(time.process_time() - c0)
        if r in (1, 10, n_req):
            w, w_hat = state.model.delta_flat().detach(), retrain_user_weights(state, x, y)
            diffs[r] = float((w - w_hat).abs().max() / w_hat.abs().max())
            print(f"{tag} request {r}: forgot {k}, exact_max_rel_diff {diffs[r]:.2e}, request CPU s {cpu[-1]:.3f}",
                  flush=True)
    if not user:
        return diffs[n_req], statistics.median(cpu), None
    keep = torch.tensor(sorted(set(range(len(y))) - set(order[:n_req * k].tolist())))
    c0 = time.process_time()
    early_stopped(net, uw, x[keep], y[keep], x[keep][:1], y[keep][:1], lr, seed, epochs, epochs + 1)
    user_s = time.process_time() - c0
    return diffs[n_req], statistics.median(cpu), user_s


def sharded_requests(sm, net, uw, x, y, a, seed, tag):
    """``--requests`` sequential requests of ``--sharded-request`` samples to the sharded model; (E against a
    fresh sharded fine-tune on D ∖ D_f, median request CPU s)."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
    k, cpu = a.sharded_request, []
    for r in range(a.requests):
        c0 = time.process_time()
        info = sm.forget(order[r * k:(r + 1) * k].tolist(), x, y)
        cpu.append(time.process_time() - c0)
        if r == 0:
            print(f"{tag} sharded request 1: shards {info['shards_retrained']} from slice {info['from_slice']}, "
                  f"{info['sample_passes']} of {info['full_sample_passes']} sample-passes", flush=True)
    keep = torch.sort(order[a.requests * k:]).values
    fresh = sharded_finetune(net, x[keep], y[keep], ids=keep, user_weights=uw, **sm.bench_opts)
    sa, sb = sm.state_dict(), fresh.state_dict()
    num = max(float((sa[n].double() - sb[n].double()).abs().max()) for n in sa if sa[n].is_floating_point())
    den = max(float(sb[n].double().abs().max()) for n in sb if sb[n].is_floating_point())
    e = num / den  # max |w − ŵ| / max |ŵ| over every shard and slice checkpoint
    return e, statistics.median(cpu)


def run_seed(name, net, uw, data, seed, a):
    """{engine: (gap points, request/user ratio, E)} and the auto choice of one seed."""
    tag = f"[{name} seed {seed}]"
    (x, y), (xv, yv), (xt, yt) = data
    out = {}
    ordinary, lr, _, epochs = tuned_ordinary(net, uw, x, y, xv, yv, seed, a.max_epochs, a.patience, tag)
    e_ord = 1 - accuracy(ordinary, f32(xt), yt)
    capped = " — AT THE EPOCH CAP: the yardstick may not have converged" if epochs >= a.max_epochs else ""
    print(f"{tag} ordinary lr {lr:g} ({epochs} epochs{capped}): test_error_ordinary {e_ord:.4f}", flush=True)
    keep = torch.arange(len(y))[a.requests * max(1, len(y) // 100):]  # D_r of the linearised requests below
    c0 = time.process_time()
    early_stopped(net, uw, x[keep], y[keep], x[keep][:1], y[keep][:1], lr, seed, epochs, epochs + 1)
    user_s = time.process_time() - c0
    print(f"{tag} user re-fine-tune on D_r (the yardstick's recipe): {user_s:.2f} CPU s", flush=True)
    if "linearised" in a.engines or "auto" in a.engines:
        n_core = int(round(a.core_fraction * len(y)))
        state, pre, head, core_lr, mu = tuned_forgettable(net, uw, x, y, xv, yv, n_core, lr, a.mus, epochs, tag)
        n_core = n_core if core_lr else 0
        e_lin = 1 - accuracy(state.model, xt, yt)
        print(f"{tag} linearised at the {'core point (core lr ' + format(core_lr, 'g') + ')' if core_lr else 'pretrained point'}"
              f", µ {mu:g}: test_error {e_lin:.4f} (pretrained point {1 - accuracy(pre.model, xt, yt):.4f}"
              + (f", head only {1 - accuracy(head.model, xt, yt):.4f})" if head is not None else ")"), flush=True)
        k = max(1, len(y) // 100)
        e, req_s, _ = requests(state, net, uw, x, y, n_core, k, a.requests, lr, epochs, seed, tag, user=False)
        out["linearised"] = (100 * (e_lin - e_ord), user_s / req_s, e)
    if "sharded" in a.engines or "auto" in a.engines:
        shards = a.shards
        if shards == "auto":  # what `mlforget finetune --shards auto` does: the learning curve decides S
            got = choose_shards(net, x, y, int(logits(net, x[:1]).shape[1]), user_weights=uw, seed=seed,
                                budget={"epochs": max(1, epochs), "lr": lr, "batch_size": 32})
            shards = got["shards"]
            print(f"{tag} {got['reason']}", flush=True)
        opts = {"shards": int(shards), "slices": a.slices, "epochs": max(1, epochs), "lr": lr, "batch_size": 32,
                "seed": seed}
        c0 = time.process_time()
        sm = sharded_finetune(copy.deepcopy(net).float(), f32(x), y, user_weights=uw, **opts)
        train_s = time.process_time() - c0
        sm.bench_opts = opts
        e_sh = 1 - accuracy(sm, f32(xt), yt)
        print(f"{tag} sharded S={shards} R={a.slices}: test_error {e_sh:.4f}, training {train_s:.1f} CPU s",
              flush=True)
        e, req_s = sharded_requests(sm, copy.deepcopy(net).float(), uw, f32(x), y, a, seed, tag)
        print(f"{tag} sharded: {a.requests} requests of {a.sharded_request}, median {req_s:.3f} CPU s, "
              f"exact_max_rel_diff {e:.2e}", flush=True)
        out["sharded"] = (100 * (e_sh - e_ord), user_s / req_s, e)
    if "auto" in a.engines:
        d = preflight(net, x, y, int(logits(net, x[:1]).shape[1]), user_weights=uw, seed=seed,
                      budget={"epochs": max(1, epochs // (1 if a.preflight_full else 2)), "lr": lr, "batch_size": 32})
        print(f"{tag} strategy auto={d['reason']}", flush=True)
        out["auto"] = (d["engine"],) + out[d["engine"]]
    return out


def summary(name, results):
    """One line per engine over the seeds (module docstring)."""
    for engine in [e for e in ("linearised", "sharded", "auto") if e in results[0]]:
        rows = [r[engine] for r in results]
        label = engine
        if engine == "auto":
            chosen = [r[0] for r in rows]
            print(f"[{name}] auto chose per seed: {', '.join(chosen)}")
            label = "auto=" + max(set(chosen), key=chosen.count)
            rows = [r[1:] for r in rows]
        gaps, ratios, errs = zip(*rows)
        m = statistics.mean(gaps)
        half = T975.get(len(gaps) - 1, 2.0) * statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 \
            else float("nan")
        print(f"[{name}] strategy {label} accuracy_gap_points {m:.2f} [{m - half:.2f}, {m + half:.2f}]; "
              f"request_vs_user_finetune {statistics.median(ratios):.1f}; exact_max_rel_diff {max(errs):.2e}",
              flush=True)


def sweep(name, net, uw, data, seeds, a):
    """Sharded accuracy and request cost against S and R (``--sweep``): per (S, R), over the seeds, the test error
    gap to the yardstick and the mean sample-passes of a 1-sample request as a share of the user's re-fine-tune
    (N · the yardstick's epochs), with its CPU-time ratio."""
    rows = {}
    for seed in range(seeds):
        tag = f"[{name} sweep seed {seed}]"
        (x, y), (xv, yv), (xt, yt) = data(a.n_eff, seed)
        ordinary, lr, _, epochs = tuned_ordinary(net, uw(seed), x, y, xv, yv, seed, a.max_epochs, a.patience, tag)
        e_ord = 1 - accuracy(ordinary, f32(xt), yt)
        c0 = time.process_time()
        early_stopped(net, uw(seed), x, y, x[:1], y[:1], lr, seed, epochs, epochs + 1)
        user_s = time.process_time() - c0
        for S, R in a.sweep_sizes:
            if True:
                sm = sharded_finetune(copy.deepcopy(net).float(), f32(x), y, user_weights=uw(seed), shards=S,
                                      slices=R, epochs=max(1, epochs), lr=lr, seed=seed,
                                      validation=(f32(xv), yv) if a.validated else None)
                gap = 100 * (1 - accuracy(sm, f32(xt), yt) - e_ord)
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
                share, cpu = [], []
                for r in range(5):
                    c0 = time.process_time()
                    info = sm.forget([int(order[r])], f32(x), y)
                    cpu.append(time.process_time() - c0)
                    share.append(info["sample_passes"] / (len(y) * max(1, epochs)))
                rows.setdefault((S, R), []).append((gap, statistics.mean(share), user_s / statistics.median(cpu)))
                print(f"{tag} S={S} R={R}: gap {gap:.2f} points, request {statistics.mean(share):.3f} of the "
                      f"re-fine-tune's sample-passes, CPU ratio {user_s / statistics.median(cpu):.1f}", flush=True)
    for (S, R), v in sorted(rows.items()):
        gaps = [g for g, _, _ in v]
        m = statistics.mean(gaps)
        half = T975.get(len(gaps) - 1, 2.0) * statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 \
            else float("nan")
        print(f"[{name}] sweep S={S} R={R}: accuracy_gap_points {m:.2f} [{m - half:.2f}, {m + half:.2f}]; "
              f"request_share {statistics.mean(s for _, s, _ in v):.3f}; "
              f"request_vs_user_finetune {statistics.median(r for _, _, r in v):.1f}", flush=True)


def shard_choice(name, net, uw, data, seeds, a):
    """``--choose-shards``: per seed, what ``--shards auto`` picks (:func:`choose_shards`) with the yardstick's
    tuned rate and epochs as the budget, beside the yardstick's test error."""
    for seed in range(seeds):
        tag = f"[{name} shards seed {seed}]"
        (x, y), (xv, yv), (xt, yt) = data(a.n_eff, seed)
        ordinary, lr, _, epochs = tuned_ordinary(net, uw(seed), x, y, xv, yv, seed, a.max_epochs, a.patience, tag)
        e_ord = 1 - accuracy(ordinary, f32(xt), yt)
        c = int(logits(net, x[:1]).shape[1])
        got = choose_shards(net, x, y, c, user_weights=uw(seed), seed=seed,
                            budget={"epochs": max(1, epochs), "lr": lr, "batch_size": 32},
                            candidates=tuple(sorted({S for S, _ in a.sweep_sizes}, reverse=True)))
        print(f"{tag} yardstick test_error {e_ord:.4f} (lr {lr:g}, {epochs} epochs); {got['reason']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="N = 400, 1 seed, short pretraining: a smoke run")
    ap.add_argument("--n", type=int, default=None, help="user samples per model (default 1,000; --small 400)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds (default 3; --small 1)")
    ap.add_argument("--mu", default="1e-3,1e-4,1e-5,1e-6,1e-7", help="µ values tried (picked on validation)")
    ap.add_argument("--core-fraction", type=float, default=0.1, help="share of the user samples never deleted")
    ap.add_argument("--max-epochs", type=int, default=40, help="the yardstick's epoch cap (early stopping)")
    ap.add_argument("--patience", type=int, default=5, help="epochs without a better validation error")
    ap.add_argument("--requests", type=int, default=20, help="sequential deletion requests of 1 %% each")
    ap.add_argument("--only", default=None, help="comma-separated models: cnn, transformer, causal-lm")
    ap.add_argument("--engines", default="linearised,sharded,auto", help="linearised, sharded, auto")
    ap.add_argument("--shards", default="4", help="sharded: S, or auto (chosen from the learning curve)")
    ap.add_argument("--slices", type=int, default=4, help="sharded: R")
    ap.add_argument("--pretrain", default=None, help="SAMPLES,EPOCHS of every pretraining")
    ap.add_argument("--sweep", action="store_true", help="sharded accuracy and request cost against S and R")
    ap.add_argument("--validated", action="store_true", help="--sweep: every stage keeps its best epoch on the "
                    "validation set (the yardstick's early stopping)")
    ap.add_argument("--choose-shards", action="store_true", help="what --shards auto picks, per seed")
    ap.add_argument("--sweep-sizes", default="1x1,1x4,2x1,2x4,4x1,4x4,8x1,8x4",
                    help="--sweep: the S x R points, comma-separated")
    ap.add_argument("--preflight-full", action="store_true", help="auto: the pre-flight's ordinary fine-tuning "
                    "takes the yardstick's epochs (default: half)")
    ap.add_argument("--no-core", action="store_true", help="linearised: the pretrained point only (no core)")
    ap.add_argument("--sharded-request", type=int, default=1, help="sharded: samples per request")
    ap.add_argument("--lm-user-weights", default="lora:c_attn,attn.c_proj:r4")
    ap.add_argument("--cnn-user-weights", default="layers:proj,fc", help="as `mlforget finetune --user-weights`")
    ap.add_argument("--transformer-user-weights", default="lora:query,key,value,dense:r4:save=classifier")
    a = ap.parse_args()
    a.shards = a.shards if a.shards == "auto" else int(a.shards)
    a.sweep_sizes = [tuple(int(v) for v in p.lower().split("x")) for p in a.sweep_sizes.split(",") if p]
    a.mus = [float(v) for v in a.mu.split(",")]
    a.engines = [e for e in a.engines.split(",") if e]
    global NO_CORE, PRETRAIN
    NO_CORE = a.no_core
    PRETRAIN = tuple(int(v) for v in a.pretrain.split(",")) if a.pretrain else None
    only = None if a.only is None else a.only.split(",")
    n = a.n or (400 if a.small else 1000)
    seeds = a.seeds or (1 if a.small else 3)
    for name, net, data in pretrained_models(a.small, only):
        spec = {"cnn": a.cnn_user_weights, "transformer": a.transformer_user_weights}.get(name, a.lm_user_weights)
        uw = seeded_user_weights(spec)
        if a.choose_shards and (only is None or name in only):
            a.n_eff = n
            shard_choice(name, net, uw, data, seeds, a)
            continue
        if a.sweep and (only is None or name in only):
            a.n_eff = n
            sweep(name, net, uw, data, seeds, a)
            continue
        if only is None or name in only:
            t0 = time.perf_counter()
            results = [run_seed(name, net, uw(s), data(n, s), s, a) for s in range(seeds)]
            summary(name, results)
            print(f"[{name}] {time.perf_counter() - t0:.0f} s wall", flush=True)


if __name__ == "__main__":
    main()
