"""TOFU / OpenUnlearning readouts against hand-computed values, and the batched scoring of a causal LM against a
one-sequence-at-a-time loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scrubnet.readouts.tofu import (extraction_strength, forget_quality, harmonic_mean, model_utility,
                                    rouge_l_recall, truth_ratio, utility_parts, QAScores, wilson_interval)

pytest.importorskip("scipy")


def test_truth_ratio_by_hand():
    # paraphrase: log P = −2 over 2 tokens → P̄ = e^−1; perturbed: P̄ = e^−2 and e^−4 → geometric mean e^−3
    r = truth_ratio(np.array([-2.0]), np.array([2.0]), np.array([[-4.0, -4.0]]), np.array([[2.0, 1.0]]))
    assert r[0] == pytest.approx(math.exp(-3.0 + 1.0))


def test_forget_quality_exact_ks():
    a = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    assert forget_quality(a, a) == pytest.approx(1.0)
    # fully separated samples of 5 and 5: the exact two-sided p is 2 / C(10, 5)
    assert forget_quality(a, a + 1.0) == pytest.approx(2 / math.comb(10, 5))
    # invariant to the orientation of the ratio (1/R)
    b = np.array([0.15, 0.6, 0.9, 1.3, 2.0, 0.05])
    assert forget_quality(a, b) == pytest.approx(forget_quality(1 / a, 1 / b))


def test_rouge_l_and_extraction_strength_by_hand():
    assert rouge_l_recall("a b c d", "a c d e") == pytest.approx(3 / 4)
    assert rouge_l_recall("x y", "a b") == 0.0 and rouge_l_recall("a b", "a b") == 1.0
    assert rouge_l_recall("Dennis was born in Paris .", "Dennis was born in Port Jessicatown .") == pytest.approx(5 / 7)
    assert extraction_strength([True, False, True, True]) == pytest.approx(0.5)
    assert extraction_strength([True, True, True]) == 1.0
    assert extraction_strength([True, True, False]) == 0.0


def test_harmonic_mean_utility_and_wilson():
    assert harmonic_mean([1.0, 0.5]) == pytest.approx(2 / 3)
    assert harmonic_mean([1.0, 0.0]) == 0.0
    s = QAScores(truth_ratio=np.array([0.5, 2.0]), truth_ratio_answer=np.ones(2), norm_prob=np.array([0.2, 0.4]), option_share=np.array([0.5, 0.7]),
                 loglik=np.zeros(2), rouge=np.array([1.0, 0.5]))
    parts = utility_parts(s, s, s)
    assert parts["retain/prob"] == pytest.approx(0.3) and parts["public/prob"] == pytest.approx(0.6)
    assert parts["world/truth"] == pytest.approx(0.25) and parts["retain/rouge"] == pytest.approx(0.75)
    assert model_utility(parts) == pytest.approx(9 / sum(1 / v for v in parts.values()))
    assert len(parts) == 9
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)


def test_batched_scores_equal_one_sequence_loop():
    """Padding, the prompt mask and the label shift: the batched sums equal a loop that feeds one unpadded
    sequence at a time and reads the answer tokens' log-probabilities one by one; greedy decoding with the
    cache under left padding equals an uncached one-sequence arg-max loop."""
    pytest.importorskip("transformers")
    from scrubnet.models.tiny_lm import make_lm, train_word_tokenizer
    from scrubnet.training.lm import answer_logprobs, answer_token_hits, greedy_answers, prompt_of

    tok = train_word_tokenizer(["a b c d e f g h Answer : ?", "What is x y z"])
    model = make_lm(tok.get_vocab_size(), "ci", seed=0).double()
    qs = ["What is a ?", "What is x y z b c ?", "a"]
    ans = ["b c", "d", "e f g h"]
    lp, n = answer_logprobs(model, tok, qs, ans)
    hits = answer_token_hits(model, tok, qs, ans)
    for i, (q, a) in enumerate(zip(qs, ans)):
        p_ids, a_ids = tok.encode(prompt_of(q)).ids, tok.encode(a).ids
        ids = torch.tensor([p_ids + a_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
        ref = sum(float(logp[len(p_ids) + t - 1, a_ids[t]]) for t in range(len(a_ids)))
        assert lp[i] == pytest.approx(ref, abs=1e-9) and n[i] == len(a_ids)
        ref_hits = [int(logp[len(p_ids) + t - 1].argmax()) == a_ids[t] for t in range(len(a_ids))]
        assert list(hits[i]) == ref_hits
    got = greedy_answers(model, tok, qs, max_new_tokens=5)
    vocab = {i: w for w, i in tok.get_vocab().items()}
    for q, g in zip(qs, got):
        ids = tok.encode(prompt_of(q)).ids
        out = []
        for _ in range(5):
            with torch.no_grad():
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == 2:
                break
            out.append(vocab[nxt])
            ids.append(nxt)
        assert g == " ".join(out)
