"""The white-box bound: how many nats about D_f the (noisy) scrubbed weights still carry.

A scrubbing procedure that ends by adding Gaussian noise, S(w) = m(w) + n with n ~ N(0, diag v(w)), is
applied with the **same** procedure (S = S_0) to the original model w_o and to the same-seed retrain
model w_r, each with its own curvature (e.g. its own Fisher on D_r). The local forgetting bound
(Prop. 2 / Cor. 1 of "Eternal Sunshine"; conventions in docs/decisions/index.md) is then

    info_weights_nats = KL( N(m_o, Σ_o) ‖ N(m_r, Σ_r) )
                      = ½ Σ_j [ v_o,j / v_r,j + (m_r,j − m_o,j)² / v_r,j − 1 + log(v_r,j / v_o,j) ]   (nats)

The authors' code reports Σ_j [ (m_r − m_o)²/v_o + v_r/v_o − log(v_r/v_o) − 1 ] = 2·KL(N_r ‖ N_o), the
reverse direction without the ½; it is given as ``info_weights_nats_code`` for comparison with their
numbers. Both sum over every parameter the procedure perturbs.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor, nn

TensorOrDict = Tensor | Mapping[str, Tensor]


def _as_flat64(x: TensorOrDict, keys: list[str] | None, what: str) -> Tensor:
    if isinstance(x, Mapping):
        if keys is None:
            keys = list(x)
        missing = [k for k in keys if k not in x]
        if missing:
            raise ValueError(f"{what} lacks entries: {', '.join(missing)}")
        return torch.cat([x[k].detach().reshape(-1).to(torch.float64) for k in keys]) if keys else \
            torch.zeros(0, dtype=torch.float64)
    if isinstance(x, Tensor):
        return x.detach().reshape(-1).to(torch.float64)
    raise TypeError(f"{what} must be a tensor or a dict of tensors, got {type(x).__name__}")


def gaussian_kl_diag(mean_p: TensorOrDict, var_p: TensorOrDict, mean_q: TensorOrDict, var_q: TensorOrDict
                     ) -> float:
    """KL( N(mean_p, diag var_p) ‖ N(mean_q, diag var_q) ) in nats, ½ included, accumulated in float64:

        ½ Σ_j [ var_p/var_q + (mean_q − mean_p)²/var_q − 1 + log(var_q/var_p) ].

    Arguments are tensors of one shape, or dicts with the same keys (the order of ``mean_p`` is used).
    Variances must be positive and finite.
    """
    keys = list(mean_p) if isinstance(mean_p, Mapping) else None
    mp = _as_flat64(mean_p, keys, "mean_p")
    vp = _as_flat64(var_p, keys, "var_p")
    mq = _as_flat64(mean_q, keys, "mean_q")
    vq = _as_flat64(var_q, keys, "var_q")
    if not (mp.shape == vp.shape == mq.shape == vq.shape):
        raise ValueError(f"shapes differ: mean_p {tuple(mp.shape)}, var_p {tuple(vp.shape)}, "
                         f"mean_q {tuple(mq.shape)}, var_q {tuple(vq.shape)}")
    for v, name in ((vp, "var_p"), (vq, "var_q")):
        if v.numel() and not (bool(torch.all(v > 0)) and bool(torch.all(torch.isfinite(v)))):
            raise ValueError(f"{name} must be positive and finite")
    ratio = vp / vq
    return float(0.5 * torch.sum(ratio + (mq - mp) ** 2 / vq - 1.0 - torch.log(ratio)))


def weight_information(mean_o: TensorOrDict, var_o: TensorOrDict, mean_r: TensorOrDict, var_r: TensorOrDict
                       ) -> dict[str, float]:
    """Both conventions of the white-box bound, from the noise of the scrubbed original (o) and retrain (r):

    ``info_weights_nats`` = KL(N_o ‖ N_r) (thesis, ½ included); ``info_weights_nats_code`` = 2·KL(N_r ‖ N_o)
    (the authors' code).
    """
    return {"info_weights_nats": gaussian_kl_diag(mean_o, var_o, mean_r, var_r),
            "info_weights_nats_code": 2.0 * gaussian_kl_diag(mean_r, var_r, mean_o, var_o)}


def scrub_information(noise_of: Callable[[nn.Module], tuple[dict, dict]], original: nn.Module,
                      reference: nn.Module) -> dict[str, float]:
    """Apply the same Gaussian scrubbing procedure to the original and to the same-seed retrain model and
    return :func:`weight_information` of the two noise distributions.

    ``noise_of(model) -> (mean, var)`` must compute the procedure's noise mean and (diagonal) variance for
    ``model`` from that model's own curvature (dicts ``{name: tensor}`` over the same parameters).
    """
    if reference is None:
        raise ValueError("the white-box bound needs the same-seed retrain model")
    mean_o, var_o = noise_of(original)
    mean_r, var_r = noise_of(reference)
    if set(mean_o) != set(mean_r):
        raise ValueError("original and reference have different parameters")
    return weight_information(mean_o, var_o, mean_r, var_r)


def weight_step_geometry(original: Mapping[str, Tensor], scrubbed: Mapping[str, Tensor],
                         reference: Mapping[str, Tensor]) -> dict[str, float]:
    """Where the scrub's deterministic point w_s went, relative to the original w_o and the retrain model w_r
    (dicts over the same parameter names; float64):

    * ``weight_distance_ratio`` = ‖w_s − w_r‖ / ‖w_o − w_r‖ (< 1: the scrub moved toward the retrain model);
    * ``weight_step_cosine`` = cos(w_s − w_o, w_r − w_o) (1: the step points exactly at the retrain model);
    * ``weight_step_ratio`` = ‖w_r − w_o‖ / ‖w_s − w_o‖ (the multiple of the step that would reach ‖w_r − w_o‖).

    Ratios and the cosine whose denominator is zero are left out (e.g. the original itself).
    """
    keys = list(original)
    if set(keys) != set(scrubbed) or set(keys) != set(reference):
        raise ValueError("original, scrubbed and reference weights must have the same parameter names")
    w_o = _as_flat64(original, keys, "original")
    w_s = _as_flat64(scrubbed, keys, "scrubbed")
    w_r = _as_flat64(reference, keys, "reference")
    step, target = w_s - w_o, w_r - w_o
    ns, nt = float(torch.linalg.vector_norm(step)), float(torch.linalg.vector_norm(target))
    out: dict[str, float] = {}
    if nt > 0:
        out["weight_distance_ratio"] = float(torch.linalg.vector_norm(w_s - w_r)) / nt
    if ns > 0 and nt > 0:
        out["weight_step_cosine"] = float(step @ target) / (ns * nt)
        out["weight_step_ratio"] = nt / ns
    return out
