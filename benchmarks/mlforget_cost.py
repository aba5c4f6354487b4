"""Benchmark: one ML-Forgetting request against retraining the user weights from scratch, at equal accuracy.

Per problem, one request (the split's D_f for the embedded problems, 1 % of the user data for the synthetic
one), each contender timed ``--reps`` times (≥ 3) in alternated order (forward, then backward, …) and the
**median** reported; the short contenders (the two requests, the dual retrain) run once untimed first, the
long iterative retrains amortise their first-call overhead over their iterations; one torch thread unless ``--threads`` says otherwise. The accuracy of every answer is
measured against the exact minimiser w* = argmin L_{D_r} (the dual solve from scratch in float64, or CG to
1e-10 when the Gram is too large), as ‖w − w*‖ and as the Gaussian KL ‖w − w*‖²/(2σ²).

The papers' figures (their comparison, kept for reference):

* **forget, the papers' SGD step** — the exact residual gradient on D_r, then 3 epochs of SGD (batch 256,
  momentum 0.9, lr 0.5/λ_max(H) halved every epoch) on L̂(v) = ½vᵀHv − gᵀv: fast but inexact;
* **retrain, the papers' SGD** from 0 (batch 64, momentum 0.9, lr min(0.05, 0.5/λ_max), ×0.1 at 50 % and
  80 % of ``--sgd-epochs``) until its training loss on D_r is ≤ that of the SGD step (training epochs timed,
  not the per-epoch loss evaluations; ``reached: no`` when the schedule ends first: a lower bound);
  ``speedup_papers_sgd:`` = the ratio of the two.

The yardstick (the question a user asks: how much does a request save over retraining *to the same answer*):

* **forget, exact** — the library's request (``forget_request``: the dual Schur-complement step on the Gram
  eigendecomposed once per checkpoint, or warm-started float64 CG with the Nyström sketch built once);
* **retrain, dual from scratch** — the Gram of D_r, a Cholesky, one VJP (exact to rounding; not timed above
  2·``dual_max_rows`` Gram rows, where its O((Nc)³) Cholesky is never the best);
* **retrain, CG from zero** — float64 CG with the prebuilt Nyström sketch (its build not counted: generous
  to the yardstick), to the absolute tolerance that gives the exact request's accuracy;
* ``speedup:`` = the faster retrain / the exact request, printed last for each problem. The
  once-per-checkpoint build (Gram + eigendecomposition, or the sketch) is printed separately with the number
  of requests after which it has paid for itself.

Problems: ``embedded`` (the default experiment's MNIST-1D MLP, |D| = 500, D_f = 25), ``digits`` (the 2-D CNN
with BatchNorm on scikit-learn digits, 60 per class, D_f = 25 of class 0), ``synthetic`` (N = ``--n`` user
samples of a 10-class Gaussian mixture in 32 dimensions, MLP 32-128-128-10, all weights linearised: the CG
path; slow, not in the default list).

    python benchmarks/mlforget_cost.py [--problems embedded,digits] [--reps 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data import DataConfig
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.runner import get_split
from scrubnet.mlforget.dual import dual_fit
from scrubnet.mlforget.model import (MLConfig, MLState, build_factor, choose_core_ids, fit_user_weights,
                                     forget_request)
from scrubnet.mlforget.user import ml_from_network
from scrubnet.mlforget.pipeline import train_ml
from scrubnet.mlforget.primal import primal_fit
from scrubnet.mlforget.solve import NystromPreconditioner, SGDTrainConfig, SolverConfig, fit_user_weights_sgd, \
    newton_step
from scrubnet.models.linearized import LinearizedModel


def synthetic(n_user: int, n_core: int = 2000, d: int = 32, c: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(c, d, generator=g)

    def draw(n):
        y = torch.randint(0, c, (n,), generator=g)
        return means[y] + 1.5 * torch.randn(n, d, generator=g), y

    (xc, yc), (xu, yu) = draw(n_core), draw(n_user)
    torch.manual_seed(seed)
    core = nn.Sequential(nn.Linear(d, 128), nn.LeakyReLU(0.01), nn.Linear(128, 128), nn.LeakyReLU(0.01),
                         nn.Linear(128, c))
    opt = torch.optim.SGD(core.parameters(), lr=0.05, momentum=0.9)
    for _ in range(10):
        perm = torch.randperm(n_core, generator=g)
        for i in range(0, n_core, 128):
            idx = perm[i:i + 128]
            loss = F.cross_entropy(core(xc[idx]), yc[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return core.eval(), xu, yu, c


def lambda_max(obj, iters: int = 20, seed: int = 0) -> float:
    """Largest eigenvalue of H_D by power iteration (sets the SGD learning rates)."""
    v = torch.randn(obj.model.num_linearized, generator=torch.Generator().manual_seed(seed),
                    dtype=obj.model.delta[0].dtype)
    lam = 0.0
    for _ in range(iters):
        hv = obj.hvp(v / torch.linalg.vector_norm(v))
        lam = float(torch.linalg.vector_norm(hv))
        v = hv
    return lam


def sgd_retrain_to(obj, cfg: SGDTrainConfig, target: float, seed: int) -> tuple[float, int, bool]:
    """The papers' SGD from 0, stopping at the first epoch whose full loss is ≤ ``target``:
    (training seconds, epochs, reached)."""
    _, info = fit_user_weights_sgd(obj, cfg, torch.Generator().manual_seed(seed), stop_below=target)
    return info["train_seconds"], info["epochs"], info["reached"]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def alternated_medians(contenders: dict, reps: int) -> tuple[dict[str, float], dict]:
    """Run the contenders ``reps`` times each, in alternating order (forward, then reversed); returns the
    median seconds of each and its last result."""
    times: dict[str, list[float]] = {k: [] for k in contenders}
    res = {}
    for rep in range(reps):
        for k in (list(contenders) if rep % 2 == 0 else list(contenders)[::-1]):
            t, res[k] = timed(contenders[k])
            times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}, res


def err(w, w_star) -> float:
    return float(torch.linalg.vector_norm(w.double() - w_star.double()))


def run_problem(name: str, state: MLState, x, y, ids, reps: int, sgd_epochs: int, seed: int) -> float:
    cfg = state.config
    sigma = cfg.sigma
    rem = state.remaining_ids()
    rem = rem[~torch.isin(rem, ids)]
    rows = len(state.user_ids) * state.num_classes
    path = state.exact_solver(len(state.user_ids))
    print(f"\n== {name}: {len(state.user_ids)} user samples × {state.num_classes} classes = {rows} Gram rows, "
          f"{state.model.num_linearized} user weights; request of {len(ids)} samples; exact solver: {path}")
    # once per checkpoint
    if path == "dual":
        if state.factor is None:
            state.factor = build_factor(state, x, y, state.user_ids)
        fs = state.factor.seconds
        build = fs["gram_s"] + fs["eig_s"]
        print(f"  once per checkpoint: Gram {fs['gram_s']:.2f} s + eigendecomposition {fs['eig_s']:.2f} s "
              f"= {build:.2f} s")
    obj64 = state.objective64(x[state.user_ids], y[state.user_ids])
    t_pre, sketch = timed(lambda: NystromPreconditioner(obj64, cfg.solver.precond_rank,
                                                        torch.Generator().manual_seed(seed)))
    if state.precond is None:
        state.precond = sketch
    if path == "cg":
        build = t_pre
        print(f"  once per checkpoint: Nyström sketch (rank {cfg.solver.precond_rank}) {t_pre:.2f} s")
    # the exact answer
    if len(rem) * state.num_classes <= 2 * cfg.solver.dual_max_rows:
        w_star, _ = dual_fit(state.model, x[rem], y[rem], state.num_classes, cfg.mu, cfg.target_scale)
    else:
        tight = SolverConfig(**{**dataclasses.asdict(cfg.solver), "solver": "cg", "weight_tol": 1e-10})
        d, _ = newton_step(state.objective64(x[rem], y[rem]), torch.zeros(state.model.num_linearized,
                                                                          dtype=torch.float64), tight,
                           precond=state.precond)
        w_star = -d
    obj_r = state.objective(x[rem], y[rem])
    lam = lambda_max(obj_r, seed=seed)
    sgd_step_cfg = SolverConfig(solver="sgd", sgd_epochs=3, sgd_lr=0.5 / lam, sgd_momentum=0.9, sgd_lr_decay=0.5,
                                sgd_batch_size=256)
    sgd_train = SGDTrainConfig(epochs=sgd_epochs, lr=min(0.05, 0.5 / lam),
                               milestones=(sgd_epochs // 2, (4 * sgd_epochs) // 5))

    def forget_exact():
        return forget_request(state, x, y, ids, sigma=0.0, apply=False)

    def forget_sgd():
        saved = state.config.solver
        state.config.solver = sgd_step_cfg
        try:
            return forget_request(state, x, y, ids, sigma=0.0, noise_seed=seed, apply=False)
        finally:
            state.config.solver = saved

    def retrain_dual():
        return dual_fit(state.model, x[rem], y[rem], state.num_classes, cfg.mu, cfg.target_scale)[0]

    out = forget_exact()
    e_forget = err(out.w_before_noise, w_star)
    cg_tol = SolverConfig(**{**dataclasses.asdict(cfg.solver), "solver": "cg",
                             "weight_tol": max(e_forget, 1e-9)})
    zero = torch.zeros(state.model.num_linearized, dtype=torch.float64)

    def retrain_cg():
        d, info = newton_step(state.objective64(x[rem], y[rem]), zero, cg_tol, precond=state.precond)
        return -d, info

    sgd_out = forget_sgd()
    loss_sgd = obj_r.loss(sgd_out.w_before_noise)
    contenders = {"forget_exact": forget_exact, "retrain_dual": retrain_dual, "retrain_cg": retrain_cg,
                  "forget_sgd": forget_sgd,
                  "retrain_sgd": lambda: sgd_retrain_to(obj_r, sgd_train, loss_sgd, seed)}
    dual_too_big = len(rem) * state.num_classes > 2 * cfg.solver.dual_max_rows
    if dual_too_big:  # an O((Nc)³) Cholesky of a Gram this size is never the best retrain: not timed
        del contenders["retrain_dual"]
    times: dict[str, list[float]] = {k: [] for k in contenders}
    results = {}
    order = list(contenders)
    for rep in range(reps):
        for k in (order if rep % 2 == 0 else order[::-1]):   # alternated
            if k == "retrain_sgd":
                t_train, epochs, reached = contenders[k]()
                times[k].append(t_train)
                results[k] = (epochs, reached)
            else:
                t, res = timed(contenders[k])
                times[k].append(t)
                results[k] = res
    med = {k: statistics.median(v) for k, v in times.items()}
    w_cg, cg_info = results["retrain_cg"]
    e_cg, e_sgd = err(w_cg, w_star), err(sgd_out.w_before_noise, w_star)
    kl = (lambda e: 0.5 * e * e / sigma ** 2) if sigma > 0 else (lambda e: float("nan"))
    epochs, reached = results["retrain_sgd"]
    print(f"  medians of {reps} alternated repetitions, σ = {sigma:g} for the KL:")
    print(f"  forget, the papers' SGD step        {med['forget_sgd']:8.3f} s   ‖w − w*‖ {e_sgd:9.3g}  "
          f"KL {kl(e_sgd):9.3g} nats")
    print(f"  retrain, the papers' SGD to its loss {med['retrain_sgd']:7.3f} s   ({epochs} epochs, reached: "
          f"{'yes' if reached else 'no — lower bound'})")
    print(f"speedup_papers_sgd: {med['retrain_sgd'] / med['forget_sgd']:.1f}")
    step = out.info
    detail = (f"{step.extra.get('removed_rows', 0)} rows removed by Schur complement" if step.solver == "dual"
              else f"{step.iterations} CG iterations, warm-started")
    print(f"  forget, exact ({step.solver})              {med['forget_exact']:8.3f} s   ‖w − w*‖ {e_forget:9.3g}  "
          f"KL {kl(e_forget):9.3g} nats  ({detail})")
    if dual_too_big:
        print(f"  retrain, dual from scratch          not timed ({len(rem) * state.num_classes} Gram rows)")
    else:
        e_dual = err(results["retrain_dual"], w_star)
        print(f"  retrain, dual from scratch          {med['retrain_dual']:8.3f} s   ‖w − w*‖ {e_dual:9.3g}  "
              f"KL {kl(e_dual):9.3g} nats")
    print(f"  retrain, CG from zero (Nyström)     {med['retrain_cg']:8.3f} s   ‖w − w*‖ {e_cg:9.3g}  "
          f"KL {kl(e_cg):9.3g} nats  ({cg_info.iterations} iterations)")
    best = min(med.get("retrain_dual", float("inf")), med["retrain_cg"])
    saved = best - med["forget_exact"]
    print(f"  once-per-checkpoint build {build:.2f} s = the saving of {build / max(saved, 1e-12):.1f} requests")
    sp = best / med["forget_exact"]
    print(f"speedup: {sp:.1f}")
    return sp


def embedded_problem(dataset: str, model: str, seed: int):
    ec = ExperimentConfig()
    if dataset == "digits":
        ec = dataclasses.replace(ec, model=model, data=DataConfig(dataset="digits", n_train_per_class=60,
                                                                 n_test_per_class=60))
    split = get_split(ec)
    t, state = timed(lambda: train_ml(split, MLConfig(), ec.train, seed, model_name=ec.model,
                                      model_options=ec.model_options))
    print(f"\n{dataset}/{ec.model}: built the ML model (pre-training, core, user weights) in {t:.1f} s")
    return state, split.x, split.y, split.forget_idx


def synthetic_problem(n: int, seed: int):
    core, x, y, c = synthetic(n, seed=seed)
    cfg = MLConfig(core_fraction=0.0)
    core_ids, user_ids = choose_core_ids(len(y), cfg.core_fraction, seed, None, cfg.user_data)
    state = MLState(LinearizedModel(core), core_ids, user_ids, torch.zeros(0, dtype=torch.long), cfg, c, seed)
    t, (w, state.train_info) = timed(lambda: fit_user_weights(state, x[user_ids], y[user_ids],
                                                              torch.Generator().manual_seed(seed)))
    state.model.set_delta_flat(w)
    print(f"\nsynthetic: trained w_u on N = {n} in {t:.1f} s (CG from zero, the Nyström sketch built inside)")
    g = torch.Generator().manual_seed(seed)
    ids = user_ids[torch.randperm(len(user_ids), generator=g)[:max(1, n // 100)]]
    return state, x, y, torch.sort(ids).values


class _Res(nn.Module):
    """A basic residual block: conv-BN-ReLU-conv-BN plus the (1×1 conv-BN when the shape changes) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.short(x))


class ResNetStyle(nn.Module):
    """A hand-written CIFAR ResNet-style CNN: 3×3 stem, five residual stages (widths 16, 32, 64, 128, 512,
    strides 1, 2, 2, 2, 2), global average pooling, head ``fc`` (512 → c): the head's primal block is
    513 × 513, as for a ResNet-18 head."""

    def __init__(self, c: int = 10, widths=(16, 32, 64, 128, 512)):
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(_Res(cin, w, 1 if i == 0 else 2))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, c)

    def forward(self, x):
        x = self.stages(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def cifar_shaped(n: int, c: int = 10, seed: int = 0):
    """n CIFAR-shaped samples (3×32×32): a smooth random template per class (upsampled 8×8 noise) + noise."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(c, 3, 8, 8, generator=g), size=32, mode="bilinear", align_corners=False)
    y = torch.randint(0, c, (n,), generator=g)
    return 0.5 * templates[y] + torch.randn(n, 3, 32, 32, generator=g), y


def primal_problem(n: int, seed: int, train_n: int):
    """The user's own trained network: ``ResNetStyle`` trained with plain SGD (1 epoch on ``train_n`` of the
    samples, batch 128, lr 0.05, momentum 0.9, wd 5e-4), then its head linearised (:func:`ml_from_network`)."""
    x, y = cifar_shaped(n, seed=seed)
    torch.manual_seed(seed)
    net = ResNetStyle()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    net.train()
    perm = torch.randperm(n, generator=g)[:train_n]
    for i in range(0, len(perm), 128):
        idx = perm[i:i + 128]
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    t_train = time.perf_counter() - t0
    with torch.no_grad():
        acc = float((torch.cat([net(x[i:i + 1000]).argmax(1) for i in range(0, n, 1000)]) == y).float().mean())
    t, state = timed(lambda: ml_from_network(net, x, y, 10, config=MLConfig(leaky_slope=None, sigma=0.0),
                                             seed=seed))
    fac = state.primal if state.primal is not None else state.factor
    print(f"\nprimal: ResNet-style CNN ({sum(p.numel() for p in net.parameters())} weights, BatchNorm) trained "
          f"1 epoch on {train_n} samples in {t_train:.1f} s (train accuracy {acc:.3f}); ML model from it "
          f"(head linearised, features pass {state.prefix.seconds:.1f} s, factor "
          f"{fac.seconds['gram_s'] + fac.seconds['eig_s']:.2f} s) in {t:.1f} s")
    ids = torch.sort(torch.randperm(n, generator=g)[:max(1, n // 100)]).values
    return state, x, y, ids


def ridge_lstsq(lin, h, y, c: int, mu: float, s: float):
    """An independent answer for a linearised head: min ‖Φ W + R‖² + nµ‖W‖² by least squares (QR) on
    [Φ; √(nµ) I] in float64 — no normal equations, no eigendecomposition."""
    phi = torch.cat([h.double(), torch.ones(len(h), 1, dtype=torch.float64)], 1)
    with torch.no_grad():
        r = lin.base(h).double() - s * F.one_hot(y, c).double()
    q = phi.shape[1]
    a = torch.cat([phi, (len(y) * mu) ** 0.5 * torch.eye(q, dtype=torch.float64)])
    b = torch.cat([-r, torch.zeros(q, c, dtype=torch.float64)])
    w = torch.linalg.lstsq(a, b).solution            # (q, c)
    return torch.cat([w[:-1].T.reshape(-1), w[-1]])


def run_primal(state: MLState, x, y, ids, reps: int, seed: int) -> float:
    """(Needs N ≥ 2·513 samples, where the primal is chosen.) One request (1 % of the user data) by the primal downdate against the best exact retrain of the same
    family (the primal from scratch on the cached features), medians of alternated repetitions."""
    rem = state.remaining_ids()
    rem = rem[~torch.isin(rem, ids)]
    q, block = state.primal_shape()
    lin, h = state.space(x)
    n, c = len(state.user_ids), state.num_classes
    if state.exact_solver(len(rem)) != "primal":
        raise SystemExit(f"error: with {n} samples the exact solver is {state.exact_solver(len(rem))!r}, not the "
                         f"primal; give --primal-n ≥ {2 * q}")
    print(f"\n== primal: {n} user samples × {c} classes = {n * c} dual rows, {state.model.num_linearized} user "
          f"weights (head block {q} × {q}: {block}); request of {len(ids)} samples; exact solver: "
          f"{state.exact_solver(n)}")
    g = torch.Generator().manual_seed(seed)
    w_star = ridge_lstsq(lin, h[rem], y[rem], c, state.config.mu, state.config.target_scale)

    def forget():
        return forget_request(state, x, y, ids, sigma=0.0, apply=False)

    def retrain():
        return fit_user_weights(state, x, y, g, ids=rem)

    contenders = {"forget": forget, "retrain": retrain}
    for f in contenders.values():
        f()  # warm-up
    med, res = alternated_medians(contenders, reps)
    out, (w_re, info_re) = res["forget"], res["retrain"]
    scale = float(torch.linalg.vector_norm(w_star))
    print(f"  medians of {reps} alternated repetitions:")
    print(f"  forget, exact (primal downdate)        {med['forget']:8.4f} s   ‖w − w*‖/‖w*‖ "
          f"{err(out.w_before_noise, w_star) / scale:9.3g}  ({out.info.extra['removed_rows']} rows removed, "
          f"Woodbury on the {q}×{q} block)")
    print(f"  retrain, primal from scratch (features) {med['retrain']:7.4f} s   ‖w − w*‖/‖w*‖ "
          f"{err(w_re, w_star) / scale:9.3g}  ({info_re.get('train_solver')})")
    # the same two solves returning float64 (the library casts its answer to the network's float32)
    lin64 = copy.deepcopy(lin).double()
    w_req64, _ = state.primal.fit(lin64, h, y, torch.isin(state.primal.ids, rem))
    w_re64, _ = primal_fit(lin64, h[rem], y[rem], c, state.config.mu, state.config.target_scale, block)
    print(f"  in float64: ‖w_forget − w*‖/‖w*‖ {err(w_req64, w_star) / scale:.3g}, ‖w_retrain − w*‖/‖w*‖ "
          f"{err(w_re64, w_star) / scale:.3g}, ‖w_forget − w_retrain‖/‖w*‖ {err(w_req64, w_re64) / scale:.3g} "
          f"(w*: least squares by QR)")
    print(f"  (a retrain that also recomputed the features: {state.prefix.seconds + med['retrain']:.1f} s)")
    print(f"  certificate: {out.info.extra['certificate']}")
    sp = med["retrain"] / med["forget"]
    print(f"speedup_primal: {sp:.1f}")
    return sp


def certified_problem(n: int, seed: int, sigma: float):
    """The fully linearised synthetic problem (MLP 32-128-128-10, all weights) on N = n user samples."""
    state, x, y, ids = synthetic_problem(n, seed)
    state.config.sigma = sigma
    return state, x, y, ids


def run_certified(state: MLState, x, y, ids, reps: int, seed: int, budget: float, n_requests: int = 2) -> float:
    """A certified request (budget in nats at the state's σ) against the best exact retrain of the same family
    (float64 CG from zero with the prebuilt Nyström sketch to the library's exact tolerance), then
    ``n_requests`` sequential certified requests with their certificates."""
    cfg = state.config
    sigma = cfg.sigma
    rem = state.remaining_ids()
    rem = rem[~torch.isin(rem, ids)]
    n, c = len(state.user_ids), state.num_classes
    if state.exact_solver(n) != "cg":
        raise SystemExit(f"error: with {n} samples the exact solver is {state.exact_solver(n)!r}: certified requests "
                         f"apply to the CG path; give --certified-n above {state.config.solver.dual_max_rows // c}")
    print(f"\n== certified: {n} user samples × {c} classes = {n * c} Gram rows, {state.model.num_linearized} user "
          f"weights (all linearised); request of {len(ids)} samples; σ = {sigma:g}, budget {budget:g} nats; "
          f"exact solver: {state.exact_solver(n)}")
    # the sketch was built once by the training (CG from zero: fit_user_weights keeps it in state.precond)
    print(f"  once per checkpoint: Nyström sketch (rank {cfg.solver.precond_rank}) "
          f"{state.train_info.get('train_precond_build_s', float('nan')):.1f} s")
    g = torch.Generator().manual_seed(seed)

    def forget():
        return forget_request(state, x, y, ids, sigma=sigma, budget_nats=budget, apply=False)

    def retrain():
        return fit_user_weights(state, x, y, g, ids=rem)

    contenders = {"forget": forget, "retrain": retrain}
    forget()  # warm-up (the long retrain amortises its first-call overhead)
    med, res = alternated_medians(contenders, reps)
    out, (w_re, info_re) = res["forget"], res["retrain"]
    w_star = w_re  # the exact retrain: ‖w_re − w*‖ ≤ weight_tol (1e-6), proven by its residual
    cert = out.info.extra["certificate"]
    e = err(out.w_before_noise, w_star)
    print(f"  medians of {reps} alternated repetitions:")
    print(f"  forget, certified (CG, Gauss–Radau)  {med['forget']:8.3f} s   ‖w − w*‖ {e:9.3g}  true KL "
          f"{0.5 * e * e / sigma ** 2:9.3g} nats ≤ bound {cert['kl_bound_nats']:.3g}  ({out.info.iterations} "
          f"iterations; the plain ‖r‖/µ bound would be "
          f"{0.5 * (out.info.extra['residual_bound'] / sigma) ** 2:.3g} nats)")
    print(f"  retrain, CG from zero (Nyström)      {med['retrain']:8.3f} s   ‖w − w*‖ ≤ "
          f"{info_re.get('train_weight_error_bound', float('nan')):.3g} (proven; it is w* above)  "
          f"({info_re.get('train_iterations')} iterations)")
    print(f"  certificate: {cert}")
    sp = med["retrain"] / med["forget"]
    print(f"speedup_certified: {sp:.1f}")
    gen = torch.Generator().manual_seed(seed + 1)
    for k in range(n_requests):
        dele = state.deletable_ids()
        req = torch.sort(dele[torch.randperm(len(dele), generator=gen)[:len(ids)]]).values
        t, o = timed(lambda: forget_request(state, x, y, req, sigma=sigma, budget_nats=budget,
                                            noise_seed=1_000_003 * seed + k + 1))
        print(f"  sequential request {k + 1}: {t:.2f} s, {o.info.iterations} iterations, certificate "
              f"{o.info.extra['certificate']}")
    return sp


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default="embedded,digits,primal,certified",
                    help="embedded, digits, primal, certified, synthetic")
    ap.add_argument("--primal-n", type=int, default=10_000, help="samples of the primal problem (3×32×32)")
    ap.add_argument("--primal-train-n", type=int, default=2_000, help="samples the primal problem's CNN trains on")
    ap.add_argument("--certified-n", type=int, default=10_000, help="user samples of the certified problem")
    ap.add_argument("--budget", type=float, default=0.1, help="information budget of a certified request (nats)")
    ap.add_argument("--sigma", type=float, default=1e-2, help="σ of the certified problem")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per contender (≥ 3)")
    ap.add_argument("--n", type=int, default=20_000, help="user samples of the synthetic problem")
    ap.add_argument("--sgd-epochs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.reps < 3:
        raise SystemExit("error: --reps must be at least 3 (the median of alternated repetitions)")
    torch.set_num_threads(args.threads)
    probs = [p.strip() for p in args.problems.split(",") if p.strip()]
    unknown = [p for p in probs if p not in ("embedded", "digits", "synthetic", "primal", "certified")]
    if unknown:
        raise SystemExit(f"error: unknown problem(s) {unknown}; choose embedded, digits, primal, certified, synthetic")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for p in probs:
        if p == "primal":
            state, x, y, ids = primal_problem(args.primal_n, args.seed, args.primal_train_n)
            run_primal(state, x, y, ids, max(args.reps, 7), args.seed)
            continue
        if p == "certified":
            state, x, y, ids = certified_problem(args.certified_n, args.seed, args.sigma)
            run_certified(state, x, y, ids, args.reps, args.seed, args.budget)
            continue
        if p == "synthetic":
            state, x, y, ids = synthetic_problem(args.n, args.seed)
            name = f"synthetic (N = {args.n}, MLP 32-128-128-10)"
        else:
            state, x, y, ids = embedded_problem("mnist1d" if p == "embedded" else "digits",
                                                "mlp" if p == "embedded" else "cnn2d", args.seed)
            name = "embedded (MNIST-1D, MLP)" if p == "embedded" else "digits (2-D CNN with BatchNorm)"
        run_problem(name, state, x, y, ids, args.reps, args.sgd_epochs, args.seed)


if __name__ == "__main__":
    main()
