"""The synthetic TOFU end to end at its smallest size: the controls that make the benchmark credible.

One pretrained GPT-2 (≈ 0.1 M parameters), ordinary LoRA on 20 private people, the retain model without the
forget10 people (2 people, 40 questions): forget quality of the retain model against itself is 1, of the
fine-tuned, never-unlearned model ≪ 1e-5; the exact retrain route is the retain model bit for bit; extraction
strength from the teacher-forced hits equals greedy decoding from every prefix.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("faker")

from scrubnet.experiments.tofu import (EvalSets, compare, evaluate, exact_retrain, lora_finetune, prepare,  # noqa: E402
                                       pretrain, tofu_config)
from scrubnet.readouts.tofu import extraction_strength, forget_quality  # noqa: E402
from scrubnet.training.lm import answer_token_hits  # noqa: E402

CFG = tofu_config("ci")


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    data, tok = prepare(CFG)
    base, _ = pretrain(data, tok, CFG)
    forget, retain = data.forget(CFG.split), data.retain(CFG.split)
    original, _ = lora_finetune(base, tok, data, range(data.n_private), CFG, seed=0)
    retained, _ = lora_finetune(base, tok, data, retain, CFG, seed=0)
    return dict(data=data, tok=tok, base=base, original=original, retain=retained,
                sets=EvalSets(data, forget, retain, CFG))


def test_forget_quality_controls(trained):
    sets, tok = trained["sets"], trained["tok"]
    assert len(sets.forget) == 40
    ev_r = evaluate(trained["retain"], tok, sets, utility=False)
    ev_o = evaluate(trained["original"], tok, sets, utility=False)
    assert forget_quality(ev_r["_raw"]["tr"], ev_r["_raw"]["tr"]) == pytest.approx(1.0)
    fq = compare(ev_o, ev_r)["forget_quality"]
    assert fq < 1e-5, f"the never-unlearned model's forget quality {fq:.3g} should be ≪ 1e-5"
    # the fine-tuned model knows the people it must forget; the retain model mostly does not
    assert ev_o["forget/recall"] >= ev_r["forget/recall"] + 0.25
    assert ev_o["exact_memorisation"] > ev_r["exact_memorisation"]


def test_exact_retrain_is_the_retain_model(trained):
    """The retrain route is the retain model's procedure: equal parameter for parameter (a short schedule: the
    claim is determinism, not convergence); a different seed is not equal."""
    short = dataclasses.replace(CFG, finetune_epochs=2)
    data, tok, base = trained["data"], trained["tok"], trained["base"]
    retained, _ = lora_finetune(base, tok, data, data.retain(CFG.split), short, seed=3)
    _, info = exact_retrain(base, tok, data, short, 3, models={"retain": retained})
    assert info["equals_retain_model"] is True
    assert info["request_sample_passes"] == 2 * 18 * 20
    _, other = exact_retrain(base, tok, data, short, 4, models={"retain": retained})
    assert other["equals_retain_model"] is False


def test_extraction_strength_equals_greedy_from_every_prefix(trained):
    tok, model = trained["tok"], trained["original"]
    qa = trained["sets"].forget[:6]
    hits = answer_token_hits(model, tok, [q.question for q in qa], [q.answer for q in qa])
    for q, h in zip(qa, hits):
        ans = q.answer.split(" ")
        k_star = len(ans)
        for k in range(len(ans) - 1, -1, -1):    # the shortest prefix from which greedy gives the rest
            cont = _greedy_after(model, tok, q.question, ans[:k], len(ans) - k)
            if cont == ans[k:]:
                k_star = k
            else:
                break
        assert extraction_strength(h) == pytest.approx(1 - k_star / len(ans))


def _greedy_after(model, tok, question, prefix_words, n):
    ids = tok.encode(question + " Answer :").ids + [tok.token_to_id(w) for w in prefix_words]
    vocab = {i: w for w, i in tok.get_vocab().items()}
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(vocab[nxt])
            ids.append(nxt)
    return out
