"""Dense references for the tests: every quantity the package computes matrix-free, formed explicitly.

Slow and obviously correct (``torch.func.jacrev`` of the whole batch, explicit matrices, direct solves);
only for tiny models in float64. Conventions: the Jacobian J stacks per-(sample, class) rows sample-major,
row ``i·c + k`` = ∂f_k(x_i)/∂w, columns in named-parameter order (each parameter flattened row-major).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev


def dense_jacobian(model: nn.Module, x: Tensor, names: list[str] | None = None, *, mode: str = "eval") -> Tensor:
    """J (N·c × p) of the logits w.r.t. the trainable parameters (or those in ``names``), with the model in
    ``mode`` ("eval": BatchNorm uses its running statistics; "train": batch statistics). The model's own
    mode and buffers are left as they were."""
    if mode == "train":  # batch statistics, without updating running ones: on a copy that tracks none
        model = copy.deepcopy(model)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.track_running_stats = False
                m.running_mean = m.running_var = m.num_batches_tracked = None
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    names = list(params) if names is None else list(names)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    was = model.training
    model.train(mode == "train")
    try:
        jac = jacrev(lambda sub: functional_call(model, ({**params, **sub}, buffers), (x,)).reshape(-1))(
            {k: params[k] for k in names})
    finally:
        model.train(was)
    return torch.cat([jac[k].reshape(jac[k].shape[0], -1) for k in names], dim=1)


def dense_ggn(model: nn.Module, x: Tensor, loss: str = "ce") -> Tensor:
    """(1/N) Σ_n J_nᵀ Λ_n J_n (p × p), eval mode; Λ = diag(p) − p pᵀ for cross-entropy (= true Fisher), I for
    ½‖f − t‖²."""
    jac = dense_jacobian(model, x)
    was = model.training
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train(was)
    n, c = logits.shape
    jac = jac.reshape(n, c, -1)
    if loss == "ce":
        p = torch.softmax(logits, 1)
        lam = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    else:
        lam = torch.eye(c, dtype=jac.dtype).expand(n, c, c)
    return torch.einsum("nci,ncd,ndj->ij", jac, lam, jac) / n


def ridge_closed_form(x: Tensor, targets: Tensor, w_start: Tensor, wd: float) -> Tensor:
    """argmin over [W b] of (1/N) Σ ½‖W x + b − t‖² + (wd/2)‖[W b] − w_start‖², by a direct solve.

    ``w_start`` and the result are (c × d+1): the weight matrix with the bias as its last column."""
    n = len(x)
    xa = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], dim=1)
    lhs = xa.T @ xa / n + wd * torch.eye(xa.shape[1], dtype=x.dtype)
    return torch.linalg.solve(lhs, xa.T @ targets / n + wd * w_start.T).T


def newton_step_softmax_regression(model: nn.Linear, x: Tensor, y: Tensor, *, wd: float,
                                   pulled: dict[str, Tensor]) -> Tensor:
    """w − H⁻¹∇L for L(w) = mean CE(W x + b, y) + (wd/2) Σ_{name ∈ pulled} ‖w_name − pulled[name]‖², with the
    exact Hessian (autograd); flat [W row-major, b]. H may be singular (softmax is invariant to a common shift
    of the biases when they are not pulled): the minimum-norm step, H⁺∇L, is the one CG from 0 finds."""
    w = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])
    k, d = model.weight.shape

    def objective(flat):
        wt, b = flat[:k * d].view(k, d), flat[k * d:]
        pull = sum(((part - pulled[name]) ** 2).sum() for name, part in (("weight", wt), ("bias", b))
                   if name in pulled)
        return F.cross_entropy(x @ wt.T + b, y) + 0.5 * wd * pull

    g = torch.autograd.functional.jacobian(objective, w)
    h = torch.autograd.functional.hessian(objective, w)
    return w - torch.linalg.pinv(h, hermitian=True) @ g


def mixed_linear_closed_form(core: nn.Module, x: Tensor, y: Tensor, mu: float, scale: float = 5.0,
                             names: list[str] | None = None) -> Tensor:
    """argmin_w (1/n) Σ ½‖f_core(x) + J w − s·onehot(y)‖² + (µ/2)‖w‖², J over the parameters ``names``
    (default: all parameters of ``core`` linearised), by a direct solve of the primal normal equations."""
    c = core(x[:1]).shape[1]
    jac = dense_jacobian(core, x, names)
    r = (scale * F.one_hot(y, c).to(x.dtype) - core(x).detach()).reshape(-1)
    h = jac.T @ jac / len(x) + mu * torch.eye(jac.shape[1], dtype=x.dtype)
    return torch.linalg.solve(h, jac.T @ r / len(x))


def dense_log_softmax_jacobian(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """{name: (N, c, *shape)} Jacobian of the log-softmax outputs w.r.t. each trainable parameter (eval mode);
    the true-Fisher diagonal is (1/N) Σ_i Σ_k p_ik J_ik²."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    was = model.training
    model.eval()
    try:
        return jacrev(lambda p: torch.log_softmax(functional_call(model, (p, buffers), (x,)), -1))(params)
    finally:
        model.train(was)
