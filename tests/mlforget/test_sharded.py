"""The sharded (isolated) engine: exact deletion by retraining the touched shards from their slice checkpoints.

After any sequence of requests the weights (every shard, every slice checkpoint) must EQUAL — ``torch.equal``,
bit for bit on CPU — those of a sharded fine-tune run from scratch on D ∖ D_f with the same seeds; a request
must retrain only the shards it touches, from the earliest touched slice; a causal LM is fine-tuned with the
loss on its answer tokens only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scrubnet.mlforget.finetune import accuracy
from scrubnet.mlforget.sharded import (ShardedConfig, assignment, causal_lm_loss, sharded_finetune)
from scrubnet.models.lora import LoRA


def pretrained_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def task(n: int = 72, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
    return x, y


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


OPTS = dict(shards=3, slices=3, epochs=6, lr=0.05, batch_size=8, seed=5)


def test_assignment_depends_on_the_id_alone():
    s1, r1 = assignment(range(100), 4, 3, seed=2)
    s2, r2 = assignment([7, 50, 99], 4, 3, seed=2)
    assert torch.equal(s2, s1[[7, 50, 99]]) and torch.equal(r2, r1[[7, 50, 99]])
    assert set(s1.tolist()) == {0, 1, 2, 3} and set(r1.tolist()) == {1, 2, 3}
    assert not torch.equal(assignment(range(100), 4, 3, seed=3)[0], s1)  # the seed changes it


def test_sequence_of_deletions_equals_fresh_sharded_finetune_bit_for_bit():
    x, y = task()
    uw = LoRA(["0", "2"], rank=2, modules_to_save=["4"])
    sm = sharded_finetune(pretrained_mlp(), x, y, user_weights=uw, **OPTS)
    before = {k: v.clone() for k, v in sm.state_dict().items()}
    shard, sl = sm.shard_of, sm.slice_of
    # request 1: one id of the last slice of one shard → only that shard, only its last stage
    last = int(torch.nonzero((shard == 1) & (sl == 3))[0])
    info = sm.forget([last], x, y)
    assert info["shards_retrained"] == [1] and info["from_slice"] == {"1": 3}
    after = sm.state_dict()
    untouched = [k for k in after if not k.startswith("s1/r3/") and not k.startswith("held/s1")]
    assert all(torch.equal(after[k], before[k]) for k in untouched)
    assert not torch.equal(after["s1/r3/4.weight"], before["s1/r3/4.weight"])
    assert 0 < info["sample_passes"] < info["full_sample_passes"] / 3
    # requests 2 and 3: several shards and early slices
    sm.forget([0, 5, 11], x, y)
    sm.forget([20, 33], x, y)
    gone = sorted([last, 0, 5, 11, 20, 33])
    keep = torch.tensor([i for i in range(len(y)) if i not in gone])
    fresh = sharded_finetune(pretrained_mlp(), x[keep], y[keep], user_weights=uw, ids=keep, **OPTS)
    assert same_weights(sm, fresh)
    assert torch.equal(sm(x), fresh(x))
    assert accuracy(sm, x, y) > 0.6


def test_deletion_does_not_need_the_deleted_rows_and_refuses_bad_ids():
    x, y = task(40)
    sm = sharded_finetune(pretrained_mlp(), x, y, user_weights="head", shards=2, slices=2, epochs=2, seed=1)
    keep = torch.arange(1, 40)
    ref = sharded_finetune(pretrained_mlp(), x, y, user_weights="head", shards=2, slices=2, epochs=2, seed=1)
    ref.forget([0], x[keep], y[keep], row_ids=keep)  # the data without the deleted row
    sm.forget([0], x, y)
    assert same_weights(sm, ref)
    for bad, msg in (([0], "already forgotten"), ([99], "not user data"), ([3, 3], "duplicated"), ([], "empty")):
        with pytest.raises(ValueError, match=msg):
            sm.forget(bad, x, y)


def test_aggregate_is_the_mean_of_the_live_shards_probabilities():
    x, y = task(30)
    sm = sharded_finetune(pretrained_mlp(), x, y, user_weights="head", shards=3, slices=1, epochs=2, seed=0)
    probs = sm.shard_probabilities(x)
    assert torch.allclose(sm(x).double().exp(), probs.mean(0), atol=1e-6)
    sm.config.aggregate = "vote"
    votes = torch.nn.functional.one_hot(probs.argmax(-1), 3).double().mean(0)
    assert torch.equal(sm(x).argmax(1), votes.argmax(1))
    with pytest.raises(ValueError, match="aggregate"):
        ShardedConfig(aggregate="max")


def tiny_gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=12, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def lm_task(n: int = 32, seed: int = 0):
    """Prompt [a, b, SEP] → answer token b + 4 (the answer needs the second token): labels −100 but there."""
    g = torch.Generator().manual_seed(seed)
    ab = torch.randint(0, 4, (n, 2), generator=g)
    ids = torch.cat([ab, torch.full((n, 1), 8), ab[:, 1:] + 4], 1)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    return ids, labels


def test_causal_lm_answer_tokens_only_and_exact_deletion():
    ids, labels = lm_task()
    model = tiny_gpt2()
    # the loss reads only the answer position: changing a prompt label changes nothing
    logits = model(ids).logits
    other = labels.clone()
    assert torch.isclose(causal_lm_loss(logits, labels),
                         torch.nn.functional.cross_entropy(logits[:, 2], ids[:, 3]))
    assert torch.equal(causal_lm_loss(logits, other), causal_lm_loss(logits, labels))
    opts = dict(user_weights=LoRA(["c_attn", "c_fc"], rank=2), shards=2, slices=2,  # the pretrained LM head
                epochs=4, lr=0.02, batch_size=8, seed=3)
    sm = sharded_finetune(model, ids, labels, **opts)
    sm.forget([1, 6], ids, labels)
    keep = torch.tensor([i for i in range(len(ids)) if i not in (1, 6)])
    fresh = sharded_finetune(tiny_gpt2(), ids[keep], labels[keep], ids=keep, **opts)
    assert same_weights(sm, fresh)
    out = sm(ids)
    assert out.shape == (len(ids), ids.shape[1], 12) and torch.equal(out, fresh(ids))
