"""Calibration of the forgetting verdict on model families the tests do not use, with the truth known by
construction (docs/decisions/verdict.md, "Calibration").

Families: an MLP on vectors (scikit-learn ``make_classification``, 10 % label noise), an LSTM on tokens (a
motif-count task, 15 % label noise), a 1-D CNN on MNIST-1D, a CNN on scikit-learn digits with 20 % label noise
(and, with ``--families all``, the same CNN on clean digits). Each is trained to (near) zero training loss on a
few thousand examples at most.

Per family and seed: the original; 16 reference models (8 pairs of complementary halves, trained once and
reused for every request; the headline uses the first 2 pairs, the power table 2 / 4 / 8); then for every
forget set — 100 samples, 1 %, 10 %, one whole class — the gold (retrained on D_r from another
initialisation), output blends of original and gold with 0.25 / 0.5 / 0.75 of the gold's probabilities, the
original fine-tuned briefly on D_r, the original fine-tuned on D_f, and for a class four hiders: the class's
head row zeroed and its bias pushed down (hiding); the same after a function-preserving permutation of the
penultimate units (hide_permuted); a wrapper lowering the class's logit after the head (logit_wrapper); the
head re-fitted on D_r's features (head_refit). Requests of 10, 20 and 30 samples are ``--draws`` random
subsets of the 100 (the model retrained without the 100 never saw any of them). Truth: original and
fine-tuned on D_r → did_not_forget, gold → forgot, blends → partly, fine-tuned on D_f → moved_wrong_way,
hiders → hidden.

Prints the confusion table (truth × verdict, with and without the reference models), per-size rows, and a last
line ``false_forgot F; blend25_forgot B; hider_forgot H; gold_forgot_at_10 G10; gold_forgot_at_20 G20;
gold_forgot_at_100 G100; undecided_at_10 U10``
with the reference models' cost beside it.

    OMP_NUM_THREADS=1 python benchmarks/verdict_calibration.py [--seeds 3] [--pairs 8] [--draws 8] [--families core|all]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections import Counter, defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.readouts.forgetting import PerExample, judge_forgetting, per_example_statistics
from scrubnet.readouts.references import out_mean, out_scale, train_references
from scrubnet.readouts.verdict_class import class_probe
from scrubnet.readouts.verdict_rules import VerdictRules

HIDERS = ("hiding", "hide_permuted", "logit_wrapper", "head_refit")
TRUTH = {"original": "did_not_forget", "gold": "forgot", "blend25": "partly", "blend50": "partly",
         "blend75": "partly", "ft_retain": "did_not_forget", "ft_forget": "moved_wrong_way",
         **{h: "hidden" for h in HIDERS}}
NOT_FORGOTTEN = ("did_not_forget", "moved_wrong_way", "hidden")
UNDECIDED = ("inconclusive", "nothing_to_measure")
COLS = ("forgot", "partly", "did_not_forget", "moved_wrong_way", "hidden", "inconclusive", "nothing_to_measure")


# --- data and models ----------------------------------------------------------------------------------------

def _noisy(y: np.ndarray, frac: float, classes: int, rng) -> np.ndarray:
    flip = rng.random(len(y)) < frac
    return np.where(flip, rng.integers(0, classes, len(y)), y)


def vectors(seed: int):
    from sklearn.datasets import make_classification
    x, y = make_classification(n_samples=1600, n_features=20, n_informative=10, n_classes=4, flip_y=0.1,
                               class_sep=1.0, random_state=seed)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y), 4, 1200


def tokens(seed: int):
    rng = np.random.default_rng(seed)
    n, length, vocab = 1600, 16, 20
    x = rng.integers(4, vocab, size=(n, length))
    y = rng.integers(0, 4, n)
    for i in range(n):  # class k: motif token k appears most often
        pos = rng.choice(length, size=3 + rng.integers(0, 3), replace=False)
        x[i, pos] = y[i]
    return torch.tensor(x), torch.tensor(_noisy(y, 0.15, 4, rng)), 4, 1200


def mnist1d(seed: int):
    from mnist1d.data import get_dataset_args, make_dataset
    args = get_dataset_args()
    args.num_samples, args.seed = 2000, seed
    d = make_dataset(args)
    x = np.concatenate([d["x"], d["x_test"]])[:1600]
    y = np.concatenate([d["y"], d["y_test"]])[:1600]
    return torch.tensor(x, dtype=torch.float32)[:, None], torch.tensor(y), 10, 1200


def digits(seed: int, noise: float = 0.2):
    from sklearn.datasets import load_digits
    d = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(d.target))
    x = torch.tensor(d.images[order] / 16.0, dtype=torch.float32)[:, None]
    y = _noisy(d.target[order], noise, 10, rng)
    return x, torch.tensor(y), 10, 1300


class LSTMNet(nn.Module):
    def __init__(self, vocab=20, classes=4):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(vocab, 16), nn.LSTM(16, 48, batch_first=True), \
            nn.Linear(48, classes)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0][:, -1])


def make_model(family: str, classes: int) -> nn.Module:
    if family == "mlp-vectors":
        return nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes))
    if family == "lstm-tokens":
        return LSTMNet(classes=classes)
    if family == "cnn1d-mnist1d":
        return nn.Sequential(nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.Conv1d(16, 32, 5, stride=2, padding=2),
                             nn.ReLU(), nn.Flatten(), nn.Linear(32 * 20, 64), nn.ReLU(), nn.Linear(64, classes))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, classes))


FAMILIES = {"mlp-vectors": (vectors, 40), "lstm-tokens": (tokens, 60), "cnn1d-mnist1d": (mnist1d, 40),
            "cnn-digits-noisy": (digits, 60), "cnn-digits-clean": (lambda s: digits(s, 0.0), 30)}


def train(model: nn.Module, x, y, epochs: int, seed: int, lr: float = 4e-3, batch: int = 128) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), batch):
            b = perm[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
    return model.eval()


class Blend(nn.Module):
    """Log of (1 − α)·softmax(original) + α·softmax(gold): an output blend closing about α of the gap."""

    def __init__(self, original: nn.Module, gold: nn.Module, alpha: float):
        super().__init__()
        self.original, self.gold, self.alpha = original, gold, alpha

    def forward(self, x):
        p = (1 - self.alpha) * F.softmax(self.original(x), -1) + self.alpha * F.softmax(self.gold(x), -1)
        return torch.log(p.clamp_min(1e-30))


def hiding(original: nn.Module, label: int) -> nn.Module:
    """The class's head row zeroed and its bias pushed below every other: the logit suppressed, the features kept."""
    m = copy.deepcopy(original)
    head = [mod for mod in m.modules() if isinstance(mod, nn.Linear)][-1]
    with torch.no_grad():
        head.weight[label] = 0.0
        head.bias[label] = head.bias.min() - 20.0
    return m


def permuted(original: nn.Module, seed: int) -> nn.Module:
    """The same function with the penultimate layer's units permuted (the layer feeding the head): the last
    hidden Linear's rows (or the LSTM's hidden units: every gate's rows and the recurrent columns) and the
    head's columns."""
    m = copy.deepcopy(original)
    head = [mod for mod in m.modules() if isinstance(mod, nn.Linear)][-1]
    perm = torch.randperm(head.in_features, generator=torch.Generator().manual_seed(seed + 99))
    with torch.no_grad():
        if isinstance(m, LSTMNet):
            h = m.lstm.hidden_size
            rows = torch.cat([g * h + perm for g in range(4)])
            for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
                p = getattr(m.lstm, name)
                p.copy_(p[rows])
            m.lstm.weight_hh_l0.copy_(m.lstm.weight_hh_l0[:, perm])
        else:
            prev = [mod for mod in m.modules() if isinstance(mod, nn.Linear)][-2]
            prev.weight.copy_(prev.weight[perm])
            prev.bias.copy_(prev.bias[perm])
        head.weight.copy_(head.weight[:, perm])
    return m


class LogitWrapper(nn.Module):
    """The model with one class's logit lowered by a constant after its head (no single head gives the logits)."""

    def __init__(self, model: nn.Module, label: int, by: float = 30.0):
        super().__init__()
        self.model, self.label, self.by = model, label, by

    def forward(self, x):
        out = self.model(x).clone()
        out[:, self.label] -= self.by
        return out


def head_refit(original: nn.Module, x, y, seed: int, epochs: int = 30) -> nn.Module:
    """The head re-initialised and re-fitted on D_r's features (the rest frozen): the class never a target."""
    m = copy.deepcopy(original)
    head = [mod for mod in m.modules() if isinstance(mod, nn.Linear)][-1]
    torch.manual_seed(seed)
    head.reset_parameters()
    for p in m.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    m.eval()  # no dropout / batch statistics move: only the head learns
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 128):
            b = perm[i:i + 128]
            opt.zero_grad()
            F.cross_entropy(m(x[b]), y[b]).backward()
            opt.step()
    for p in m.parameters():
        p.requires_grad_(True)
    return m.eval()


# --- one family, one seed -----------------------------------------------------------------------------------

def forget_sets(y_train: torch.Tensor, seed: int, classes: int) -> dict[str, np.ndarray]:
    """Random sets of 100, 1 % and 10 % of the training data and one whole class; the 10-, 20- and 30-sample
    requests are drawn from the 100 (a model retrained without the 100 never saw any subset of them)."""
    rng = np.random.default_rng(seed + 7)
    n = len(y_train)
    perm = rng.permutation(n)
    label = seed % classes
    return {"100": perm[:100], "1%": perm[100:100 + max(n // 100, 1)], "10%": perm[:n // 10],
            "class": np.flatnonzero(y_train.numpy() == label)}


def candidates(family: str, orig: nn.Module, x, y, ids: np.ndarray, retain: np.ndarray, classes: int,
               epochs: int, seed: int, label: int | None) -> dict[str, nn.Module]:
    gold = train(make_model(family, classes), x[retain], y[retain], epochs, seed + 500)
    out = {"original": orig, "gold": gold}
    for a in (25, 50, 75):
        out[f"blend{a}"] = Blend(orig, gold, a / 100)
    out["ft_retain"] = train(copy.deepcopy(orig), x[retain], y[retain], 1, seed + 600, lr=3e-4)
    ft = copy.deepcopy(orig)
    opt = torch.optim.Adam(ft.parameters(), lr=1e-3)
    ft.train()
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(ft(x[ids]), y[ids]).backward()
        opt.step()
    out["ft_forget"] = ft.eval()
    if label is not None:
        out["hiding"] = hiding(orig, label)
        perm = permuted(orig, seed)
        with torch.no_grad():
            diff = float((perm(x[:256]) - orig(x[:256])).abs().max())
        assert diff < 1e-4, f"the permutation changed the function ({diff})"
        out["hide_permuted"] = hiding(perm, label)
        out["logit_wrapper"] = LogitWrapper(orig, label)
        out["head_refit"] = head_refit(orig, x[retain], y[retain], seed + 700)
    return out


def run_one(family: str, seed: int, cases: list, pairs: int) -> dict:
    make_data, epochs = FAMILIES[family]
    x, y, classes, n_train = make_data(seed)
    x_tr, y_tr, x_h, y_h = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    orig = train(make_model(family, classes), x_tr, y_tr, epochs, seed)
    t_orig = time.perf_counter() - t0

    def fit(idx, s):
        torch.manual_seed(s)
        return train(make_model(family, classes), x_tr[idx], y_tr[idx], epochs, s)

    refs = train_references(fit, n_train, pairs=pairs, seed=seed + 1)
    phi = lambda xx, yy: np.stack([per_example_statistics(m, (xx, yy)).score("confidence")  # noqa: E731
                                   for m in refs.models])
    h_phi = phi(x_h, y_h)
    info = {"family": family, "seed": seed, "train_s": t_orig, "refs_s": refs.seconds, "refs": len(refs.models),
            "train_error": float((orig(x_tr).argmax(1) != y_tr).float().mean()),
            "heldout_error": float((orig(x_h).argmax(1) != y_h).float().mean())}
    for size, ids in forget_sets(y_tr, seed, classes).items():
        retain = np.setdiff1d(np.arange(n_train), ids)
        label = int(y_tr[ids[0]]) if size == "class" else None
        models = candidates(family, orig, x_tr, y_tr, ids, retain, classes, epochs, seed, label)
        pe = lambda m, xx, yy: _pe_json(per_example_statistics(m, (xx, yy)))  # noqa: E731
        case = {"family": family, "seed": seed, "size": size, "f_phi": phi(x_tr[ids], y_tr[ids]).tolist(),
                "h_phi": h_phi.tolist(), "f_out": (~refs.members[:, ids]).tolist(),
                "before": [pe(orig, x_tr[ids], y_tr[ids]), pe(orig, x_h, y_h)],
                "retain": pe(orig, x_tr[retain], y_tr[retain]), "after": {}, "probe": {}}
        for cond, m in models.items():
            case["after"][cond] = [pe(m, x_tr[ids], y_tr[ids]), pe(m, x_h, y_h)]
            case["probe"][cond] = class_probe(orig, m, (x_h, y_h), label, (x_tr[retain], y_tr[retain])) \
                if label is not None else None
        cases.append(case)
    return info


def _pe_json(p) -> list:
    return [p.loss.tolist(), p.margin.tolist(), p.labels.tolist(), p.confidence.tolist()]


def _pe(d: list) -> PerExample:
    return PerExample(*(np.asarray(v, dtype=np.int64 if i == 2 else np.float64) for i, v in enumerate(d)))


def _calibration(c: dict, mode: str, keep: np.ndarray | None) -> dict:
    """The reference offsets (and, for a ``v`` mode, per-example spreads) of mode ``refsK[v]``: the first
    K/2 pairs of the stored reference models."""
    if mode == "raw":
        return {}
    k = int(mode[4:].rstrip("v"))
    f_phi, f_out, h_phi = (np.asarray(c[key], float)[:k] for key in ("f_phi", "f_out", "h_phi"))
    f_out = f_out.astype(bool)
    if keep is not None:
        f_phi, f_out = f_phi[:, keep], f_out[:, keep]
    pick = np.random.default_rng(c["seed"]).integers(0, 2, size=(k // 2, h_phi.shape[1]))
    h_out = np.zeros(h_phi.shape, dtype=bool)
    h_out[0::2], h_out[1::2] = pick == 0, pick == 1
    if not mode.endswith("v"):
        return {"forget_offset": out_mean(f_phi, f_out), "heldout_offset": out_mean(h_phi, h_out)}
    h_mu, h_sd, pooled = out_scale(h_phi, h_out)
    f_mu, f_sd, _ = out_scale(f_phi, f_out, pooled=pooled)
    return {"forget_offset": f_mu, "heldout_offset": h_mu, "forget_scale": f_sd, "heldout_scale": h_sd}


def _sub(p: PerExample, keep) -> PerExample:
    return p if keep is None else p.subset(keep)


def requests(c: dict, draws: int):
    """(size label, forget-subset mask or None) of a stored case: the case itself, and for the 100-sample set
    ``draws`` random subsets of 10, 20 and 30."""
    yield c["size"], None
    if c["size"] == "100":
        for k in (10, 20, 30):
            for d in range(draws):
                keep = np.zeros(100, dtype=bool)
                keep[np.random.default_rng(1000 * c["seed"] + 10 * k + d).choice(100, k, replace=False)] = True
                yield str(k), keep


POWER_MODES = ("refs4", "refs8", "refs16", "refs4v", "refs8v", "refs16v")
POWER_CONDS = ("gold", "original", "ft_retain", "blend25")


def judge_cases(cases: list[dict], rules: VerdictRules | None = None, draws: int = 8,
                power: bool = True) -> list[dict]:
    """Every stored case judged without (``raw``) and with 4 reference models (``refs4``); the gold and
    three negatives of the 10/20/30-sample draws also with 4/8/16 references, with and without per-example
    variances (``refsKv``), as far as the stored references go."""
    rows = []
    # the drawn 10/20/30-sample requests (most of the verdicts) with 500 replicates: the intervals' ends move
    # by a few hundredths, the verdicts of the full-size requests keep 1000
    power_rules = VerdictRules(n_boot=500) if rules is None else rules
    for c in cases:
        n_refs = len(c["f_phi"])
        fb0, hb, rb = _pe(c["before"][0]), _pe(c["before"][1]), _pe(c["retain"])
        for size, keep in requests(c, draws):
            fb = _sub(fb0, keep)
            for cond, (fa, ha) in c["after"].items():
                fa = _sub(_pe(fa), keep)
                modes = ["raw", "refs4"]
                if power and keep is not None and cond in POWER_CONDS:
                    modes += [m for m in POWER_MODES if m != "refs4" and int(m[4:].rstrip("v")) <= n_refs]
                for mode in modes:
                    kw = _calibration(c, mode, keep)
                    v = judge_forgetting(fb, fa, hb, _pe(ha), rb, probe=c["probe"][cond],
                                         rules=rules if keep is None else power_rules, **kw)
                    rows.append({"family": c["family"], "seed": c["seed"], "size": size, "cond": cond,
                                 "mode": mode, "verdict": v.verdict, "f": v.fraction_closed,
                                 "f_ci": v.fraction_closed_ci, "gap_b": v.gap_before, "need": v.samples_needed,
                                 "n": v.n_forget, "probe": c["probe"][cond]})
    return rows


# --- the tables ----------------------------------------------------------------------------------------------

def table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'truth (condition)':<30}" + "".join(f"{c[:14]:>16}" for c in COLS))
    for cond in TRUTH:
        sel = [r for r in rows if r["cond"] == cond]
        if not sel:
            continue
        cnt = Counter(r["verdict"] for r in sel)
        print(f"{TRUTH[cond] + ' (' + cond + ')':<30}" + "".join(f"{cnt.get(c, 0):>16}" for c in COLS))


def metrics(rows: list[dict]) -> dict[str, float]:
    def frac(sel, ok):
        return sum(ok(r) for r in sel) / max(len(sel), 1)

    def gold(size):
        return frac([r for r in rows if r["cond"] == "gold" and r["size"] == size], lambda r: r["verdict"] == "forgot")
    neg = [r for r in rows if TRUTH[r["cond"]] in NOT_FORGOTTEN]
    return {"false_forgot": frac(neg, lambda r: r["verdict"] == "forgot"),
            "blend25_forgot": frac([r for r in rows if r["cond"] == "blend25"], lambda r: r["verdict"] == "forgot"),
            "hider_forgot": frac([r for r in rows if r["cond"] in HIDERS], lambda r: r["verdict"] == "forgot"),
            "gold_forgot_at_10": gold("10"), "gold_forgot_at_20": gold("20"), "gold_forgot_at_100": gold("100"),
            "undecided_at_10": frac([r for r in rows if r["size"] == "10"], lambda r: r["verdict"] in UNDECIDED)}


def power_table(log: list[dict]) -> None:
    """Gold read ``forgot`` and the original / fine-tuned-on-D_r / 25 % blend read ``forgot`` (false) per
    request size and reference mode."""
    print("\npower: fraction of draws reading forgot (gold; and, false, original / ft_retain / blend25)")
    print(f"{'mode':<10}" + "".join(f"{'n=' + k:>26}" for k in ("10", "20", "30")))
    for mode in ("raw",) + POWER_MODES:
        cells = []
        for k in ("10", "20", "30"):
            sel = [r for r in log if r["mode"] == mode and r["size"] == k]
            if not sel:
                cells.append(f"{'-':>26}")
                continue
            g = [r for r in sel if r["cond"] == "gold"]
            gf = sum(r["verdict"] == "forgot" for r in g) / len(g)
            neg = [sum(r["verdict"] == "forgot" for r in sel if r["cond"] == c) for c in POWER_CONDS[1:]]
            cells.append(f"{gf:.2f} ({len(g)}) / {'/'.join(map(str, neg)):>7}")
        print(f"{mode:<10}" + "".join(f"{c:>26}" for c in cells))


def line(m: dict) -> str:
    return "; ".join(f"{k} {v:.3f}" for k, v in m.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=8, help="pairs of reference models per model (8: 16 models; the "
                    "headline uses the first 2 pairs, the power table 2/4/8)")
    ap.add_argument("--draws", type=int, default=8, help="random 10/20/30-sample requests per 100-sample set")
    ap.add_argument("--families", default="core", choices=("core", "all", "smoke"))
    ap.add_argument("--cache", default=None, help="JSON file of the per-example statistics: written after the "
                    "training, read instead of training when it exists (to re-judge with other rules)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fams = {"core": list(FAMILIES)[:4], "all": list(FAMILIES), "smoke": ["mlp-vectors"]}[args.families]
    t0 = time.perf_counter()
    if args.cache and os.path.exists(args.cache):
        with open(args.cache) as fh:
            stored = json.load(fh)
        cases, infos = stored["cases"], stored["infos"]
    else:
        cases, infos = [], []
        for seed in range(args.seeds):  # seed-major: a partial cache covers every family
            for fam in fams:
                infos.append(run_one(fam, seed, cases, args.pairs))
                i = infos[-1]
                print(f"{fam} seed {seed}: train error {i['train_error']:.3f}, held-out error "
                      f"{i['heldout_error']:.3f}, original {i['train_s']:.1f} s, {i['refs']} reference models "
                      f"{i['refs_s']:.1f} s ({time.perf_counter() - t0:.0f} s so far)", flush=True)
                if args.cache:  # written after every model, through a temporary file
                    with open(args.cache + ".tmp", "w") as fh:
                        json.dump({"cases": cases, "infos": infos}, fh)
                    os.replace(args.cache + ".tmp", args.cache)
    t1 = time.perf_counter()
    log = judge_cases(cases, draws=args.draws)
    n_fam, n_pairs = len({c["family"] for c in cases}), len({(c["family"], c["seed"]) for c in cases})
    for mode in ("raw", "refs4"):
        rows = [r for r in log if r["mode"] == mode]
        name = "with 4 reference models (offline LiRA calibration)" if mode == "refs4" else "without reference models"
        table(rows, f"confusion, {name}: all sizes, {n_fam} families, {n_pairs} (family, seed) pairs")
        by = defaultdict(Counter)
        for r in rows:
            by[r["size"]][r["verdict"]] += 1
        for size, cnt in by.items():
            print(f"  size {size:>5}: " + ", ".join(f"{k} {n}" for k, n in cnt.most_common()))
        print(f"  {name}: {line(metrics(rows))}")
    power_table(log)
    hid = [r for r in log if r["mode"] == "refs4" and r["cond"] in HIDERS + ("gold", "ft_retain")
           and r["size"] == "class"]
    print("\nclass requests (refs4): condition, family/seed, verdict, probe recall input -> scrubbed")
    for r in hid:
        p = r["probe"] or {}
        print(f"  {r['cond']:<14} {r['family']}/{r['seed']}: {r['verdict']:<16} "
              f"{p.get('recall_before', float('nan')):.2f} -> {p.get('recall_after', float('nan')):.2f}")
    need = [(r["n"], r["need"]) for r in log if r["need"] is not None]
    print(f"samples_needed at or below the sample count given: {sum(k <= m for m, k in need)} of {len(need)}")
    gold = [r for r in log if r["mode"] == "refs4" and r["cond"] == "gold"]
    print("gold's fraction closed (refs4), per size: " + ", ".join(
        f"{s} {np.nanmean([r['f'] for r in gold if r['size'] == s]):.2f}"
        for s in ("10", "20", "30", "100", "1%", "10%", "class")))
    ref_s = np.mean([i["refs_s"] for i in infos])
    ratio = np.mean([i["refs_s"] / i["train_s"] for i in infos])
    n_refs = infos[0]["refs"]
    print(f"judging {time.perf_counter() - t1:.0f} s; total {time.perf_counter() - t0:.0f} s")
    print(line(metrics([r for r in log if r["mode"] == "refs4"]))
          + f"  (reference models: 4 per model, one-off {ref_s * 4 / n_refs:.1f} s = "
            f"{ratio * 4 / n_refs:.1f}x one training of the original, amortised over every request)")


if __name__ == "__main__":
    main()
