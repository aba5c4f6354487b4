"""The LLM field's approximate unlearning baselines, on a causal LM fine-tuned on question → answer pairs.

Written from the papers' definitions (own code). With ``log π(y|x)`` the summed log-likelihood of the answer
tokens (:func:`scrubnet.training.lm.sequence_logprob`), ``|y|`` its token count, ``ℓ(x, y)`` the mean token NLL
of a batch, D_f the forget pairs and D_r the retain pairs:

* ``ga`` — gradient ascent on the forget set: ``L = −ℓ_f``.
* ``graddiff`` — ascent on the forget set, descent on the retain set: ``L = −ℓ_f + λ·ℓ_r``.
* ``npo`` — negative preference optimisation (Zhang et al. 2024, "Negative preference optimization: from
  catastrophic collapse to effective unlearning"):
  ``L = (2/β) E_{D_f}[ log(1 + (π_θ(y|x)/π_ref(y|x))^β) ] + λ·ℓ_r`` = ``−(2/β) E log σ(−β (log π_θ − log π_ref))
  + λ·ℓ_r`` with π_ref the model before unlearning (the retain term is the paper's NPO+RT; λ = 0 drops it).
* ``simnpo`` — SimNPO (Fan et al. 2024, "Simplicity prevails: rethinking negative preference optimization for
  LLM unlearning"): reference-free and length-normalised,
  ``L = −(2/β) E_{D_f}[ log σ(−(β/|y|) log π_θ(y|x) − γ) ] + λ·ℓ_r``.

Every method updates the same parameters fine-tuning trained (``requires_grad``: the LoRA adapters of a peft
model), with AdamW at a constant rate for ``epochs`` passes over D_f in batches of ``batch_size``, each paired
with a batch of D_r of the same size drawn at random (seeded). :data:`DEFAULTS` are ours for this benchmark's
scale (the papers' Llama settings, lr 1e-5 for 5–10 epochs, do not move a 1 M-parameter model); the bench
tunes the learning rate (:data:`LR_GRID`) on a validation forget set of other people.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from scrubnet.training.lm import encode, nll_loss, sequence_logprob

LLM_METHODS = ("ga", "graddiff", "npo", "simnpo")
#: per method: β, γ and the retain weight λ (see the module docstring)
DEFAULTS = {"ga": {"retain_weight": 0.0}, "graddiff": {"retain_weight": 1.0},
            "npo": {"beta": 0.1, "retain_weight": 1.0}, "simnpo": {"beta": 2.5, "gamma": 0.0, "retain_weight": 1.0}}
#: the learning rates a tuned method tries (its trial budget: one run per value)
LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2)


@dataclasses.dataclass
class UnlearnConfig:
    """One run of an approximate method."""

    method: str
    lr: float = 1e-3
    epochs: int = 5
    batch_size: int = 16
    beta: float = 0.1
    gamma: float = 0.0
    retain_weight: float = 1.0
    seed: int = 0

    @classmethod
    def default(cls, method: str, **over) -> "UnlearnConfig":
        if method not in LLM_METHODS:
            raise ValueError(f"method {method!r}: choose one of {', '.join(LLM_METHODS)}")
        return cls(method=method, **{**DEFAULTS[method], **over})


def forget_loss(cfg: UnlearnConfig, model, ref_model, fb) -> torch.Tensor:
    """The forget term of ``cfg.method`` on the forget batch ``fb`` (module docstring)."""
    if cfg.method in ("ga", "graddiff"):
        return -nll_loss(model, fb)
    lp, n = sequence_logprob(model, fb)
    if cfg.method == "npo":
        with torch.no_grad():
            lp_ref, _ = sequence_logprob(ref_model, fb)
        return -(2.0 / cfg.beta) * F.logsigmoid(-cfg.beta * (lp - lp_ref)).mean()
    return -(2.0 / cfg.beta) * F.logsigmoid(-(cfg.beta / n.clamp_min(1)) * lp - cfg.gamma).mean()


def unlearn_lm(model, tok, forget_qa: tuple[list[str], list[str]], retain_qa: tuple[list[str], list[str]],
               cfg: UnlearnConfig):
    """A copy of ``model`` after ``cfg.method`` on the forget pairs (questions, answers), with the retain pairs
    for the retain term. The input model is not changed."""
    if cfg.method not in LLM_METHODS:
        raise ValueError(f"method {cfg.method!r}: choose one of {', '.join(LLM_METHODS)}")
    out = copy.deepcopy(model)
    ref = model if cfg.method == "npo" else None
    params = [p for p in out.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    fq, fa = forget_qa
    rq, ra = retain_qa
    out.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(fq), generator=gen).tolist()
        for i in range(0, len(fq), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            loss = forget_loss(cfg, out, ref, encode(tok, [fq[j] for j in idx], [fa[j] for j in idx]))
            if cfg.retain_weight > 0 and rq:
                ridx = torch.randint(len(rq), (len(idx),), generator=gen).tolist()
                loss = loss + cfg.retain_weight * nll_loss(out, encode(tok, [rq[j] for j in ridx],
                                                                       [ra[j] for j in ridx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    out.eval()
    return out
