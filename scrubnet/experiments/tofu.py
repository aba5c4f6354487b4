"""The synthetic-TOFU benchmark: forget people from a LoRA-fine-tuned causal LM, scored as the LLM field scores it.

One run (:func:`run_tofu`):

1. **Data** — :func:`scrubnet.data.tofu.make_tofu` (``data_seed``); a word-level tokenizer of its vocabulary
   text; a GPT-2 of ``size`` pretrained on the public people (every phrasing, answers and paraphrased answers)
   and the world facts (:func:`pretrain`), once per run: TOFU's base model.
2. **Per seed s** (the fine-tuning seed: LoRA's initial A and the batch order):
   * ``original`` — ordinary LoRA (peft) on every private person's 20 training pairs: the model users have;
   * ``retain`` — the same fine-tuning on the retain people only: the gold standard (TOFU's retain model);
   * ``retain-seed2`` — the same with seed s + :data:`SECOND_SEED`: the benchmark's own noise (F0);
   * ``exact`` — scrubnet's exact route (:data:`EXACT_ENGINES`): ``retrain`` re-fine-tunes the LoRA from the
     pretrained model without the forgotten people (the same procedure on D ∖ D_f: it *is* the retain model,
     which the run checks), ``sharded`` the isolated engine (SISA shards of LoRA adapters,
     :mod:`scrubnet.mlforget.sharded`) trained on everyone and then asked to delete the people;
   * every approximate method of :mod:`scrubnet.methods.llm` applied to ``original`` with its tuned rate.
3. **Tuning** (once, seed :data:`TUNE_SEED`): each approximate method tries every learning rate of its grid on
   the *validation* people (other private people, as many as the forget set), scored against a model
   fine-tuned without them; the rate with the highest forget quality whose model utility stays ≥
   :data:`UTILITY_FLOOR` × the original's wins (the highest forget quality if none does). Trials are recorded.
4. **Scores** per model (:mod:`scrubnet.readouts.tofu`): forget quality (KS of the forget questions' truth
   ratios against ``retain`` of the same seed; see below for the phrasing), TOFU's paraphrase forget quality
   beside it, model utility (nine numbers), ROUGE-L, probability, extraction
   strength and exact memorisation on the forget set, and the leak probes (held-out paraphrased and cloze
   questions about the forgotten people: the share answered with the true value, and the KS p of their truth
   ratios); per method, U-LiRA (:func:`scrubnet.audit.stats.ulira`) on the length-normalised answer
   log-likelihood of every forget question, unlearned (IN) against retrained (OUT), one seed held out in turn.

**Which truth ratio.** TOFU's truth ratio compares a *paraphrase* of the answer with perturbed paraphrases. A
Llama carries a fine-tuned fact into new wordings; this benchmark's ≈ 0.1–1 M-parameter models mostly do not:
at the CI size (20 private people, forget10 = 40 questions) the never-unlearned model's forget quality was
0.014 with the paraphrase ratio — a control that should be ≪ 1e-5 is not — and 5e-7 with the same ratio in the
trained answer's phrasing (answer vs the answer with another person's value, ``truth_ratio_answer``), the
second-seed retain model 0.27 and 0.77. So ``forget_quality`` uses the answer's phrasing and
``forget_quality_paraphrase`` (TOFU's exact definition) is reported beside it; the probes (held-out question
wordings) test the transfer TOFU's paraphrase tests.

Summary line (:func:`summary_line`)::

    tofu: exact FQ F1 (KS p >= 0.05 in K/S seeds), utility U1 vs ordinary LoRA U0; best approximate M FQ F2,
    utility U2; retain-vs-retain FQ F0; request_vs_refinetune R

Means over seeds; R is the cost of the deletion request over the cost of the user's re-fine-tune (ordinary LoRA
on the retain people, the same recipe), both in sample passes (wall seconds are recorded beside). What this benchmark can show is exactness end to end and
the methods' ranking on a task whose truth is known; its numbers are not comparable with Llama tables.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from scrubnet.audit.engine import LocalEngine
from scrubnet.audit.stats import ulira
from scrubnet.data.tofu import make_tofu
from scrubnet.mlforget.finetune import split_batch
from scrubnet.mlforget.sharded import assignment, sharded_finetune
from scrubnet.methods.llm import LLM_METHODS, LR_GRID, UnlearnConfig, unlearn_lm
from scrubnet.models.lora import LoRA
from scrubnet.models.tiny_lm import make_lm, train_word_tokenizer
from scrubnet.readouts.tofu import (PROBE_KINDS, forget_quality, model_utility, score_questions, utility_parts,
                                    wilson_interval)
from scrubnet.training.lm import add_lora, encode, fit_lm

EXACT_ENGINES = ("retrain", "sharded")
SECOND_SEED = 1000
TUNE_SEED = 0
UTILITY_FLOOR = 0.9
KS_PASS = 0.05


@dataclasses.dataclass
class TofuConfig:
    """The benchmark's sizes and recipes (:data:`PRESETS` name the standard ones)."""

    size: str = "ci"
    n_private: int = 20
    n_public: int = 12
    pool_size: int = 16
    world_max: int = 4
    split: str = "forget10"
    data_seed: int = 0
    seeds: tuple = (0, 1, 2)
    pretrain_epochs: int = 25
    pretrain_lr: float = 3e-3
    finetune_epochs: int = 40
    finetune_lr: float = 6e-3
    lora_r: int = 16
    batch_size: int = 32
    methods: tuple = LLM_METHODS
    unlearn_epochs: int = 5
    lr_grid: tuple = LR_GRID
    tune: bool = True
    exact: str = "sharded"
    shards: int = 2
    slices: int = 2
    max_eval: int = 120

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


#: ``default``: the committed CPU table (≈ 0.13 M parameters, 3 seeds); ``quick``: a shorter check (2 seeds, 2
#: learning rates per method); ``ci``: the test suite's size (one seed, no methods); ``gpu``: the larger model
#: (≈ 1 M parameters, 40 people) for a machine with an accelerator
PRESETS = {
    "default": dict(),
    "quick": dict(seeds=(0, 1), finetune_epochs=30, lr_grid=(1e-3, 1e-2), max_eval=80),
    "ci": dict(n_public=8, seeds=(0,), pretrain_epochs=20, finetune_epochs=30, finetune_lr=3e-3, methods=(),
               tune=False, exact="retrain", max_eval=80),
    "gpu": dict(size="small", n_private=40, n_public=20, pool_size=40, world_max=6, pretrain_epochs=40,
                finetune_epochs=40, shards=4, slices=2, max_eval=200),
}


def tofu_config(preset: str = "default", **over) -> TofuConfig:
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: choose one of {', '.join(PRESETS)}")
    cfg = TofuConfig(**{**PRESETS[preset], **over})
    bad = [m for m in cfg.methods if m not in LLM_METHODS]
    if bad:
        raise ValueError(f"method(s) {', '.join(bad)}: choose from {', '.join(LLM_METHODS)}")
    if cfg.exact not in EXACT_ENGINES:
        raise ValueError(f"exact engine {cfg.exact!r}: choose one of {', '.join(EXACT_ENGINES)}")
    return cfg


def _pairs(qa) -> tuple[list[str], list[str]]:
    return [q.question for q in qa], [q.answer for q in qa]


def _cap(qa: list, k: int) -> list:
    """At most k items, spread evenly over the list (deterministic)."""
    if len(qa) <= k:
        return list(qa)
    return [qa[int(i)] for i in np.linspace(0, len(qa) - 1, k).round().astype(int)]


def pretrain(data, tok, cfg: TofuConfig):
    """TOFU's base model: the GPT-2 of ``cfg.size`` fitted on the public people (every phrasing; answers and
    paraphrased answers) and the world facts."""
    pub = data.questions(data.public, kinds=("train",) + PROBE_KINDS, world=True)
    qs = [q.question for q in pub] + [q.question for q in pub if q.kind == "train"]
    ans = [q.answer for q in pub] + [q.paraphrased for q in pub if q.kind == "train"]
    model = make_lm(tok.get_vocab_size(), cfg.size, seed=cfg.data_seed)
    t0 = time.perf_counter()
    hist = fit_lm(model, tok, qs, ans, epochs=cfg.pretrain_epochs, lr=cfg.pretrain_lr, batch_size=cfg.batch_size,
                  seed=cfg.data_seed)
    return model, {"pairs": len(qs), "final_loss": hist[-1], "seconds": time.perf_counter() - t0}


def lora_finetune(base, tok, data, people, cfg: TofuConfig, seed: int):
    """Ordinary LoRA (peft, rank ``cfg.lora_r``) on the training pairs of ``people``; (model, seconds)."""
    model = add_lora(base, r=cfg.lora_r, alpha=2.0 * cfg.lora_r, seed=seed)
    q, a = _pairs(data.questions(people))
    t0 = time.perf_counter()
    fit_lm(model, tok, q, a, epochs=cfg.finetune_epochs, lr=cfg.finetune_lr, batch_size=cfg.batch_size, seed=seed)
    return model, time.perf_counter() - t0


class EvalSets:
    """The question lists every model is scored on (capped at ``cfg.max_eval`` each)."""

    def __init__(self, data, forget, retain, cfg: TofuConfig):
        self.forget = data.questions(forget)
        self.probes = {k: data.questions(forget, kinds=(k,)) for k in PROBE_KINDS}
        self.retain = _cap(data.questions(retain), cfg.max_eval)
        self.public = _cap(data.questions(data.public), cfg.max_eval)
        self.world = _cap([q for q in data.qa if q.person == -1], cfg.max_eval)


def evaluate(model, tok, sets: EvalSets, *, utility: bool = True) -> dict:
    """Every readout of ``model`` (arrays kept under ``_raw`` for the comparisons against the retain model)."""
    f = score_questions(model, tok, sets.forget, memorisation=True)
    probes = {k: score_questions(model, tok, qa) for k, qa in sets.probes.items()}
    out = {"forget/prob": float(np.mean(f.norm_prob)), "forget/rouge": float(np.mean(f.rouge)),
           "forget/recall": float(np.mean(f.recall)), "extraction_strength": float(np.mean(f.es)),
           "exact_memorisation": float(np.mean(f.em)), "forget/truth_ratio": float(np.mean(f.truth_ratio))}
    for k, s in probes.items():
        out[f"probe/{k}/recall"] = float(np.mean(s.recall))
    if utility:
        parts = utility_parts(score_questions(model, tok, sets.retain), score_questions(model, tok, sets.public),
                              score_questions(model, tok, sets.world))
        out["model_utility"] = model_utility(parts)
        out["utility_parts"] = parts
    out["_raw"] = {"tr": f.truth_ratio_answer, "tr_para": f.truth_ratio, "loglik": f.loglik,
                   **{f"probe/{k}/tr": s.truth_ratio_answer for k, s in probes.items()},
                   **{f"probe/{k}/hits": s.recall for k, s in probes.items()}}
    return out


def compare(ev: dict, ref: dict) -> dict:
    """Forget quality of ``ev`` against the retain model's ``ref``, and the leak probes against its interval."""
    out = {"forget_quality": forget_quality(ev["_raw"]["tr"], ref["_raw"]["tr"]),
           "forget_quality_paraphrase": forget_quality(ev["_raw"]["tr_para"], ref["_raw"]["tr_para"])}
    for k in PROBE_KINDS:
        hits = ref["_raw"][f"probe/{k}/hits"]
        lo, hi = wilson_interval(int(np.sum(hits)), len(hits))
        r = ev[f"probe/{k}/recall"]
        out[f"probe/{k}/fq"] = forget_quality(ev["_raw"][f"probe/{k}/tr"], ref["_raw"][f"probe/{k}/tr"])
        out[f"probe/{k}/retain_interval"] = [lo, hi]
        out[f"probe/{k}/within"] = bool(lo <= r <= hi)
    return out


def _public(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k != "_raw"}


def tune_methods(base, original, tok, data, cfg: TofuConfig, progress=None) -> dict:
    """Each method's learning rate, chosen on the validation people (module docstring); returns
    ``{method: {"lr", "trials": [...], "budget"}}``."""
    val = data.forget("validation")
    keep = [p for p in range(data.n_private) if p not in set(val)]
    val_retain, _ = lora_finetune(base, tok, data, keep, cfg, seed=TUNE_SEED)
    sets = EvalSets(data, val, keep, cfg)
    ref = evaluate(val_retain, tok, sets, utility=False)
    u_orig = evaluate(original, tok, sets)["model_utility"]
    fq_pairs, rt_pairs = _pairs(data.questions(val)), _pairs(data.questions(keep))
    out = {}
    for m in cfg.methods:
        trials = []
        for lr in cfg.lr_grid:
            ucfg = UnlearnConfig.default(m, lr=lr, epochs=cfg.unlearn_epochs, seed=TUNE_SEED)
            ev = evaluate(unlearn_lm(original, tok, fq_pairs, rt_pairs, ucfg), tok, sets)
            trials.append({"lr": lr, "forget_quality": compare(ev, ref)["forget_quality"],
                           "model_utility": ev["model_utility"]})
            if progress:
                progress(f"tune {m} lr={lr:g}: FQ {trials[-1]['forget_quality']:.3g}, "
                         f"utility {trials[-1]['model_utility']:.3f}")
        ok = [t for t in trials if t["model_utility"] >= UTILITY_FLOOR * u_orig] or trials
        best = max(ok, key=lambda t: (t["forget_quality"], t["model_utility"]))
        out[m] = {"lr": best["lr"], "trials": trials, "budget": len(trials), "utility_floor": UTILITY_FLOOR * u_orig}
    return out


def prepare(cfg: TofuConfig):
    """(data, tokenizer) of ``cfg``: deterministic, so a worker rebuilds them instead of receiving them."""
    data = make_tofu(cfg.n_private, cfg.n_public, seed=cfg.data_seed, pool_size=cfg.pool_size,
                     world_max=cfg.world_max)
    return data, train_word_tokenizer(data.vocabulary_text())


def run_seed(base, tok, data, cfg: TofuConfig, seed: int, tuned: dict) -> dict:
    """Every model of one fine-tuning seed, scored (module docstring, step 2); raw per-question arrays under
    ``_raw`` (for U-LiRA across seeds)."""
    forget, retain = data.forget(cfg.split), data.retain(cfg.split)
    sets = EvalSets(data, forget, retain, cfg)
    models, info = {}, {}
    models["original"], t_orig = lora_finetune(base, tok, data, range(data.n_private), cfg, seed)
    models["retain"], t_retain = lora_finetune(base, tok, data, retain, cfg, seed)
    models["retain-seed2"], _ = lora_finetune(base, tok, data, retain, cfg, seed + SECOND_SEED)
    models["exact"], info["exact"] = EXACT_FUNCTIONS[cfg.exact](base, tok, data, cfg, seed, models=models)
    # cost in sample passes (one forward + backward of one pair through the adapted model): deterministic,
    # where wall time on a shared machine is not; seconds are kept beside
    refit = cfg.finetune_epochs * len(data.questions(retain))
    info["exact"].update(refinetune_seconds=t_retain, refinetune_sample_passes=refit,
                         request_vs_refinetune=info["exact"]["request_sample_passes"] / refit)
    fq_pairs, rt_pairs = _pairs(data.questions(forget)), _pairs(data.questions(retain))
    for m in cfg.methods:
        lr = tuned[m]["lr"] if m in tuned else UnlearnConfig.default(m).lr
        t0 = time.perf_counter()
        models[m] = unlearn_lm(models["original"], tok, fq_pairs, rt_pairs,
                               UnlearnConfig.default(m, lr=lr, epochs=cfg.unlearn_epochs, seed=seed))
        info[m] = {"lr": lr, "seconds": time.perf_counter() - t0}
    evs = {name: evaluate(mdl, tok, sets) for name, mdl in models.items()}
    row = {"seed": seed, "original_finetune_seconds": t_orig, "models": {}}
    for name, ev in evs.items():
        row["models"][name] = {**_public(ev), **compare(ev, evs["retain"]), **info.get(name, {})}
    row["_raw"] = {name: ev["_raw"] for name, ev in evs.items()}
    return row


def _seed_task(shared, seed):
    """One engine task: rebuild data, tokenizer and the pretrained model from ``shared`` and run one seed."""
    cfg, base_state, tuned = shared
    data, tok = prepare(cfg)
    base = make_lm(tok.get_vocab_size(), cfg.size, seed=cfg.data_seed)
    base.load_state_dict(base_state)
    return run_seed(base, tok, data, cfg, int(seed), tuned)


def run_tofu(cfg: TofuConfig, progress=None, engine=None) -> dict:
    """The benchmark (module docstring). ``engine``: an audit engine (:mod:`scrubnet.audit.engine`; default
    in-process) over which the seeds run, one task each; pretraining and tuning run here first. Returns a
    JSON-able dict (numpy arrays dropped)."""
    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    data, tok = prepare(cfg)
    base, pre_info = pretrain(data, tok, cfg)
    say(f"pretrained {cfg.size} ({sum(p.numel() for p in base.parameters())} parameters) on {pre_info['pairs']} "
        f"pairs in {pre_info['seconds']:.0f} s, loss {pre_info['final_loss']:.3f}")
    tuned = {}
    if cfg.methods and cfg.tune:
        original, _ = lora_finetune(base, tok, data, range(data.n_private), cfg, TUNE_SEED)
        tuned = tune_methods(base, original, tok, data, cfg, progress=say)
    engine = engine or LocalEngine()
    shared = (cfg, {k: v.detach().clone() for k, v in base.state_dict().items()}, tuned)
    rows = {}
    for i, row in engine.map(_seed_task, shared, list(cfg.seeds)):
        rows[i] = row
        say(f"seed {row['seed']}: " + ", ".join(f"{n} FQ {r['forget_quality']:.3g} U {r['model_utility']:.3f}"
                                                for n, r in row["models"].items()))
    seeds = [rows[i] for i in range(len(cfg.seeds))]
    forget = data.forget(cfg.split)
    result = {"config": cfg.to_dict(), "pretrain": pre_info, "tuning": tuned, "seeds": seeds,
              "n_forget_questions": len(data.questions(forget)), "forget_people": forget,
              "ulira": _ulira(seeds, ["original", "exact", *cfg.methods]), "engine": getattr(engine, "name", "local")}
    result["summary"] = summarise(result)
    result["seconds"] = time.perf_counter() - t_start
    for row in seeds:
        row.pop("_raw")
    return result


def _ulira(seeds: list[dict], names: list[str]) -> dict:
    """Per method, U-LiRA's balanced accuracy (0.5: its forget questions' log-likelihoods cannot be told from a
    retrained model's) with one seed held out as target in turn (shadows: the other seeds' models, retain and
    retain-seed2 as OUT); NaN with fewer than 2 seeds."""
    out = {}
    if len(seeds) < 2:
        return {n: float("nan") for n in names}
    for n in names:
        accs = []
        for t in range(len(seeds)):
            phi_in = np.stack([r["_raw"][n]["loglik"] for r in seeds])
            phi_out = np.stack([r["_raw"][m]["loglik"] for r in seeds for m in ("retain", "retain-seed2")])
            sh_in = np.array([i != t for i in range(len(seeds))])
            sh_out = np.array([i != t for i in range(len(seeds)) for _ in range(2)])
            accs.append(ulira(phi_in, phi_out, sh_in, sh_out, fixed_variance=True).balanced_accuracy)
        out[n] = float(np.mean(accs))
    return out


def summarise(result: dict) -> dict:
    """Means over seeds of every model's headline readouts, the exact engine's pass count and the best approximate
    method (highest mean forget quality at a utility ≥ :data:`UTILITY_FLOOR` × the original's)."""
    seeds = result["seeds"]
    names = list(seeds[0]["models"])
    keys = ["forget_quality", "forget_quality_paraphrase", "model_utility", "forget/rouge", "forget/recall", "extraction_strength",
            "exact_memorisation", *[f"probe/{k}/recall" for k in PROBE_KINDS], *[f"probe/{k}/fq" for k in PROBE_KINDS]]
    mean = {n: {k: float(np.mean([r["models"][n][k] for r in seeds])) for k in keys} for n in names}
    for n in names:
        mean[n]["probes_within"] = int(sum(r["models"][n][f"probe/{k}/within"] for r in seeds for k in PROBE_KINDS))
    approx = [m for m in result["config"]["methods"] if m in mean]
    # the tuning's rule: the highest forget quality among the methods whose utility stays ≥ UTILITY_FLOOR × the
    # original's (all of them when none does)
    ok = [m for m in approx if mean[m]["model_utility"] >= UTILITY_FLOOR * mean["original"]["model_utility"]]
    best = max(ok or approx, key=lambda m: (mean[m]["forget_quality"], mean[m]["model_utility"])) if approx else None
    passes = sum(r["models"]["exact"]["forget_quality"] >= KS_PASS for r in seeds)
    f0 = float(np.mean([r["models"]["retain-seed2"]["forget_quality"] for r in seeds]))
    return {"mean": mean, "best_approximate": best, "exact_passes": int(passes), "n_seeds": len(seeds),
            "retain_vs_retain_fq": f0,
            "request_vs_refinetune": float(np.mean([r["models"]["exact"]["request_vs_refinetune"] for r in seeds])),
            "probes_total": len(seeds) * len(PROBE_KINDS)}


def summary_line(result: dict) -> str:
    """The issue's one-line result (module docstring)."""
    s = result["summary"]
    m = s["mean"]
    best = s["best_approximate"]
    approx = (f"best approximate {best} FQ {m[best]['forget_quality']:.3g}, utility {m[best]['model_utility']:.3f} "
              f"({result['tuning'].get(best, {}).get('budget', 0)} trials)" if best else "best approximate none")
    return (f"tofu: exact FQ {m['exact']['forget_quality']:.3g} (KS p >= {KS_PASS} in {s['exact_passes']}/"
            f"{s['n_seeds']} seeds), utility {m['exact']['model_utility']:.3f} vs ordinary LoRA "
            f"{m['original']['model_utility']:.3f}; {approx}; retain-vs-retain FQ {s['retain_vs_retain_fq']:.3g}; "
            f"request_vs_refinetune {s['request_vs_refinetune']:.2f}")


def exact_retrain(base, tok, data, cfg: TofuConfig, seed: int, models: dict | None = None):
    """The exact route every user has: fine-tune the LoRA again from the pretrained model on the retain people,
    same recipe and seed. Checks that it equals the retain model parameter for parameter (the procedure is
    deterministic on a CPU), and reports that check."""
    model, secs = lora_finetune(base, tok, data, data.retain(cfg.split), cfg, seed)
    same = None
    if models and "retain" in models:
        a, b = dict(model.named_parameters()), dict(models["retain"].named_parameters())
        same = all(torch.equal(a[k], b[k]) for k in a)
    return model, {"engine": "retrain", "request_seconds": secs, "equals_retain_model": same,
                   "request_sample_passes": cfg.finetune_epochs * len(data.questions(data.retain(cfg.split)))}


def person_ids(people, n_per_person: int, shards: int, slices: int, seed: int) -> dict[int, list[int]]:
    """Sample ids that put every pair of a person in one shard and one slice of the sharded engine.

    The engine places a sample by a keyed hash of its id alone (:func:`~scrubnet.mlforget.sharded.assignment`),
    which scatters one person's 20 pairs over every shard: forgetting a person would retrain all of them. So
    the person's place is the engine's place of the *person's* number (``assignment(p)``), and the person's
    ``n_per_person`` sample ids are the first unused integers ≥ (p + 1)·10⁶ that the engine places there.
    Ids stay a function of the person alone, so the deletion stays exact (the run on D ∖ D_f uses the same ids
    for the people it keeps)."""
    out = {}
    for p in people:
        want_shard, want_slice = (int(t[0]) for t in assignment([int(p)], shards, slices, seed))
        ids, cand = [], (int(p) + 1) * 10 ** 6
        while len(ids) < n_per_person:
            block = list(range(cand, cand + 64))
            sh, sl = assignment(block, shards, slices, seed)
            ids += [i for i, a, b in zip(block, sh.tolist(), sl.tolist()) if a == want_shard and b == want_slice]
            cand += 64
        out[int(p)] = ids[:n_per_person]
    return out


class LogitsOf(torch.nn.Module):
    """A model whose call returns ``.logits`` (what the readouts call) from one that returns the logits tensor
    (the sharded engine's ``forward``: the log of the shards' mean probabilities)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        kw = {"attention_mask": attention_mask}
        if position_ids is not None:
            kw["position_ids"] = position_ids
        return dataclasses.make_dataclass("Out", ["logits"])(self.inner(input_ids, **kw))


def exact_sharded(base, tok, data, cfg: TofuConfig, seed: int, models: dict | None = None):
    """The isolated engine (:mod:`scrubnet.mlforget.sharded`): ``cfg.shards`` × ``cfg.slices`` LoRA adapters
    (scrubnet's :class:`~scrubnet.models.lora.LoRA` on every linear map, rank ``cfg.lora_r``) fine-tuned on all
    private people, sharded by person (:func:`person_ids`), then asked to delete the forget people. The model
    answers with the mean of the shards' token probabilities."""
    qa = data.questions(range(data.n_private))
    ids_of = person_ids(range(data.n_private), 20, cfg.shards, cfg.slices, seed)
    counters = {p: 0 for p in ids_of}
    ids = []
    for q in qa:
        ids.append(ids_of[q.person][counters[q.person]])
        counters[q.person] += 1
    batch = encode(tok, [q.question for q in qa], [q.answer for q in qa])
    x = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    lora = LoRA(["c_attn", "c_proj", "c_fc"], rank=cfg.lora_r, alpha=2.0 * cfg.lora_r, seed=seed)
    sm = sharded_finetune(base, x, user_weights=lora, shards=cfg.shards, slices=cfg.slices,
                          epochs=cfg.finetune_epochs, lr=cfg.finetune_lr, batch_size=cfg.batch_size, ids=ids,
                          seed=seed)
    gone = [i for p in data.forget(cfg.split) for i in ids_of[p]]
    data_x, data_y = split_batch(x)
    req = sm.forget(gone, data_x, data_y, row_ids=ids)
    return LogitsOf(sm), {"engine": "sharded", "request_seconds": req["seconds"],
                          "request_sample_passes": req["sample_passes"], "shards_retrained": req["shards_retrained"],
                          "train_sample_passes": sm.train_info.get("sample_passes"), "shards": cfg.shards,
                          "slices": cfg.slices}


EXACT_FUNCTIONS = {"retrain": exact_retrain, "sharded": exact_sharded}
