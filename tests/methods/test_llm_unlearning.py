"""The LLM baselines' losses against their closed forms (NPO, SimNPO, GA), on a tiny random causal LM."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("peft")

from scrubnet.methods.llm import UnlearnConfig, forget_loss, unlearn_lm  # noqa: E402
from scrubnet.models.tiny_lm import make_lm, train_word_tokenizer  # noqa: E402
from scrubnet.training.lm import add_lora, encode, nll_loss, sequence_logprob  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    tok = train_word_tokenizer(["a b c d e f g Answer : ? What is"])
    model = add_lora(make_lm(tok.get_vocab_size(), "ci", seed=0).double(), r=2, seed=0)
    batch = encode(tok, ["What is a ?", "What is b c ?"], ["c d", "e f g"])
    return tok, model, batch


def test_npo_against_its_reference_is_two_over_beta_log_two(lm):
    _, model, batch = lm
    cfg = UnlearnConfig.default("npo", beta=0.3)
    # π_θ = π_ref: log(1 + 1^β) = log 2 for every pair
    assert float(forget_loss(cfg, model, model, batch)) == pytest.approx(2 / 0.3 * math.log(2), rel=1e-12)


def test_npo_simnpo_and_ga_by_hand(lm):
    _, model, batch = lm
    other = add_lora(make_lm(model.config.vocab_size, "ci", seed=1).double(), r=2, seed=0)
    lp, n = sequence_logprob(model, batch)
    lp_ref, _ = sequence_logprob(other, batch)
    beta = 0.5
    npo = (2 / beta) * torch.log1p(torch.exp(beta * (lp - lp_ref))).mean()
    assert float(forget_loss(UnlearnConfig.default("npo", beta=beta), model, other, batch)) == \
        pytest.approx(float(npo), rel=1e-10)
    sim = -(2 / 2.5) * F.logsigmoid(-(2.5 / n) * lp - 0.7).mean()
    assert float(forget_loss(UnlearnConfig.default("simnpo", gamma=0.7), model, None, batch)) == \
        pytest.approx(float(sim), rel=1e-10)
    assert float(forget_loss(UnlearnConfig.default("ga"), model, None, batch)) == \
        pytest.approx(-float(nll_loss(model, batch)), rel=1e-12)


def test_unlearning_changes_only_the_adapters_of_a_copy(lm):
    tok, model, batch = lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = unlearn_lm(model, tok, (["What is a ?"], ["c d"]), (["What is b c ?"], ["e f g"]),
                     UnlearnConfig.default("graddiff", lr=1e-2, epochs=3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    changed = [k for k, v in out.state_dict().items() if not torch.equal(before[k], v)]
    assert changed and all("lora_" in k for k in changed)
    with pytest.raises(ValueError, match="choose one of"):
        UnlearnConfig.default("dpo")
