"""AdamW's decoupled weight decay as the L2 term a recipe states.

``torch.optim.AdamW(weight_decay=λ)`` updates w ← w − η·λ·w − η·m̂/(√v̂ + ε) (m̂, v̂ the bias-corrected first and
second moments of the minibatch gradients). At a stationary point of that iteration m̂ = E[g], so

    ∇L_data(w) = −λ·(√v̂ + ε) ⊙ w,

the stationarity condition of L_data + ½ Σ_j κ_j w_j² with a *per-parameter* coefficient κ_j = λ·(√v̂_j + ε):
the learning rate cancels, and κ_j is set by the gradient second moment, which only the optimiser state knows
(at the end of training v̂ is dominated by the minibatch gradient noise, not by the mean gradient). Stating
``wd = λ`` is wrong by the factor √v̂ + ε (measured: 100–1000× too large for the small models of the
tests, whose √v̂ is 1e-3–1e-2). A recipe states one coefficient, so :func:`adamw_l2_equivalent` gives the
least-squares fit of the per-parameter one,

    wd = Σ_j κ_j w_j² / Σ_j w_j²    (over the decayed parameters),

the coefficient for which the decay's gradient wd·w has the same component along w as AdamW's implied one.
The stationarity check then judges whether one coefficient is close enough (it refuses when κ_j spreads too
much for a single L2 term to describe the model). Parameter groups with ``weight_decay = 0`` (biases and norm
weights in the HuggingFace Trainer's grouping) are left out of the decay (the recipe's centre names only the
decayed parameters, at zero); λ = 0 everywhere is plain ``wd = 0``, exact without any state.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def _coefficient(p: Tensor, state: dict, group: dict) -> Tensor:
    """κ = λ·(√v̂ + ε) for one parameter (zeros' shape of p: no state yet means v̂ = 0)."""
    lam, eps = float(group["weight_decay"]), float(group.get("eps", 1e-8))
    if "exp_avg_sq" not in state:
        return torch.full_like(p, lam * eps)
    beta2 = float(group.get("betas", (0.9, 0.999))[1])
    step = float(state.get("step", 1))
    v = state.get("max_exp_avg_sq") if group.get("amsgrad") else state["exp_avg_sq"]
    v_hat = v.detach().to(p.dtype) / (1.0 - beta2 ** max(step, 1.0))
    return lam * (v_hat.sqrt() + eps)


def adamw_l2_equivalent(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, set[str], dict]:
    """The L2 coefficient equivalent to ``optimizer``'s decoupled decay at ``model``'s weights (module docstring).

    Parameters
    ----------
    model : the trained model (its trainable parameters must be those the optimiser holds).
    optimizer : the AdamW optimiser the model was trained with, with its state (``exp_avg_sq``, ``step``): the
        live object, or one rebuilt as in training followed by ``load_state_dict`` of the saved state.

    Returns
    -------
    (wd, decayed, info): wd the fitted coefficient (1/nats per squared weight unit, as recipe.wd); decayed the
    names of the parameters in groups with weight_decay > 0; info the spread of κ_j over them: ``kappa_min``,
    ``kappa_median``, ``kappa_max`` and ``weight_decay`` (λ of the groups; the largest when they differ).
    """
    names = {id(p): k for k, p in model.named_parameters() if p.requires_grad}
    decayed, kappas, weights, lams = set(), [], [], []
    for group in optimizer.param_groups:
        if "weight_decay" not in group:
            raise ValueError("the optimiser's parameter groups have no weight_decay: not an AdamW optimiser")
        for p in group["params"]:
            if id(p) not in names or float(group["weight_decay"]) == 0.0:
                continue
            decayed.add(names[id(p)])
            lams.append(float(group["weight_decay"]))
            kappas.append(_coefficient(p.detach(), optimizer.state.get(p, {}), group).reshape(-1))
            weights.append(p.detach().reshape(-1) ** 2)
    if not decayed:
        return 0.0, set(), {"weight_decay": 0.0}
    kappa, w2 = torch.cat(kappas).double(), torch.cat(weights).double()
    wd = float((kappa * w2).sum() / w2.sum()) if float(w2.sum()) > 0 else float(kappa.mean())
    q = torch.quantile(kappa[:1_000_000], torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist()
    return wd, decayed, {"weight_decay": max(lams), "kappa_min": q[0], "kappa_median": q[1], "kappa_max": q[2]}
