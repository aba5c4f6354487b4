"""The empirical NTK of a network's logits, without ever holding its Jacobian.

Notation: ``x`` holds N samples, the model has c outputs (logits) and p trainable parameters.
J ∈ R^{Nc×p} stacks the per-(sample, class) Jacobian rows J[(i,k), :] = ∂f_k(x_i)/∂w, **sample-major**
(row ``i*c + k``). The Gram (empirical NTK) is Θ = J Jᵀ ∈ R^{Nc×Nc}. Everything is evaluated with the
model in **eval mode** (BatchNorm uses its running statistics, so samples do not interact and per-sample
rows are well defined); the model's mode is restored afterwards.

What is here (and where): the NTK is built in parts —
* :mod:`scrubnet.curvature.jacobian_rows` — :class:`JacobianRows`, the engine: one forward pass with hooks on
  every layer covered by the kernel registry (:mod:`scrubnet.curvature.kernels`) plus c backward passes to
  the layer *outputs* give per-row gradients layer by layer; parameters outside the layer table (other
  modules; layers whose hooks do not see every use of their weight) go through the per-sample path.
* :mod:`scrubnet.curvature.ntk_schedule` — the Gram schedule: per layer the cheaper of two exact
  contractions (explicit Θ_l = G_l G_lᵀ, or ghost Σ_{s,t}(g·g)(ã·ã)), held factors, layer groups or sample
  chunks under the memory budget; :func:`ntk_gram_schedule` reports it.
* :mod:`scrubnet.curvature.ntk_gram` — the Gram itself: :func:`ntk_gram`, :func:`ntk_gram_flops`,
  :func:`ntk_diag_blocks` (the N per-sample c×c blocks), :func:`iter_jacobian_rows`.
* here — the matrix-free products :func:`jacobian_vjp` (Jᵀa), :func:`jacobian_jvp` (J v: forward-mode, or
  the double-VJP where the model has no forward-mode rule, :mod:`scrubnet.curvature.fallbacks`),
  :func:`ntk_matvec` (Θu = J(Jᵀu)), the ridge solves :func:`solve_gram` (Cholesky with jitter) and
  :func:`solve_ntk_cg` (the package's one CG loop on Θ-vector products), and :func:`dense_jacobian` (the
  obviously-correct per-row autograd twin, for tests). The names above are re-exported from here.

Why this algorithm: on CPU a layerwise per-row-gradient / outer-product kernel beat ``vmap(jacrev)``
5.6–25× (ResNet-18, one thread); the c backward passes go to the layer outputs only (no weight gradients).
Measured figures (``benchmarks/ntk_scale.py``) are in the README and docs/decisions/ntk.md ("NTK cost").

Memory: ``memory_budget_bytes`` bounds the large buffers (3/5 for the held factors, 1/5 for the capture
of one micro-batch, 1/5 for the contraction temporaries); sizes are derived from it with a one-sample probe
of the layer shapes. The budget is a target for these buffers, not a hard cap on the process (autograd's
own activations for one micro-batch come on top).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from scrubnet.curvature.fallbacks import jvp_with_pullback, probe_paths
from scrubnet.curvature.jacobian_rows import (DEFAULT_BUDGET, JacobianRows, _Layer, _micro_batch,  # noqa: F401
                                              activation_numel_per_sample, batch_for_budget)
from scrubnet.curvature.ntk_gram import (_rows_stream, _symmetric_gram, iter_jacobian_rows,  # noqa: F401
                                         ntk_diag_blocks, ntk_gram, ntk_gram_flops)
from scrubnet.curvature.ntk_schedule import (_chunked_passes, _ghost_block, _GramPlan, _Held,  # noqa: F401
                                             _min_bytes_per_sample, _pass_flops, _raw_step, _schedule_flops,
                                             _symmetric_schedule, ntk_gram_schedule)
from scrubnet.curvature.params import trainable_params, unflatten
from scrubnet.curvature.solvers import SolveInfo, cholesky_solve_jitter, conjugate_gradient
from scrubnet.models import eval_mode
from scrubnet.models.call import Inputs, call_functional, call_model

# --------------------------------------------------------------------------------------------------
# products
# --------------------------------------------------------------------------------------------------

def jacobian_vjp(model: nn.Module, x: Inputs, a: Tensor, *, batch_size: int = 256) -> Tensor:
    """Jᵀa = ∇_w Σ_i a_i·f(x_i) (eval mode): a (N, c) → flat (p,), one backward per micro-batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    if a.shape[0] != len(x):
        raise ValueError(f"a has {a.shape[0]} rows, x has {len(x)} samples")
    paths = probe_paths(model, x)
    with eval_mode(model), torch.enable_grad(), paths.context():
        for s in range(0, len(x), batch_size):
            f = call_model(model, x[s:s + batch_size])
            gs = torch.autograd.grad((f * a[s:s + batch_size].to(f.dtype)).sum(), params, allow_unused=True)
            out += torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.reshape(-1)
                              for g, p in zip(gs, params)])
    return out


def jacobian_jvp(model: nn.Module, x: Inputs, v: Tensor, *, batch_size: int = 256) -> Tensor:
    """J v (eval mode): flat v (p,) → (N, c), by forward-mode AD (``torch.func.jvp``) or, where the model
    has no forward-mode rule, the double-VJP (:mod:`scrubnet.curvature.fallbacks`)."""
    params = trainable_params(model)
    tangent = unflatten(v.to(next(iter(params.values())).dtype), params)
    buffers = dict(model.named_buffers())
    paths = probe_paths(model, x)
    outs = []
    with eval_mode(model), paths.context():
        for s in range(0, len(x), batch_size):
            xb = x[s:s + batch_size]
            _, jv, _ = jvp_with_pullback(lambda p: call_functional(model, (p, buffers), xb), params, tangent, paths)
            outs.append(jv.detach())
    return torch.cat(outs)


def ntk_matvec(model: nn.Module, x: Inputs, u: Tensor, *, batch_size: int = 256) -> Tensor:
    """Θu = J(Jᵀu) without Θ: u (N, c) → (N, c)."""
    return jacobian_jvp(model, x, jacobian_vjp(model, x, u, batch_size=batch_size), batch_size=batch_size)


def dense_jacobian(model: nn.Module, x: Inputs) -> Tensor:
    """The full J (N·c × p), sample-major rows, one autograd backward per row (tests only: the
    obviously-correct twin, for any model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    with eval_mode(model), torch.enable_grad(), probe_paths(model, x).context():
        for i in range(len(x)):
            f = call_model(model, x[i:i + 1])[0]
            for k in range(f.shape[0]):
                gs = torch.autograd.grad(f[k], params, retain_graph=k < f.shape[0] - 1, allow_unused=True)
                rows.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.reshape(-1)
                                       for g, p in zip(gs, params)]))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------------
# ridge solves
# --------------------------------------------------------------------------------------------------

def solve_gram(theta: Tensor, rhs: Tensor, ridge: float) -> tuple[Tensor, SolveInfo]:
    """(Θ + ridge·I)⁻¹ rhs by float64 Cholesky, with jitter escalation on failure (reported in info)."""
    if ridge < 0:
        raise ValueError("ridge must be non-negative")
    a = theta.to(torch.float64) + ridge * torch.eye(theta.shape[0], dtype=torch.float64, device=theta.device)
    return cholesky_solve_jitter(a, rhs.to(device=theta.device, dtype=torch.float64))


def solve_ntk_cg(model: nn.Module, x: Inputs, rhs: Tensor, ridge: float, *, tol: float = 1e-8,
                 max_iter: int = 1000, batch_size: int = 256) -> tuple[Tensor, SolveInfo]:
    """(Θ + ridge·I)⁻¹ rhs by conjugate gradient on Θ-vector products (Θ never formed).

    rhs (N, c) → (N, c). Each iteration is one VJP and one JVP over x."""
    if ridge <= 0:
        raise ValueError("the CG path needs a positive ridge")

    def matvec(u):
        return ntk_matvec(model, x, u, batch_size=batch_size).to(u.dtype) + ridge * u
    return conjugate_gradient(matvec, rhs.to(torch.float64), tol=tol, max_iter=max_iter)


def gram_bytes(n_rows: int) -> int:
    """Bytes of a float64 Gram with ``n_rows`` rows (for choosing Cholesky vs CG)."""
    return 8 * n_rows * n_rows
