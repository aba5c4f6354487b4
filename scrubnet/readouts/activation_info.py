"""The black-box bound: nats about D_f carried by the activations of one query ("Forgetting Outside the Box",
Prop. 5 and Lemma 2).

The scrubbed weights are Gaussian, S(w) ~ N(μ_s, diag v_s); the retrain reference gets the same procedure,
N(μ_r, diag v_r). Through the network linearised at the mean, the logits of a query x are Gaussian
(Prop. 5, eq. 3.5):

    f_s(x) ~ N( f_{μ_s}(x), Σ_s(x) ),   Σ_s(x) = J_s(x) diag(v_s) J_s(x)ᵀ     (c×c, J_s = ∂f/∂w at μ_s)

and likewise for the retrain model. The per-query information is the KL of scrubbed ‖ retrain (Lemma 2):

    form="full" (default):  KL = ½ [ tr(Σ_r⁻¹Σ_s) + Δfᵀ Σ_r⁻¹ Δf − c + log|Σ_r| − log|Σ_s| ],   Δf = f_r − f_s
    form="diag_code" (the authors' code: diagonal of Σ only, no ½):
                             Σ_k [ Δf_k²/σ²_r,k + σ²_s,k/σ²_r,k − log(σ²_s,k/σ²_r,k) − 1 ]

averaged over a query set (D_f, D_r, D_test → ``info_activations_nats_forget`` / ``_retain`` / ``_test``).
The c×c blocks come from :func:`scrubnet.curvature.ntk.ntk_diag_blocks` (per-row gradients, one pass, no
Jacobian stored). Covariances are handled in float64; a block that is not numerically positive definite
gets a relative jitter (1e-12·trace, escalated ×10), which is reported.
"""
from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import Tensor, nn

from scrubnet.curvature.ntk import DEFAULT_BUDGET, ntk_diag_blocks
from scrubnet.training import predict_logits

FORMS = ("full", "diag_code")


def _chol_jitter(cov: Tensor) -> tuple[Tensor, float]:
    """Batched Cholesky of (N, c, c) SPD matrices with escalating relative jitter; returns (L, max jitter)."""
    c = cov.shape[-1]
    eye = torch.eye(c, dtype=cov.dtype, device=cov.device)
    scale = torch.diagonal(cov, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)[:, None, None]
    rel = 0.0
    for _ in range(12):
        chol, info = torch.linalg.cholesky_ex(cov + rel * scale * eye)
        if int(info.max()) == 0:
            return chol, rel
        rel = 1e-12 if rel == 0.0 else rel * 10
    raise ValueError("activation covariance is not positive definite even with jitter")


def gaussian_kl_full(mean_p: Tensor, cov_p: Tensor, mean_q: Tensor, cov_q: Tensor) -> Tensor:
    """KL(N(mean_p, cov_p) ‖ N(mean_q, cov_q)) per row, ½ included: means (N, c), covs (N, c, c) → (N,)."""
    mean_p, mean_q = mean_p.to(torch.float64), mean_q.to(torch.float64)
    cov_p, cov_q = cov_p.to(torch.float64), cov_q.to(torch.float64)
    lp, _ = _chol_jitter(cov_p)
    lq, _ = _chol_jitter(cov_q)
    c = mean_p.shape[-1]
    diff = (mean_q - mean_p).unsqueeze(-1)
    sol = torch.cholesky_solve(torch.cat([cov_p, diff], dim=-1), lq)         # Σ_q⁻¹ [Σ_p, Δ]
    trace = torch.diagonal(sol[..., :c], dim1=-2, dim2=-1).sum(-1)
    maha = (diff * sol[..., c:]).sum(dim=(-2, -1))
    logdet_q = 2 * torch.log(torch.diagonal(lq, dim1=-2, dim2=-1)).sum(-1)
    logdet_p = 2 * torch.log(torch.diagonal(lp, dim1=-2, dim2=-1)).sum(-1)
    return 0.5 * (trace + maha - c + logdet_q - logdet_p)


def gaussian_kl_diag_code(mean_p: Tensor, var_p: Tensor, mean_q: Tensor, var_q: Tensor) -> Tensor:
    """The authors' per-query value Σ_k [(μ_q − μ_p)²/v_q + v_p/v_q − log(v_p/v_q) − 1] (no ½): (N, c) → (N,)."""
    mp, vp = mean_p.to(torch.float64), var_p.to(torch.float64)
    mq, vq = mean_q.to(torch.float64), var_q.to(torch.float64)
    if bool(torch.any(vp <= 0)) or bool(torch.any(vq <= 0)):
        raise ValueError("activation variances must be positive")
    ratio = vp / vq
    return ((mq - mp) ** 2 / vq + ratio - torch.log(ratio) - 1.0).sum(-1)


def _flat_in_order(model: nn.Module, d: Mapping[str, Tensor], what: str) -> Tensor:
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    missing = [k for k in names if k not in d]
    if missing:
        raise ValueError(f"{what} lacks parameters: {', '.join(missing[:5])}")
    return torch.cat([d[k].detach().reshape(-1) for k in names])


def model_with(model: nn.Module, weights: Mapping[str, Tensor]) -> nn.Module:
    """A deep copy of ``model`` whose trainable parameters are taken from ``weights`` (e.g. a noise mean)."""
    missing = [k for k, p in model.named_parameters() if p.requires_grad and k not in weights]
    if missing:
        raise ValueError(f"weights lack parameters: {', '.join(missing[:5])}")
    out = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in out.named_parameters():
            if k in weights:
                p.copy_(weights[k].to(p.dtype))
    return out.eval()


def activation_moments(model: nn.Module, mean: Mapping[str, Tensor], var: Mapping[str, Tensor], x: Tensor, *,
                       memory_budget_bytes: int = DEFAULT_BUDGET) -> tuple[Tensor, Tensor]:
    """Logits at the mean (N, c) and Σ(x) = J diag(v) Jᵀ (N, c, c) of the linearised Gaussian network."""
    at_mean = model_with(model, mean)
    v = _flat_in_order(at_mean, var, "var").to(torch.float64)
    if bool(torch.any(v < 0)):
        raise ValueError("weight variances must be non-negative")
    logits = predict_logits(at_mean, x).to(torch.float64)
    cov = ntk_diag_blocks(at_mean, x, v, memory_budget_bytes=memory_budget_bytes)
    return logits, cov


def activation_information(model_s: nn.Module, mean_s: Mapping[str, Tensor], var_s: Mapping[str, Tensor],
                           model_r: nn.Module, mean_r: Mapping[str, Tensor], var_r: Mapping[str, Tensor],
                           x: Tensor, *, form: str = "full",
                           memory_budget_bytes: int = DEFAULT_BUDGET) -> Tensor:
    """Per-query information (nats), shape (N,): KL(f_s(x) ‖ f_r(x)) of the linearised Gaussian activations.

    ``model_s``/``model_r`` give the architectures (and buffers); their weights are replaced by the means.
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; choose one of {', '.join(FORMS)}")
    if len(x) == 0:
        return torch.zeros(0, dtype=torch.float64, device=x.device)
    f_s, cov_s = activation_moments(model_s, mean_s, var_s, x, memory_budget_bytes=memory_budget_bytes)
    f_r, cov_r = activation_moments(model_r, mean_r, var_r, x, memory_budget_bytes=memory_budget_bytes)
    if form == "full":
        return gaussian_kl_full(f_s, cov_s, f_r, cov_r)
    return gaussian_kl_diag_code(f_s, torch.diagonal(cov_s, dim1=-2, dim2=-1),
                                 f_r, torch.diagonal(cov_r, dim1=-2, dim2=-1))


def activation_information_sets(model_s: nn.Module, mean_s, var_s, model_r: nn.Module, mean_r, var_r,
                                queries: Mapping[str, Tensor], *, max_queries: int | None = None,
                                memory_budget_bytes: int = DEFAULT_BUDGET) -> dict[str, float]:
    """Mean per-query information for every query set (first ``max_queries`` samples of each when given), in
    both conventions from one computation of the moments:

    ``info_activations_nats_<name>`` (full c×c covariance, ½ included) and
    ``info_activations_nats_<name>_code`` (the authors' diagonal variant without the ½).
    """
    out = {}
    for name, x in queries.items():
        xq = x if max_queries is None else x[:max_queries]
        if len(xq) == 0:
            out[f"info_activations_nats_{name}"] = out[f"info_activations_nats_{name}_code"] = float("nan")
            continue
        f_s, cov_s = activation_moments(model_s, mean_s, var_s, xq, memory_budget_bytes=memory_budget_bytes)
        f_r, cov_r = activation_moments(model_r, mean_r, var_r, xq, memory_budget_bytes=memory_budget_bytes)
        out[f"info_activations_nats_{name}"] = float(gaussian_kl_full(f_s, cov_s, f_r, cov_r).mean())
        out[f"info_activations_nats_{name}_code"] = float(gaussian_kl_diag_code(
            f_s, torch.diagonal(cov_s, dim1=-2, dim2=-1), f_r, torch.diagonal(cov_r, dim1=-2, dim2=-1)).mean())
    return out
