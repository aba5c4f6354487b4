"""Choosing the exact engine before any real training: the pre-flight, and ``strategy="auto"``.

    decision = preflight(model, x, y, c, user_weights=LoRA(["query", "value"], 4, modules_to_save=["classifier"]))
    decision["engine"], decision["reason"]        # 'linearised' | 'sharded', and one line saying why

Two exact engines delete from a fine-tuned model: the linearised one (:mod:`scrubnet.mlforget.finetune`:
a closed-form downdate, requests ≥ 100× cheaper than a re-fine-tune, but a first-order model that cannot
learn a task needing the network to move, e.g. attention to a new position) and the sharded one
(:mod:`scrubnet.mlforget.sharded`: ordinary fine-tuning of isolated adapters, requests that retrain a shard).
The pre-flight measures, on a seeded held-out split of the user's data
(:func:`scrubnet.mlforget.chance.held_out_split`: ≥ 200 samples or half of what there is), with Wilson 95 %
intervals:

* the linearised model's held-out error — fitted exactly on the rest over the µ grid (:func:`select_mu`,
  whose choice of µ is kept for the real fit);
* ordinary fine-tuning of the same user weights on the rest (``budget``: Adam, the epochs the sharded engine
  would train; the command line and the trainer pass theirs) — the yardstick of "does the task need the
  network to move". Half the epochs misled it: on the causal LM of ``benchmarks/forgettable.py`` it learned
  nothing in half the epochs (0.633 held-out error) where the full count reached 0.460, and the linearised
  engine (0.600) passed as "within tolerance" of a failure.

``strategy="auto"`` takes the linearised engine when its held-out error is within ``tolerance`` (2 points by
default) of the ordinary one and outside the chance interval, else the sharded engine; ``reason`` says which
numbers decided, in one line. Causal-LM labels (N, T) go to the sharded engine unless every sample has one
answer token (then both are measured: the linearised engine reads the pretrained LM head's logits of the
label words at the answer position, :class:`AnswerLogits`).

:func:`fit_engine` runs the chosen engine and the chance guard of both (no checkpoint at chance): the
linearised engine's held-out check (:func:`~scrubnet.mlforget.finetune.refuse_near_chance`), the sharded
engine's out-of-shard error (every shard's adapter scored on samples it never saw). For a *memorisation*
task (``task="memorisation"``: facts about people, where a held-out question about an unseen person has no
answer to find) both guards score the model that answers on its own training answers instead
(:func:`training_answer_check`), and ``auto`` takes the sharded engine (:func:`memorisation_decision`).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from scrubnet.mlforget.chance import (TASKS, at_chance, chance_error, chance_interval, chance_report, check_draw,
                                      error_interval, held_out_split, refusal)
from scrubnet.mlforget.finetune import (accuracy, forgettable_finetune, ordinary_finetune, select_mu,
                                        user_weight_names)
from scrubnet.mlforget.sharded import IGNORE_INDEX, ShardedModel, sharded_finetune, sharded_state
from scrubnet.models.call import ModelInputs, call_model

#: the engines and the strategies that choose them
ENGINES = ("linearised", "sharded")
STRATEGIES = ENGINES + ("auto",)
#: the largest held-out error gap (linearised − ordinary) at which ``auto`` keeps the linearised engine
TOLERANCE = 0.02
#: the ordinary fine-tuning budget of the pre-flight
BUDGET = {"epochs": 10, "lr": 1e-2, "batch_size": 32}


class AnswerLogits(nn.Module):
    """A causal LM read as a classifier over its label words: the logits of the ``label_tokens`` that predict
    the answer token, i.e. the LM head's output at the position before it (``answer_position`` − 1), through
    the pretrained LM head (the label-word formulation under which the kernel view of fine-tuning holds best,
    Malladi et al. 2023).

    Parameters
    ----------
    lm : nn.Module
        Gives logits (n, T, V) (``AutoModelForCausalLM`` or any module with a ``logits`` output).
    label_tokens : sequence of int (K,)
        The answer tokens (the classes, in this order).
    """

    def __init__(self, lm: nn.Module, label_tokens):
        super().__init__()
        self.lm = lm
        self.register_buffer("label_tokens", torch.as_tensor(list(label_tokens), dtype=torch.long))

    def forward(self, input_ids: Tensor, answer_position: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        kw = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = call_model(self.lm, ModelInputs(input_ids, kw))
        return logits[torch.arange(len(input_ids)), answer_position.long() - 1][:, self.label_tokens]


def answer_token_task(x, labels: Tensor, label_tokens=None):
    """(inputs with ``answer_position``, class labels (N,), label tokens) of a causal-LM task whose samples
    each hold ONE answer token (labels (N, T), −100 elsewhere) for :class:`AnswerLogits`; the label tokens are
    the distinct answer tokens (sorted) unless given. None when some sample holds more or none, or an answer
    token is not among ``label_tokens``."""
    keep = labels != IGNORE_INDEX
    if not bool((keep.sum(1) == 1).all()):
        return None
    pos = keep.long().argmax(1)
    answers = labels[torch.arange(len(labels)), pos]
    words = torch.unique(answers) if label_tokens is None else torch.as_tensor(list(label_tokens), dtype=torch.long)
    index = {int(t): k for k, t in enumerate(words.tolist())}
    if any(int(a) not in index for a in answers.tolist()):
        return None
    main = x.main if isinstance(x, ModelInputs) else x
    extras = dict(x.extras) if isinstance(x, ModelInputs) else {}
    y = torch.tensor([index[int(a)] for a in answers.tolist()], dtype=torch.long)
    return ModelInputs(main, {**extras, "answer_position": pos}), y, words.tolist()


def _error(model: nn.Module, x, y: Tensor) -> float:
    return 1.0 - accuracy(model, x, y)


def preflight(model: nn.Module, x, y: Tensor, num_classes: int, *, user_weights="head",
              tolerance: float = TOLERANCE, budget: dict | None = None, target_scale: float = 5.0,
              solver: str = "auto", seed: int = 0) -> dict:
    """Measure both engines' premise on held-out data and choose (module docstring).

    Parameters
    ----------
    model : nn.Module
        The pretrained network (a causal LM is wrapped by :class:`AnswerLogits` first); never modified.
    x, y : inputs (N, ...) and labels (N,) (or (N, T) token labels for a causal LM)
    num_classes : int
    user_weights : LoRA, list of str or "head"
    tolerance : float
        Largest held-out error gap (linearised − ordinary) that keeps the linearised engine.
    budget : dict, optional
        The ordinary fine-tuning's ``epochs``, ``lr``, ``batch_size`` (default :data:`BUDGET`).
    target_scale, solver, seed : the linearised fit's

    Returns
    -------
    dict
        ``engine``, ``reason`` (one line), ``held_out``, ``linearised_error`` / ``ordinary_error`` with
        ``*_interval`` (Wilson 95 %), ``mu`` (the µ the linearised search chose), ``chance``,
        ``chance_interval``, ``tolerance``.
    """
    if y.dim() == 2:
        task = answer_token_task(x, y)
        if task is None:
            return {"engine": "sharded", "reason": "sharded: causal-LM answers of several tokens (the linearised "
                    "engine reads one answer token per sample)", "held_out": 0}
        x, y, words = task
        model, num_classes = AnswerLogits(model, words), len(words)
    budget = {**BUDGET, **(budget or {})}
    net, names, _ = user_weight_names(model, user_weights)
    core = torch.zeros(0, dtype=torch.long)
    fit, val = held_out_split(len(y), seed)
    mu, search = select_mu(net, names, x, y, num_classes, core, target_scale=target_scale, solver=solver,
                           seed=seed, n_held_out=len(val))
    lin = search["best"]
    ordinary = ordinary_finetune(model, x[fit], y[fit], user_weights=user_weights, seed=seed, **budget)
    ordv = _error(ordinary, x[val], y[val])
    c, _ = chance_error(y, num_classes)
    lo = chance_interval(c, len(val))
    n = len(val)
    gap = lin - ordv
    numbers = (f"held-out error linearised {lin:.3f} [{error_interval(lin, n)[0]:.3f}, {error_interval(lin, n)[1]:.3f}]"
               f", ordinary fine-tuning {ordv:.3f} [{error_interval(ordv, n)[0]:.3f}, "
               f"{error_interval(ordv, n)[1]:.3f}] on {n} samples")
    if at_chance(lin, c, n):
        engine, why = "sharded", f"the linearised model is at chance (chance interval [{lo[0]:.3f}, {lo[1]:.3f}])"
    elif gap > tolerance:
        engine, why = "sharded", f"the linearised model is {100 * gap:.1f} points behind (tolerance {100 * tolerance:g})"
    else:
        engine, why = "linearised", f"the linearised model is within {100 * tolerance:g} points ({100 * gap:+.1f})"
    return {"engine": engine, "reason": f"{engine}: {why}; {numbers}", "held_out": n, "linearised_error": lin,
            "linearised_error_interval": list(error_interval(lin, n)), "ordinary_error": ordv,
            "ordinary_error_interval": list(error_interval(ordv, n)), "mu": float(mu), "chance": c,
            "chance_interval": list(lo), "tolerance": float(tolerance), "budget": budget}


#: the shard counts :func:`choose_shards` tries (largest first)
SHARD_CANDIDATES = (8, 4, 2, 1)


def choose_shards(model: nn.Module, x, y: Tensor, num_classes: int, *, user_weights="head",
                  tolerance: float = TOLERANCE, budget: dict | None = None, candidates=SHARD_CANDIDATES,
                  seed: int = 0) -> dict:
    """The sharded engine's S from the task's learning curve: the largest S whose shard-sized ordinary
    fine-tune is within ``tolerance`` of the whole-data one.

    A shard sees N/S samples; the aggregate of S such shards is at best about as good as one of them on a task
    that needs the network to move (measured on the causal LM of ``benchmarks/forgettable.py``), so the
    learning curve of ONE shard-sized fine-tune says what sharding costs before any real training. On the
    pre-flight's seeded held-out split (:func:`~scrubnet.mlforget.chance.held_out_split`), the same user
    weights are fine-tuned the ordinary way (``budget``) on the first ⌈|fit|/S⌉ of a seeded permutation of
    the fit samples for every S in ``candidates``; with e_S the held-out error and e_1 the whole fit split's,

        S* = max { S : e_S ≤ e_1 + tolerance }   (S = 1 always qualifies; S* = 1 when e_1 is at chance)

    and S = 1 (with R slices: requests still resume from the slice before the deleted sample) is a valid
    point of the design space.

    Returns
    -------
    dict
        ``shards`` (S*), ``errors`` ({S: e_S}), ``held_out``, ``tolerance``, ``reason`` (one line).
    """
    if y.dim() == 2:
        task = answer_token_task(x, y)
        if task is None:
            raise ValueError("choosing S fine-tunes classifiers of the answer token: give one answer token per "
                             "sample, or give --shards")
        x, y, words = task
        model, num_classes = AnswerLogits(model, words), len(words)
    budget = {**BUDGET, **(budget or {})}
    fit, val = held_out_split(len(y), seed)
    perm = fit[torch.randperm(len(fit), generator=torch.Generator().manual_seed(7919 * int(seed) + 31))]
    errors = {}
    for S in sorted({int(s) for s in candidates} | {1}):
        part = torch.sort(perm[:max(1, -(-len(perm) // S))]).values
        net = ordinary_finetune(model, x[part], y[part], user_weights=user_weights, seed=seed, **budget)
        errors[S] = _error(net, x[val], y[val])
    line = ", ".join(f"S={S} {errors[S]:.3f}" for S in sorted(errors))
    c, _ = chance_error(y, num_classes)
    if at_chance(errors[1], c, len(val)):  # no curve to read: the most data per shard, and say so
        best, why = 1, (f"shards 1: even the ordinary fine-tune of the whole fit split is at chance (held-out "
                        f"error {line} on {len(val)} samples, chance {c:.3f}): the most data per shard")
    else:
        best = max(S for S, e in errors.items() if e <= errors[1] + tolerance)
        why = (f"shards {best}: the largest S whose shard-sized ordinary fine-tune is within {100 * tolerance:g} "
               f"points of the whole data's (held-out error {line} on {len(val)} samples)")
    return {"shards": best, "errors": {str(k): v for k, v in errors.items()}, "held_out": len(val),
            "tolerance": float(tolerance), "chance": c, "reason": why}


def out_of_shard_check(sm: ShardedModel, x, y: Tensor, num_classes: int, max_samples: int = 400) -> dict:
    """The sharded engine's honest held-out error: each shard's adapter scored on (at most ``max_samples``,
    a seeded draw of) the remaining samples it never trained on; the errors pooled; compared with the chance
    interval (:func:`scrubnet.mlforget.chance.chance_report`). For a causal LM a sample is right when every
    answer token is the arg-max."""
    remaining = sm.remaining_ids()
    pos = {int(i): k for k, i in enumerate(sm.ids.tolist())}
    wrong, total = 0, 0
    g = torch.Generator().manual_seed(int(sm.config.seed) + 17)
    for k in range(sm.config.shards):
        if int(sm.held[k]) == 0:
            continue
        other = remaining[~torch.isin(remaining, sm.ids[sm.shard_of == k])]
        other = other[torch.randperm(len(other), generator=g)[:max_samples]]
        if not len(other):
            continue
        rows = torch.tensor([pos[int(i)] for i in other.tolist()])
        sm._load(sm.ckpt[k][-1])
        with torch.no_grad():
            out = call_model(sm.net, x[rows])
        if y.dim() == 2:
            lab = y[rows][:, 1:]
            pred = out[:, :-1].argmax(-1)
            ok = ((pred == lab) | (lab == IGNORE_INDEX)).all(1)
        else:
            ok = out.argmax(1) == y[rows]
        wrong += int((~ok).sum())
        total += len(rows)
    sm._load(sm.ckpt[0][-1])
    if total == 0:
        raise ValueError("the sharded engine's chance check scores each shard on samples it never saw: it needs "
                         "at least 2 shards holding data")
    err = wrong / total
    labels = y if y.dim() == 1 else y[y != IGNORE_INDEX]
    report = chance_report(err, total, labels, num_classes)
    report["what"] = "out-of-shard error (each shard on samples it never saw)"
    return report


def _wrong(out: Tensor, y: Tensor) -> Tensor:
    """(n,) bool: a sample is wrong unless its arg-max is the label (every answer token for (n, T) labels)."""
    if y.dim() == 2:
        lab = y[:, 1:]
        return ~((out[:, :-1].argmax(-1) == lab) | (lab == IGNORE_INDEX)).all(1)
    return out.argmax(1) != y


def training_answer_check(model: nn.Module, x, y: Tensor, num_classes: int, rows: Tensor | None = None,
                          seed: int = 0) -> dict:
    """The memorisation task's guard: the error of ``model`` (the model that answers: the shards' aggregate,
    or the linearised model) on a seeded draw of at most :data:`~scrubnet.mlforget.chance.MAX_CHECK` of its
    own training samples ``rows`` (default all), against the chance interval of the whole training labels
    (:func:`~scrubnet.mlforget.chance.chance_report`). For a causal LM the error is that of the answer tokens
    (the arg-max at each answer position), the unit of the chance level (the majority answer token's rate);
    the interval is taken on the number of samples, the wider and so the stricter one."""
    rows = torch.arange(len(y)) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    if not len(rows):
        raise ValueError("the memorisation check scores the model on its training samples: none remain")
    rows = rows[check_draw(len(rows), seed)]
    wrong, scored = 0, 0
    with torch.no_grad():
        for b in range(0, len(rows), 64):
            idx = rows[b:b + 64]
            out, lab = call_model(model, x[idx]), y[idx]
            if y.dim() == 2:  # answer tokens: the chance level's own unit
                lab = lab[:, 1:]
                m = lab != IGNORE_INDEX
                wrong += int(((out[:, :-1].argmax(-1) != lab) & m).sum())
                scored += int(m.sum())
            else:
                wrong += int((out.argmax(1) != lab).sum())
                scored += len(idx)
    labels = y if y.dim() == 1 else y[y != IGNORE_INDEX]
    # the interval's n is the number of SAMPLES even when tokens are scored: a sample's answer tokens are not
    # independent draws, and the wider interval only makes the guard harder to pass
    report = chance_report(wrong / max(scored, 1), len(rows), labels, num_classes)
    report["what"] = "training-answer error (memorisation task: the model that answers, on its own samples)"
    report["measured"] = "training-answer error (memorisation task)"
    return report


def memorisation_decision() -> dict:
    """``strategy="auto"`` on a memorisation task: the pre-flight compares held-out errors, which a task of
    facts about unseen people cannot pass for either engine, so the choice is the engine whose fine-tuning is
    the ordinary one (sharded), said in one line."""
    return {"engine": "sharded", "task": "memorisation", "held_out": 0,
            "reason": "sharded: a memorisation task (answers about the training people) has no held-out answers "
                      "to compare the engines on; the sharded engine fine-tunes the ordinary way and is checked "
                      "on its own training answers"}


def fit_engine(engine: str, model: nn.Module, x, y: Tensor, num_classes: int, *, user_weights="head",
               linearised: dict | None = None, sharded: dict | None = None, seed: int = 0,
               chance_guard: bool = True, task: str = "generalisation"):
    """Fine-tune with ``engine`` and apply its chance guard; returns the request store's state
    (:class:`~scrubnet.mlforget.model.MLState`; a sharded one holds a :class:`ShardedModel`).

    Parameters
    ----------
    engine : 'linearised' or 'sharded'
    model, x, y, num_classes, user_weights, seed
    linearised : dict, optional
        Keyword arguments of :func:`~scrubnet.mlforget.finetune.forgettable_finetune`.
    sharded : dict, optional
        Keyword arguments of :func:`~scrubnet.mlforget.sharded.sharded_finetune` (shards, slices, epochs, …).
    chance_guard : bool
        Refuse (``ValueError``, one line) a model whose held-out error lies within the chance interval.
    task : 'generalisation' or 'memorisation'
        What the guard scores: held-out samples, or (memorisation) the model's own training answers
        (:func:`training_answer_check`; a linearised memorisation fit needs a fixed µ, since ``mu="auto"``
        chooses on held-out samples).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    memorise = task == "memorisation"
    if engine == "linearised":
        task_info = None
        if y.dim() == 2:  # a causal LM: the label words' logits at the answer position (AnswerLogits)
            found = answer_token_task(x, y)
            if found is None:
                raise ValueError("the linearised engine reads a causal LM through its LM head at the answer "
                                 "position: give one answer token per sample, or use the sharded engine")
            x, y, words = found
            model, num_classes = AnswerLogits(model, words), len(words)
            task_info = {"kind": "answer-token", "label_tokens": words}
        opts = dict(linearised or {})
        if memorise and opts.get("mu", 0.05) == "auto":
            raise ValueError("mu='auto' chooses µ on held-out samples, which a memorisation task cannot answer: "
                             "give a fixed µ")
        state = forgettable_finetune(model, x, y, num_classes, user_weights=user_weights, seed=seed,
                                     chance_guard=chance_guard and not memorise, **opts)
        if task_info is not None:
            state.train_info["task"] = task_info
        if memorise:
            check = training_answer_check(state.model, x, y, num_classes, state.user_ids, seed)
            if chance_guard and check["at_chance"]:
                raise ValueError(refusal(check, "the linearised engine"))
            state.train_info["chance_check"] = check
        return state
    if engine != "sharded":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    sm = sharded_finetune(model, x, y, user_weights=user_weights, seed=seed, **(sharded or {}))
    if memorise:  # the shards' aggregate (what answers) on its own training answers
        check = training_answer_check(sm, x, y, num_classes, seed=seed)
        what = "the sharded engine"
    else:
        check = out_of_shard_check(sm, x, y, num_classes)
        what = "the sharded engine's out-of-shard error"
    check["task"] = task
    if chance_guard and check["at_chance"]:
        raise ValueError(refusal(check, what))
    state = sharded_state(sm, num_classes)
    state.train_info["chance_check"] = check
    return state


__all__ = ["AnswerLogits", "BUDGET", "ENGINES", "STRATEGIES", "SHARD_CANDIDATES", "TASKS", "TOLERANCE", "answer_token_task",
           "choose_shards", "fit_engine",
           "memorisation_decision", "out_of_shard_check", "preflight", "training_answer_check"]
