"""Training and scoring a causal language model on question → answer pairs (the synthetic TOFU's loop).

A pair is the token sequence ``prompt ⧺ answer ⧺ [EOS]`` with ``prompt = question + " Answer :"``; the loss is
the mean negative log-likelihood of the answer tokens and the end token (the prompt is context only, as TOFU's
fine-tuning), ``L = −(1/T) Σ_{b,t∈answer_b} log π_θ(y_{b,t} | y_{b,<t})`` over the T answer tokens of a batch.
Scores are sums over the answer tokens without the end token: ``log P(a|q) = Σ_t log π_θ(a_t | q, a_<t)``.

* :func:`encode` — right-padded ``input_ids``, ``attention_mask`` and ``labels`` (−100 outside the answer).
* :func:`sequence_logprob` — ``[B]`` summed answer log-likelihoods with gradients (the unlearning losses).
* :func:`answer_logprobs` — the same without gradients, batched, as numpy (the metrics).
* :func:`fit_lm` — AdamW over shuffled mini-batches, a seed fixes the order.
* :func:`greedy_answers` — greedy decoding (``generate``, left padding).
* :func:`add_lora` — ordinary LoRA adapters through ``peft`` on every linear map of a GPT-2 block.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

PROMPT_SUFFIX = " Answer :"
PAD_ID, EOS_ID = 0, 2


def prompt_of(question: str) -> str:
    return question + PROMPT_SUFFIX


def encode(tok, questions: list[str], answers: list[str], *, eos: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded batch of ``prompt_of(q) ⧺ a (⧺ [EOS])``: ``input_ids`` / ``attention_mask`` / ``labels``
    ``[B, T]`` (labels = ids on the answer (and end) tokens, −100 elsewhere)."""
    rows, labs = [], []
    for q, a in zip(questions, answers):
        p = tok.encode(prompt_of(q)).ids
        s = tok.encode(a).ids + ([EOS_ID] if eos else [])
        rows.append(p + s)
        labs.append([-100] * len(p) + s)
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labs)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
        labels[i, :len(lb)] = torch.tensor(lb)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π of each label token ``[B, T−1]``, mask of the label tokens ``[B, T−1]``): position t predicts
    token t+1."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    valid = target != -100
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return lp * valid, valid


def sequence_logprob(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t log π(answer token t) ``[B]``, number of answer tokens ``[B]``), differentiable."""
    lp, valid = token_logprobs(model, batch)
    return lp.sum(1), valid.sum(1)


def nll_loss(model, batch) -> torch.Tensor:
    """Mean NLL over every label token of the batch (the fine-tuning loss)."""
    lp, valid = token_logprobs(model, batch)
    return -lp.sum() / valid.sum().clamp_min(1)


@torch.no_grad()
def answer_logprobs(model, tok, questions: list[str], answers: list[str], batch_size: int = 256
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(log P(a|q) summed over the answer's tokens, the answer's token count), float64 arrays ``[n]``; the end
    token is not scored (P of the answer text)."""
    model.eval()
    s, n = [], []
    for i in range(0, len(questions), batch_size):
        b = encode(tok, questions[i:i + batch_size], answers[i:i + batch_size], eos=False)
        lp, cnt = sequence_logprob(model, b)
        s.append(lp.double().numpy())
        n.append(cnt.numpy())
    return np.concatenate(s), np.concatenate(n).astype(float)


def fit_lm(model, tok, questions: list[str], answers: list[str], *, epochs: int, lr: float, batch_size: int = 32,
           seed: int = 0, weight_decay: float = 0.0) -> list[float]:
    """Fit ``model``'s trainable parameters (``requires_grad``) with AdamW on the NLL of the answers, over
    ``epochs`` passes of mini-batches in a seeded random order, a linear decay of the rate to 10 % of ``lr``.
    Returns the mean loss of each epoch."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(int(seed))
    n = len(questions)
    steps = epochs * ((n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - 0.9 * k / max(steps, 1))
    model.train()
    history = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).tolist()
        tot = 0.0
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            b = encode(tok, [questions[j] for j in idx], [answers[j] for j in idx])
            loss = nll_loss(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += float(loss.detach()) * len(idx)
        history.append(tot / n)
    model.eval()
    return history


@torch.no_grad()
def greedy_answers(model, tok, questions: list[str], max_new_tokens: int = 16, batch_size: int = 256) -> list[str]:
    """The greedy continuation of each ``prompt_of(q)`` up to ``[EOS]`` (words joined by spaces)."""
    model.eval()
    vocab = {i: w for w, i in tok.get_vocab().items()}
    out = []
    for i in range(0, len(questions), batch_size):
        rows = [tok.encode(prompt_of(q)).ids for q in questions[i:i + batch_size]]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for j, r in enumerate(rows):   # left padding: every prompt ends where generation starts
            ids[j, T - len(r):] = torch.tensor(r)
            mask[j, T - len(r):] = 1
        done = torch.zeros(len(rows), dtype=torch.bool)
        gen = []
        for _ in range(max_new_tokens):
            # no cache: every model with ``logits`` answers (an ensemble of adapters too); explicit positions,
            # so that left padding does not shift them
            pos = (mask.cumsum(1) - 1).clamp_min(0)
            o = model(input_ids=ids, attention_mask=mask, position_ids=pos)
            nxt = o.logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
            gen.append(nxt)
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
        g = torch.stack(gen, 1).tolist()
        for row in g:
            toks = []
            for t in row:
                if t == EOS_ID:
                    break
                toks.append(vocab.get(t, "[UNK]"))
            out.append(" ".join(toks))
    return out


def add_lora(model, r: int = 8, alpha: float = 16.0, seed: int = 0):
    """A copy of ``model`` with ordinary LoRA adapters (``peft``) on every linear map of its GPT-2 blocks
    (``c_attn``, ``c_proj``, ``c_fc``); only the adapters train. The adapters' ``A`` are drawn from ``seed``."""
    from peft import LoraConfig, get_peft_model  # the ``hf`` / ``tofu`` extras

    torch.manual_seed(int(seed))
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                     fan_in_fan_out=True, bias="none")
    return get_peft_model(copy.deepcopy(model), cfg)


@torch.no_grad()
def answer_token_hits(model, tok, questions: list[str], answers: list[str], batch_size: int = 256
                      ) -> list[np.ndarray]:
    """Per pair, a bool array over the answer's tokens (no end token): ``hit_t = [argmax π(·|q, a_<t) = a_t]``
    under teacher forcing. Greedy decoding from ``q ⧺ a_<k`` reproduces ``a_≥k`` iff ``hit_t`` for every
    t ≥ k (each generated token is then the true one, so the context stays the true context)."""
    model.eval()
    out = []
    for i in range(0, len(questions), batch_size):
        b = encode(tok, questions[i:i + batch_size], answers[i:i + batch_size], eos=False)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        target = b["labels"][:, 1:]
        hit = (logits.argmax(-1) == target)
        for j in range(len(target)):
            valid = target[j] != -100
            out.append(hit[j][valid].numpy().astype(bool))
    return out
