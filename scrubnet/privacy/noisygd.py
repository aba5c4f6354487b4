"""Full-batch noisy gradient descent (NoisyGD) and AdaMix on the linear softmax classifier.

One loop covers the mixed-privacy algorithm and its ablations (:data:`PRESETS`). At step t, with weights W_t
(D, C), private features X (N_pri, D) and public features X̃ (N_pub, D):

1. clip threshold τ_t: the ``clip_percentile``-th percentile of the per-sample *public* gradient norms
   ‖g̃_j(W_t)‖ (``clip="adaptive"``), or the constant ``clip_threshold`` (``clip="fixed"``);
2. public subspace (``subspace_dim`` = P): the top-P left singular vectors U_P (D, P) of the total public
   gradient G_pub = X̃ᵀ(P̃ − Ỹ), from a *full* SVD. rank(G_pub) ≤ min(C − 1, N_pub), so past that rank the
   columns of U_P are an arbitrary orthonormal completion (whatever LAPACK returns; deterministic);
   ``subspace_dim=None`` means no projection (U = I);
3. clipped, projected, noised private sum (:func:`private_release`):
   S_t = Σ_i U_Pᵀ g_i · min(1, τ_t/‖g_i‖) + n_t,   n_t ~ N(0, σ²τ_t² I) of shape (P, C);
4. update  W_{t+1} = W_t − η (G_pub·[public_gradient] + U_P S_t + λ (W_t − W_ref)),
   with W_ref = 0 (``wd_center="zero"``) or the initialisation (``"init"``), and η = ``lr``/(N_pub + N_pri)
   (``lr`` is per *mean* loss, so one value transfers across data sizes; the totals themselves are sums).

τ_t and U_P are functions of public data and of W_t, itself a post-processed output of earlier private
releases, and ‖U_Pᵀ v‖ ≤ ‖v‖; adding or removing one private sample therefore moves S_t by at most τ_t and
each step is (1/σ)-GDP: T steps are √T/σ-GDP (:mod:`scrubnet.privacy.accounting`).

Per-instance privacy of private sample i: μ_i = sqrt(Σ_t ‖U_Pᵀ g̃_i(W_t)‖² / τ_t²) / σ ≤ √T/σ (its actual
contribution to each release, relative to the worst case), converted to ε_i at the run's δ.

Presets (the ablations of the method's evaluation):

* ``adamix``: public initialisation, adaptive clipping, projection, public gradient term;
* ``public-init-dp``: public initialisation and the public gradient term, but a fixed clip threshold and no
  projection (the "no adaptive components" ablation);
* ``noisygd``: the fully private baseline from zero: public samples join the private set, fixed clip
  threshold, no projection, no public term (the caller merges the sets, see ``merge_public``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from scrubnet._config import strict_from_dict
from scrubnet.privacy.accounting import Accounting, epsilon_of_mu, max_steps
from scrubnet.privacy.linear import per_sample_grad_norms, residuals, weighted_gradient_sum

INITS = ("public", "zero", "random")


@dataclass
class NoisyGDConfig:
    """Hyper-parameters of one private training run (see the module docstring for the equations)."""

    lr: float = 0.5                 # per-mean-loss learning rate: η = lr / (N_pub + N_pri)
    wd: float = 1e-2                # λ of the L2 term λ(W − W_ref), on the summed loss
    wd_center: str = "zero"         # "zero" | "init"
    sigma: float = 20.0             # noise multiplier: noise std = σ·τ_t
    clip: str = "adaptive"          # "adaptive" (public percentile) | "fixed"
    clip_percentile: float = 90.0   # q of the adaptive threshold
    clip_threshold: float = 1.0     # τ when clip = "fixed" (gradient norms are ≤ √2 on unit features)
    subspace_dim: int | None = 16   # P; None = no projection
    public_gradient: bool = True    # add the un-noised total public gradient to every step
    init: str = "public"            # "public" (few-shot fit) | "zero" | "random"
    merge_public: bool = False      # treat the public samples as private (the fully private baseline)

    def validate(self) -> "NoisyGDConfig":
        if self.wd_center not in ("zero", "init"):
            raise ValueError(f"wd_center must be 'zero' or 'init', got {self.wd_center!r}")
        if self.clip not in ("adaptive", "fixed"):
            raise ValueError(f"clip must be 'adaptive' or 'fixed', got {self.clip!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {', '.join(INITS)}, got {self.init!r}")
        if not 0 < self.clip_percentile <= 100:
            raise ValueError(f"clip_percentile must lie in (0, 100], got {self.clip_percentile}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be positive, got {self.sigma}")
        if not (self.lr > 0 and self.clip_threshold > 0 and self.wd >= 0):
            raise ValueError("lr and clip_threshold must be positive, wd non-negative")
        if self.subspace_dim is not None and self.subspace_dim < 1:
            raise ValueError(f"subspace_dim must be a positive integer or null, got {self.subspace_dim}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NoisyGDConfig":
        return strict_from_dict(cls, d, "private training").validate()


#: the three private methods of the MixDP protocol, as overrides of :class:`NoisyGDConfig`
PRESETS: dict[str, dict] = {
    "adamix": dict(init="public", clip="adaptive", public_gradient=True),
    "public-init-dp": dict(init="public", clip="fixed", subspace_dim=None, public_gradient=True),
    "noisygd": dict(init="zero", clip="fixed", subspace_dim=None, public_gradient=False, merge_public=True),
}


def preset(name: str, **over) -> NoisyGDConfig:
    """:class:`NoisyGDConfig` of a preset (``adamix``, ``public-init-dp``, ``noisygd``) with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown private method {name!r}; choose one of {', '.join(PRESETS)}")
    return replace(NoisyGDConfig(), **{**PRESETS[name], **over}).validate()


@dataclass
class PrivateRun:
    """Output of :func:`train_private`: final weights (D, C), the accounting, per-sample μ_i and ε_i of the
    private samples (order of the private set given), and the subspace diagnostics (relative reconstruction
    error ‖M − UUᵀM‖/‖M‖ of the clipped private gradient sum M, averaged over steps, for the public subspace
    and for a random subspace of the same dimension; None without projection)."""

    weights: Tensor
    accounting: Accounting
    pdp_mu: np.ndarray
    pdp_epsilon: np.ndarray
    recon_error_public: float | None = None
    recon_error_random: float | None = None
    config: dict = field(default_factory=dict)


def public_subspace(x_pub: Tensor, r_pub: Tensor, dim: int) -> Tensor:
    """U_P (D, P): the top-``dim`` left singular vectors of G_pub = X̃ᵀ R̃ from a full SVD (P ≤ D)."""
    g = weighted_gradient_sum(x_pub, r_pub)
    if dim > g.shape[0]:
        raise ValueError(f"subspace_dim {dim} exceeds the feature dimension {g.shape[0]}")
    u, _, _ = torch.linalg.svd(g, full_matrices=True)
    return u[:, :dim]


def private_release(x: Tensor, y: Tensor, w: Tensor, tau: float, basis: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The noise-free part of one step's release and its per-sample accounting.

    Returns ``(S, M, c)``: S = Σ_i Uᵀ g_i·min(1, τ/‖g_i‖) of shape (P, C) (or (D, C) when ``basis`` is None),
    M = the same sum before projection (D, C), and c_i = ‖Uᵀ g̃_i‖²/τ² ∈ [0, 1] (n,), the squared share of the
    sensitivity that sample i actually uses. Adding or removing one sample changes S by at most τ in
    Frobenius norm.
    """
    r = residuals(x, y, w)
    norms = per_sample_grad_norms(x, y, w, r)
    scale = torch.where(norms > tau, tau / norms.clamp_min(1e-30), torch.ones_like(norms))
    m = weighted_gradient_sum(x, r, scale)
    if tau <= 0:
        return (m if basis is None else basis.T @ m), m, torch.zeros_like(norms)
    if basis is None:
        return m, m, ((scale * norms) / tau) ** 2
    proj_x = (x @ basis).norm(dim=1)       # ‖Uᵀ x_i‖; ‖Uᵀ g_i‖ = ‖Uᵀ x_i‖·‖r_i‖
    return basis.T @ m, m, ((scale * proj_x * r.norm(dim=1)) / tau) ** 2


def _relative_residual(m: Tensor, basis: Tensor) -> float:
    nm = float(m.norm())
    return float((m - basis @ (basis.T @ m)).norm()) / nm if nm > 0 else 0.0


def train_private(x_pri: Tensor, y_pri: Tensor, x_pub: Tensor, y_pub: Tensor, num_classes: int,
                  cfg: NoisyGDConfig, *, epsilon: float, delta: float, seed: int,
                  public_init: Tensor | None = None, steps: int | None = None) -> PrivateRun:
    """Run NoisyGD / AdaMix for T_max(ε, δ, σ) steps (or ``steps``, accounted as such) and return the model.

    ``public_init`` (D, C) is the few-shot public fit, required when ``cfg.init == "public"``. With
    ``cfg.merge_public`` the public samples are appended to the private set (the ``pdp_*`` arrays then cover
    the private samples first, the public ones after). The seed fixes the noise draws and the random
    initialisation / random comparison subspace.
    """
    cfg.validate()
    if steps is None:
        steps = max_steps(epsilon, delta, cfg.sigma)
    if cfg.merge_public:
        x_pri, y_pri = torch.cat([x_pri, x_pub]), torch.cat([y_pri, y_pub])
    n_total = len(y_pri) + (0 if cfg.merge_public else len(y_pub))
    d = x_pri.shape[1]
    dtype = x_pri.dtype
    gen = torch.Generator().manual_seed(int(seed) * 7919 + 17)
    if cfg.init == "public":
        if public_init is None:
            raise ValueError("init='public' needs the public initialisation weights")
        w = public_init.clone().to(dtype)
    elif cfg.init == "zero":
        w = torch.zeros(d, num_classes, dtype=dtype)
    else:
        w = 0.01 * torch.randn(d, num_classes, generator=gen, dtype=dtype)
    w_ref = w.clone() if cfg.wd_center == "init" else torch.zeros_like(w)
    eta = cfg.lr / n_total
    use_public = cfg.clip == "adaptive" or cfg.subspace_dim is not None or cfg.public_gradient
    if use_public and len(y_pub) == 0:
        raise ValueError("this configuration needs public samples (adaptive clipping, projection or public term)")
    random_basis = None
    if cfg.subspace_dim is not None:
        q, _ = torch.linalg.qr(torch.randn(d, cfg.subspace_dim, generator=gen, dtype=dtype))
        random_basis = q
    taus: list[float] = []
    share = torch.zeros(len(y_pri), dtype=torch.float64)
    rec_pub: list[float] = []
    rec_rand: list[float] = []
    for _ in range(steps):
        r_pub = residuals(x_pub, y_pub, w) if use_public else None
        if cfg.clip == "adaptive":
            pub_norms = per_sample_grad_norms(x_pub, y_pub, w, r_pub)
            tau = float(torch.quantile(pub_norms.double(), cfg.clip_percentile / 100.0))
        else:
            tau = cfg.clip_threshold
        basis = public_subspace(x_pub, r_pub, cfg.subspace_dim) if cfg.subspace_dim is not None else None
        s, m, c = private_release(x_pri, y_pri, w, tau, basis)
        noisy = s + cfg.sigma * tau * torch.randn(s.shape, generator=gen, dtype=dtype)
        step = noisy if basis is None else basis @ noisy
        if cfg.public_gradient:
            step = step + weighted_gradient_sum(x_pub, r_pub)
        step = step + cfg.wd * (w - w_ref)
        w = w - eta * step
        taus.append(tau)
        share += c.double()
        if basis is not None:
            rec_pub.append(_relative_residual(m, basis))
            rec_rand.append(_relative_residual(m, random_basis))
    mu_i = np.sqrt(share.numpy()) / cfg.sigma
    return PrivateRun(weights=w, accounting=Accounting.gaussian(cfg.sigma, steps, delta, epsilon, taus),
                      pdp_mu=mu_i, pdp_epsilon=np.asarray(epsilon_of_mu(mu_i, delta)),
                      recon_error_public=float(np.mean(rec_pub)) if rec_pub else None,
                      recon_error_random=float(np.mean(rec_rand)) if rec_rand else None, config=cfg.to_dict())
