"""How the LLM field scores unlearning (TOFU, Maini et al. 2024; OpenUnlearning), on question–answer pairs.

Notation: for a question q with answer a (|a| tokens), ``P̄(a|q) = P(a|q)^{1/|a|} = exp(log P(a|q)/|a|)`` is the
length-normalised probability.

* **Truth ratio** of a question with paraphrased answer p and perturbed answers p̂_1..p̂_K:
  ``R = exp( (1/K) Σ_k log P̄(p̂_k|q) − log P̄(p|q) )`` — the geometric mean of the perturbed answers'
  normalised probabilities over the paraphrase's (TOFU's released code averages the perturbed answers' mean
  token losses, hence the geometric mean). R < 1: the model prefers the truth.
* The same ratio in the trained answer's phrasing, ``R_a`` (answer against answers with another person's
  value): what a small model that has not learnt to carry a fact into new phrasings still separates.
* **Forget quality**: the p-value of the two-sample Kolmogorov–Smirnov test between the truth ratios of the
  forget questions under the model and under the model retrained without the forget set (scipy's
  ``ks_2samp``, two-sided, exact for small samples). The KS statistic depends on ranks only, so the
  orientation of R (TOFU's paper writes R, its code 1/R) does not change it.
* **Model utility**: the harmonic mean of nine numbers — on the retain set, the public people (TOFU's "real
  authors") and the world facts: the answer probability (retain: mean P̄(a|q); public and world: the paraphrase's
  share ``P̄(p|q) / (P̄(p|q) + Σ_k P̄(p̂_k|q))``, TOFU's normalisation over the options), the ROUGE-L recall of
  the greedy answer, and the truth score ``mean max(0, 1 − R)``.
* **ROUGE-L recall**: ``LCS(greedy words, answer words) / |answer words|``.
* **Exact memorisation** (OpenUnlearning): the share of the answer's tokens that are the arg-max under teacher
  forcing, ``EM = (1/|a|) Σ_t [argmax π(·|q, a_<t) = a_t]``, mean over questions.
* **Extraction strength** (OpenUnlearning, after Carlini et al.): ``ES = 1 − k*/|a|`` with k* the shortest
  prefix of the answer from which greedy decoding reproduces the rest (k* = |a| if none), mean over questions;
  1 = the model says the whole answer unprompted.
* **Value recall** (a leak probe's readout): the share of questions whose greedy answer contains the true value.
  Probes ask the forget questions in held-out phrasings (``paraphrase``) and as a cloze (``format``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from scrubnet.data.tofu import QA, words
from scrubnet.training.lm import answer_logprobs, answer_token_hits, greedy_answers

PROBE_KINDS = ("paraphrase", "format")


def truth_ratio(lp_para: np.ndarray, n_para: np.ndarray, lp_pert: np.ndarray, n_pert: np.ndarray) -> np.ndarray:
    """``R [n]`` from the summed log-probabilities and token counts of the paraphrase ``[n]`` and of the perturbed
    answers ``[n, K]`` (module docstring)."""
    norm_para = np.asarray(lp_para, float) / np.asarray(n_para, float)
    norm_pert = np.asarray(lp_pert, float) / np.asarray(n_pert, float)
    return np.exp(norm_pert.mean(1) - norm_para)


def forget_quality(tr_model: np.ndarray, tr_retain: np.ndarray) -> float:
    """p-value of the two-sample KS test of the two truth-ratio samples (1 = indistinguishable)."""
    from scipy.stats import ks_2samp

    return float(ks_2samp(np.asarray(tr_model, float), np.asarray(tr_retain, float)).pvalue)


def rouge_l_recall(prediction: str, reference: str) -> float:
    """LCS of the word sequences over the reference's length (0 for an empty reference)."""
    p, r = words(prediction), words(reference)
    if not r:
        return 0.0
    prev = [0] * (len(p) + 1)
    for rw in r:
        cur = [0]
        for j, pw in enumerate(p):
            cur.append(prev[j] + 1 if rw == pw else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1] / len(r)


def extraction_strength(hits: np.ndarray) -> float:
    """``1 − k*/|a|`` from the teacher-forced arg-max hits of one answer (k* = the first position from which every
    later hit is true)."""
    hits = np.asarray(hits, bool)
    n = len(hits)
    k = n
    while k > 0 and hits[k - 1]:
        k -= 1
    return 1.0 - k / n if n else 0.0


def harmonic_mean(values) -> float:
    """Harmonic mean; 0 when any value is ≤ 0 (TOFU's utility collapses with its weakest part)."""
    v = np.asarray(list(values), float)
    if np.any(v <= 0):
        return 0.0
    return float(len(v) / np.sum(1.0 / v))


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion k/n (the 95 % band of a leak probe's recall)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


@dataclasses.dataclass
class QAScores:
    """Per-question readouts of one model on one list of :class:`~scrubnet.data.tofu.QA` (arrays ``[n]``)."""

    truth_ratio: np.ndarray        # TOFU's: paraphrase against perturbed paraphrases
    truth_ratio_answer: np.ndarray  # the same in the trained answer's phrasing (answer against perturbed answers)
    norm_prob: np.ndarray          # P̄(a|q)
    option_share: np.ndarray       # P̄(p|q) / (P̄(p|q) + Σ P̄(p̂_k|q))
    loglik: np.ndarray             # log P(a|q) / |a|: U-LiRA's φ
    rouge: np.ndarray | None = None
    recall: np.ndarray | None = None      # greedy answer contains the value
    es: np.ndarray | None = None
    em: np.ndarray | None = None


def score_questions(model, tok, qa: list[QA], *, generate: bool = True, memorisation: bool = False) -> QAScores:
    """Every per-question readout of ``model`` on ``qa`` (greedy decoding when ``generate``; ES and EM when
    ``memorisation``)."""
    qs = [q.question for q in qa]
    K = len(qa[0].perturbed)
    lp_a, n_a = answer_logprobs(model, tok, qs, [q.answer for q in qa])
    lp_p, n_p = answer_logprobs(model, tok, qs, [q.paraphrased for q in qa])
    lp_x, n_x = answer_logprobs(model, tok, [q for q in qs for _ in range(K)], [p for q in qa for p in q.perturbed])
    lp_x, n_x = lp_x.reshape(-1, K), n_x.reshape(-1, K)
    tr = truth_ratio(lp_p, n_p, lp_x, n_x)
    if qa[0].perturbed_answers:
        lp_y, n_y = answer_logprobs(model, tok, [q for q in qs for _ in range(K)],
                                    [p for q in qa for p in q.perturbed_answers])
        tr_a = truth_ratio(lp_a, n_a, lp_y.reshape(-1, K), n_y.reshape(-1, K))
    else:
        tr_a = np.full(len(qa), np.nan)
    norm_p, norm_x = np.exp(lp_p / n_p), np.exp(lp_x / n_x)
    out = QAScores(truth_ratio=tr, truth_ratio_answer=tr_a, norm_prob=np.exp(lp_a / n_a), option_share=norm_p / (norm_p + norm_x.sum(1)),
                   loglik=lp_a / n_a)
    if generate:
        g = greedy_answers(model, tok, qs)
        out.rouge = np.array([rouge_l_recall(x, q.answer) for x, q in zip(g, qa)])
        out.recall = np.array([f" {q.value} " in f" {x} " for x, q in zip(g, qa)])
    if memorisation:
        hits = answer_token_hits(model, tok, qs, [q.answer for q in qa])
        out.es = np.array([extraction_strength(h) for h in hits])
        out.em = np.array([float(np.mean(h)) for h in hits])
    return out


def utility_parts(retain: QAScores, public: QAScores, world: QAScores) -> dict[str, float]:
    """TOFU's nine utility numbers (module docstring), keyed ``set/readout``."""
    parts = {}
    for name, s, prob in (("retain", retain, retain.norm_prob), ("public", public, public.option_share),
                          ("world", world, world.option_share)):
        parts[f"{name}/prob"] = float(np.mean(prob))
        parts[f"{name}/rouge"] = float(np.mean(s.rouge))
        parts[f"{name}/truth"] = float(np.mean(np.maximum(0.0, 1.0 - s.truth_ratio)))
    return parts


def model_utility(parts: dict[str, float]) -> float:
    """The harmonic mean of :func:`utility_parts`."""
    return harmonic_mean(parts.values())
