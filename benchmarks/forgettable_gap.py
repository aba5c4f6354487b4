"""What closes the gap between forgettable and ordinary fine-tuning: a small synthetic transformer study.

A tiny BERT (hidden 32, 2 layers, 4 heads) is pretrained (full, cross-entropy) on task A — which of four token
groups is most frequent among the visible tokens of a padded sequence — then fine-tuned on task B — which of
groups 0–2 the first token belongs to (the pretrained summary of the whole sequence carries it only weakly;
attending to position 0 is new) — from 300 labelled sequences, with a fresh classifier. Each row fine-tunes one parameter subset
forgettably (:func:`scrubnet.mlforget.finetune.forgettable_finetune`, the exact optimum) and reports test
accuracy; the yardstick fine-tunes the same subset the ordinary way (Adam on cross-entropy, lr picked on a
validation set). One JSON line per row to ``--out``.

    python benchmarks/forgettable_gap.py --out /tmp/gap.jsonl [--quick]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from scrubnet.mlforget.finetune import accuracy, forgettable_finetune, ordinary_finetune
from scrubnet.mlforget.model import MLConfig
from scrubnet.mlforget.solve import SolverConfig
from scrubnet.models.call import ModelInputs, call_model
from scrubnet.models.lora import LoRA, merge_lora

VOCAB, LENGTH, GROUPS = 60, 12, 4


def sequences(n: int, seed: int) -> tuple[ModelInputs, torch.Tensor, torch.Tensor]:
    """(inputs with attention mask, task-A labels, task-B labels) for n padded sequences."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    ids[:, 0] = torch.randint(1, 31, (n,), generator=g)  # the first token is from groups 0-2
    lens = torch.randint(5, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH)[None, :] < lens[:, None]).long()
    ids = ids * mask
    group = torch.where((ids >= 1) & (ids <= 40), (ids - 1) // 10, torch.full_like(ids, -1))
    counts = torch.stack([(group == k).sum(1) for k in range(GROUPS)], 1).double()
    jitter = 1e-3 * torch.rand(n, GROUPS, generator=g, dtype=torch.float64)  # random tie-break
    return ModelInputs(ids, {"attention_mask": mask}), (counts + jitter).argmax(1), group[:, 0]


def pretrained_bert(x: ModelInputs, y: torch.Tensor, epochs: int, seed: int = 0):
    """A tiny BERT trained (all weights, CE, Adam) on task A; its classifier then replaced by a fresh 3-way one."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=LENGTH, num_labels=GROUPS,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    net = BertForSequenceClassification(cfg)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 64):
            idx = perm[i:i + 64]
            loss = F.cross_entropy(call_model(net, x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    acc_a = accuracy(net, x, y)
    net.classifier = torch.nn.Linear(32, 3)
    with torch.no_grad():
        net.classifier.weight.normal_(0.0, cfg.initializer_range)  # HF's head init (std 0.02)
        net.classifier.bias.zero_()
    net.num_labels = net.config.num_labels = 3
    return net.eval(), acc_a


def head_scaled(net, std: float):
    out = copy.deepcopy(net)
    with torch.no_grad():
        out.classifier.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(5))
    return out


def ordinary_best(net, uw, tr, va, te, lrs, epochs) -> dict:
    best = None
    for lr in lrs:
        t0 = time.perf_counter()
        m = ordinary_finetune(net, tr[0], tr[1], user_weights=uw, lr=lr, epochs=epochs)
        row = {"lr": lr, "val": accuracy(m, *va), "test": accuracy(m, *te), "seconds": time.perf_counter() - t0}
        if best is None or row["val"] > best["val"]:
            best = row
    return best


def forgettable_row(net, uw, tr, te, mu: float, scale: float) -> dict:
    t0 = time.perf_counter()
    cfg = MLConfig(mu=mu, target_scale=scale, leaky_slope=None, solver=SolverConfig(primal_max_rows=4096))
    st = forgettable_finetune(net, tr[0], tr[1], user_weights=uw, config=cfg)
    return {"test": accuracy(st.model, *te), "train": accuracy(st.model, *tr), "p": st.model.num_linearized,
            "solver": st.train_info["train_solver"], "seconds": time.perf_counter() - t0}


QV = ["query", "value"]
ALL = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]


def plan_layers() -> list[dict]:
    """Second round: the ridge below 1e-3 for the adapters, and user weights nearer the output."""
    qv = dict(name="lora-qv r4", uw=LoRA(QV, 4, modules_to_save=["classifier"]), std=0.2, s=5.0)
    rows = [dict(qv, mu=mu) for mu in (1e-5, 1e-6)]
    rows += [dict(name="lora-all r4", uw=LoRA(ALL, 4, modules_to_save=["classifier"]), std=0.2, mu=1e-5, s=5.0)]
    rows += [dict(name="pooler+head", uw=["bert.pooler", "classifier"], std=0.2, mu=mu, s=5.0)
             for mu in (1e-5, 1e-4, 1e-2)]
    rows += [dict(name="pooler+head", uw=["bert.pooler", "classifier"], std=0.02, mu=mu, s=5.0) for mu in (1e-4, 1e-3)]
    rows += [dict(name="lora-pooler r8", uw=LoRA(["pooler.dense"], 8, modules_to_save=["classifier"]), std=0.2,
                  mu=mu, s=5.0) for mu in (1e-4, 1e-3)]
    last = ["bert.encoder.layer.1.output.dense", "bert.pooler", "classifier"]
    rows += [dict(name="ffn-out(L1)+pooler+head", uw=last, std=0.2, mu=mu, s=5.0) for mu in (1e-4, 1e-3)]
    return rows


def core_rows(net, tr, va, te, n_core: int, emit) -> None:
    """Third round, the point of linearisation: LoRA fine-tuned the ordinary way on ``n_core`` labelled samples
    that are never deleted (a core set), then forgettable fine-tuning from that point on the user data."""
    xc, _, yc = sequences(n_core, 4)
    qv = LoRA(QV, 4, modules_to_save=["classifier"])
    best = None
    for lr in (3e-3, 1e-2, 3e-2):
        m = ordinary_finetune(net, xc, yc, user_weights=qv, lr=lr, epochs=40)
        if best is None or accuracy(m, *va) > best[0]:
            best = (accuracy(m, *va), m, lr)
    core = merge_lora(best[1])
    emit({"kind": "core", "n_core": n_core, "lr": best[2], "test": accuracy(core, *te)})
    both = (ModelInputs.cat([xc, tr[0]]), torch.cat([yc, tr[1]]))
    yard = ordinary_best(net, qv, both, va, te, [3e-3, 1e-2, 3e-2], 40)
    emit({"kind": "ordinary", "name": "lora-qv r4 on core+user", **yard})
    for name, uw in (("head", ["classifier"]), ("lora-qv r4 (second adapter)", LoRA(QV, 4, seed=1,
                                                                                       modules_to_save=["classifier"])),
                     ("pooler+head", ["bert.pooler", "classifier"])):
        for mu in (1e-4, 1e-3):
            res = forgettable_row(core, uw, tr, te, mu, 5.0)
            emit({"kind": "forgettable", "name": f"{name} at core point", "n_core": n_core, "mu": mu, **res,
                  "gap": yard["test"] - res["test"]})
    # the same through the API: the core samples join the user data (never deletable), core lr as picked above
    for name, uw in (("lora-qv r4", qv), ("pooler+head", ["bert.pooler", "classifier"])):
        t0 = time.perf_counter()
        st = forgettable_finetune(net, both[0], both[1], user_weights=uw, mu=1e-4, core_ids=torch.arange(n_core),
                                  core_train={"lr": best[2]})
        emit({"kind": "forgettable", "name": f"{name} via core_ids", "n_core": n_core, "mu": 1e-4,
              "test": accuracy(st.model, *te), "seconds": time.perf_counter() - t0,
              "gap": yard["test"] - accuracy(st.model, *te)})


def plan(quick: bool) -> list[dict]:
    """The rows: (name, user weights, head std, µ, s); the ordinary yardstick runs once per (weights, head)."""
    rows = []
    mus = [1e-4, 1e-3, 1e-2, 5e-2] if not quick else [1e-3, 5e-2]
    for mu in mus:
        rows.append(dict(name="head", uw="head", std=0.02, mu=mu, s=5.0))
        rows.append(dict(name="lora-qv r4", uw=LoRA(QV, 4, modules_to_save=["classifier"]), std=0.02, mu=mu, s=5.0))
    for s in ([1.0, 20.0] if not quick else []):
        rows.append(dict(name="lora-qv r4", uw=LoRA(QV, 4, modules_to_save=["classifier"]), std=0.02, mu=1e-3, s=s))
    for std in [0.2, 1.0]:
        for mu in ([1e-3, 1e-2] if not quick else [1e-3]):
            rows.append(dict(name="lora-qv r4", uw=LoRA(QV, 4, modules_to_save=["classifier"]), std=std, mu=mu,
                             s=5.0))
    for r in ([1, 8] if not quick else [8]):
        rows.append(dict(name=f"lora-qv r{r}", uw=LoRA(QV, r, modules_to_save=["classifier"]), std=0.2, mu=1e-3,
                         s=5.0))
    rows.append(dict(name="lora-qv r4 alpha16", uw=LoRA(QV, 4, 16.0, modules_to_save=["classifier"]), std=0.2,
                     mu=1e-3, s=5.0))
    rows.append(dict(name="lora-all r4", uw=LoRA(ALL, 4, modules_to_save=["classifier"]), std=0.2, mu=1e-3, s=5.0))
    rows.append(dict(name="pooler+head", uw=["bert.pooler", "classifier"], std=0.2, mu=1e-3, s=5.0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", action="store_true", help="the second round (plan_layers)")
    ap.add_argument("--core", type=int, default=0, help="the third round (core_rows) with this many core samples")
    ap.add_argument("--n-train", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    xa, ya, _ = sequences(3000, 0)
    net, acc_a = pretrained_bert(xa, ya, epochs=4 if args.quick else 12)
    net = net.double()
    data = [sequences(n, s) for n, s in ((args.n_train, 1), (300, 2), (1000, 3))]
    tr, va, te = [(d[0], d[2]) for d in data]
    with open(args.out, "a") as fh:
        def emit(row):
            print(json.dumps(row), flush=True)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
        emit({"pretrain_task_a_train_acc": acc_a, "n_train": args.n_train,
              "pretrained_features_head_only_chance": 1 / 3})
        if args.core:
            return core_rows(head_scaled(net, 0.2), tr, va, te, args.core, emit)
        done = {}
        for row in (plan_layers() if args.layers else plan(args.quick)):
            base = head_scaled(net, row["std"]) if row["std"] != 0.02 else net
            key = (row["name"], row["std"])
            if key not in done:
                done[key] = ordinary_best(base, row["uw"], tr, va, te, [3e-3, 1e-2, 3e-2], 40 if not args.quick
                                          else 10)
                emit({"kind": "ordinary", "name": row["name"], "head_std": row["std"], **done[key]})
            res = forgettable_row(base, row["uw"], tr, te, row["mu"], row["s"])
            emit({"kind": "forgettable", "name": row["name"], "head_std": row["std"], "mu": row["mu"],
                  "target_scale": row["s"], **res, "gap": done[key]["test"] - res["test"]})


if __name__ == "__main__":
    main()
