"""Run an audit: fill the pool through an engine (cached, resumable), then U-LiRA and the ε-score per method.

U-LiRA rows for method m (positions j in D):

* IN  — ``scrub/m/s/f`` (``original/s`` for m = original, ``retrain/s/f`` for m = retrain) at the j in F_{s,f};
* OUT — the reference family at the j never trained on (j ∉ T_s): ``retrain/s/f`` for every method judged
  against retraining, the scrubs of the band reference for the others (``mlforget`` against
  ``mlforget-retrain``, as in ``scrubnet run``);
* shadows = splits s < ``shadow_splits``, targets = the rest.

ε-score for m: φ on F_{0,0} under ``eps/m/u`` (u < U_m) against ``eps-retrain/r`` (r < R); accuracies on
T_0 \\ F_{0,0} (retain) and D_test, averaged over the models.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from scrubnet._config import tiny_mode
from scrubnet.audit import pool as P
from scrubnet.audit.engine import LocalEngine
from scrubnet.audit.report import game_power, write_audit
from scrubnet.audit.reference import roc_metrics_reference, roc_reference, ulira_game_reference
from scrubnet.audit.stats import (epsilon_score, example_epsilons, forget_score, klom, lira_pairs, logit_confidence,
                                  retain_leakage, ulira)
from scrubnet.audit.uncertainty import (BOOTSTRAP_EPSILON, BOOTSTRAP_KLOM, BOOTSTRAP_PAIRS, bootstrap_pairs,
                                        centered_ci95, difference_ci, pair_statistics, summarize)
from scrubnet.device import resolve_device
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.runner import band_reference, get_split
from scrubnet.methods.base import anchor_method, method_class
from scrubnet.readouts.standard import avg_gap, metrics_from_logits

def own_family(method: str) -> bool:
    """Whether ``method`` trains its own model family (``own_retrain_family`` trait: ML-Forgetting), so that its
    "before" is that family's original, not the pool's original."""
    cls = method_class(method)
    return bool(cls is not None and cls.own_retrain_family)


def anchor_role(method: str) -> str | None:
    """``"original"`` or ``"retrain"`` for an anchor method (its U-LiRA/ε rows are the pool's own originals or
    retrains, not scrubs: the class's ``anchor`` trait), None for a scrub."""
    cls = method_class(method)
    return None if cls is None else cls.anchor


#: documented ranges of the pool's size (splits) and of U = R (ε-score models per side), checked on entry
POOL_RANGE = (4, 512)
EPS_MODELS_RANGE = (3, 512)


def default_plan(methods: list[str], pool: int | None = None, eps_models: int | None = None) -> P.PoolPlan:
    """The pool for ``methods``: ``pool`` splits (default 32, ¾ shadows), 2 forget sets per split, and
    U = R = ``eps_models`` (default 32) models for the ε-score.

    A method whose ``audit_scrub_cost`` trait is ``"expensive"`` — ML-Forgetting (``mlforget``,
    ``mlforget-retrain``), which trains its own mixed-linear model for every scrub
    (≈ 2 s on the embedded experiment, one thread, against ≤ 0.25 s for every other method without the
    information readouts), so it runs on 1 forget set per split and U/2 ε-models; the default audit then
    takes a few minutes on 2 cores (README)."""
    S = (4 if tiny_mode() else 32) if pool is None else int(pool)
    if not POOL_RANGE[0] <= S <= POOL_RANGE[1]:
        raise ValueError(f"--pool must lie in [{POOL_RANGE[0]}, {POOL_RANGE[1]}] (U-LiRA needs ≥ 3 shadow splits "
                         f"and a target split; each split trains 5+ models), got {S}")
    slow = {m for m in methods if method_class(m) is not None and method_class(m).audit_scrub_cost == "expensive"}
    U = (3 if tiny_mode() else 32) if eps_models is None else int(eps_models)
    if not EPS_MODELS_RANGE[0] <= U <= EPS_MODELS_RANGE[1]:
        raise ValueError(f"--eps-models must lie in [{EPS_MODELS_RANGE[0]}, {EPS_MODELS_RANGE[1]}] (the ε-score "
                         f"needs at least 3 models per side), got {U}")
    pairs = {m: (1 if m in slow else 2) for m in methods}
    eps = {m: (max(3, U // 2) if m in slow else U) for m in methods}
    return P.PoolPlan(splits=S, forget_sets=2, shadow_splits=max(1, (3 * S) // 4), pairs=pairs, eps_models=eps)


def band_of(method: str) -> str:
    return band_reference(method)


class Audit:
    """One audit: the pool's models (cached under ``cache_dir``) and the statistics."""

    def __init__(self, cfg: ExperimentConfig, methods: list[str], plan: P.PoolPlan, cache_dir: Path,
                 audit_seed: int | None = None, threads: int = 1, device: str = "cpu"):
        self.cfg, self.methods, self.plan = cfg, list(methods), plan
        self.audit_seed = int(cfg.seeds[0] if audit_seed is None else audit_seed)
        self.split = get_split(cfg)
        self.data = P.build_pool_data(cfg, self.split, self.audit_seed, plan.splits, plan.forget_sets)
        exp = cfg.to_dict()
        base = {"v": P.POOL_VERSION, "data": exp["data"], "train": exp["train"], "model": exp["model"],
                "model_options": exp["model_options"], "retrain_mode": exp["retrain_mode"],
                "audit_seed": self.audit_seed, "device": str(resolve_device(device))}
        self.cache = P.Cache(cache_dir, base)
        self.shared = {"config": cfg.to_dict(), "pretrain_seed": P.derive(self.audit_seed, "pretrain"),
                       "threads": int(threads), "device": device}
        self.times: dict[str, list[float]] = {}
        self._phi: dict[tuple, np.ndarray] = {}
        needed = set(methods) | {band_of(m) for m in methods}
        self.all_methods = list(methods) + sorted(needed - set(methods))

    # ------------------------------------------------------------------ plan of models
    def options(self, method: str) -> dict:
        return dict(self.cfg.method_options.get(method, {}))

    def seed_split(self, s: int) -> int:
        return P.derive(self.audit_seed, f"split/{s}")

    def train_items(self) -> list[dict]:
        d, S, F = self.data, self.plan.splits, self.plan.forget_sets
        items = [{"id": f"original/{s}", "seed": self.seed_split(s), "start_seed": self.seed_split(s),
                  "half": d.halves[s].tolist(), "forget": None, "keep_weights": True} for s in range(S)]
        items += [{"id": f"retrain/{s}/{f}", "seed": self.seed_split(s), "start_seed": self.seed_split(s),
                   "half": d.halves[s].tolist(), "forget": d.forget[(s, f)].tolist()}
                  for s in range(S) for f in range(F)]
        R = self.eps_retrains()
        items += [{"id": f"eps-retrain/{r}", "seed": P.derive(self.audit_seed, f"eps-retrain/{r}"),
                   "start_seed": self.seed_split(0), "half": d.halves[0].tolist(),
                   "forget": d.forget[(0, 0)].tolist()} for r in range(R)]
        for m in (x for x in self.all_methods if anchor_role(x) == "retrain"):
            items += [{"id": f"eps/{m}/{u}", "seed": P.derive(self.audit_seed, f"eps/{u}"),
                       "start_seed": self.seed_split(0), "half": d.halves[0].tolist(),
                       "forget": d.forget[(0, 0)].tolist()} for u in range(self.plan.eps_models[m])]
        return items

    def eps_retrains(self) -> int:
        return max(self.plan.eps_models.values()) if self.plan.eps_models else 0

    def scrub_runs(self) -> list[dict]:
        """One entry per (original, forget set) with the method runs it needs."""
        d, S = self.data, self.plan.splits
        groups: dict[tuple, dict] = {}
        for m in self.all_methods:
            if anchor_role(m) is not None:
                continue
            for s in range(S):
                for f in range(self.plan.pairs.get(m, self.plan.pairs.get(self._user_of(m), 1))):
                    g = groups.setdefault((s, f), {"s": s, "f": f, "forget": d.forget[(s, f)].tolist(), "runs": []})
                    g["runs"].append({"id": f"scrub/{m}/{s}/{f}", "method": m, "options": self.options(m),
                                      "seed": self.seed_split(s)})
            if m not in self.methods:
                continue  # a band reference only: needed for U-LiRA's OUT rows, not scored itself
            for u in range(self.plan.eps_models.get(m, 3)):
                g = groups.setdefault(("eps", u), {"s": 0, "f": 0, "forget": d.forget[(0, 0)].tolist(), "runs": []})
                g["runs"].append({"id": f"eps/{m}/{u}", "method": m, "options": self.options(m),
                                  "seed": P.derive(self.audit_seed, f"eps/{u}")})
        return list(groups.values())

    def _user_of(self, ref: str) -> str:
        """The audited method whose band reference is ``ref`` (sizes a reference-only method's pool)."""
        for m in self.methods:
            if band_of(m) == ref:
                return m
        return ref

    def total_models(self) -> int:
        return len(self.train_items()) + sum(len(g["runs"]) for g in self.scrub_runs())

    # ------------------------------------------------------------------ execution
    def run(self, engine=None, progress=None, task=None) -> None:
        """Train every model not yet in the cache (originals and retrains first, then the scrubs)."""
        engine = engine or LocalEngine()
        adv = (lambda k=1: progress.advance(task, k)) if progress is not None else (lambda k=1: None)
        if self.cache.has("pretrain"):
            pre = self.cache.load("pretrain")
        else:
            _, pre = next(iter(engine.map(P.pretrain_task, self.shared, [None])))
            self.cache.save("pretrain", pre)
        self.shared["pretrained"] = {k: v for k, v in pre.items()}
        todo = [it for it in self.train_items() if not self.cache.has(it["id"])]
        adv(len(self.train_items()) - len(todo))
        B = self.plan.models_per_task
        batches = [todo[i:i + B] for i in range(0, len(todo), B)]
        for _, res in engine.map(P.train_task, self.shared, batches):
            for mid, tensors, dt in res:
                self.cache.save(mid, tensors, meta={"seconds": dt})
                self.times.setdefault(mid.split("/")[0], []).append(dt)
            adv(len(res))
        payloads = []
        for g in self.scrub_runs():
            runs = [r for r in g["runs"] if not self.cache.has(r["id"], r["options"], self._required(r))]
            adv(len(g["runs"]) - len(runs))
            if not runs:
                continue
            orig = self.cache.load(f"original/{g['s']}")
            payloads.append({"original": {k[2:]: v for k, v in orig.items() if k.startswith("w:")},
                             "start_seed": self.seed_split(g["s"]), "half": self.data.halves[g["s"]].tolist(),
                             "forget": g["forget"], "runs": runs})
        opts = {r["id"]: r["options"] for p in payloads for r in p["runs"]}
        for _, res in engine.map(P.scrub_task, self.shared, payloads):
            for mid, tensors, dt in res:
                self.cache.save(mid, tensors, opts[mid], meta={"seconds": dt})
                self.times.setdefault(mid.split("/")[1], []).append(dt)
            adv(len(res))

    @staticmethod
    def _required(run: dict) -> tuple[str, ...]:
        """Tensors a cached scrub must hold: an own-family method's scrubs also keep their family's original."""
        return ("original_logits",) if run["id"].startswith("scrub/") and own_family(run["method"]) else ()

    # ------------------------------------------------------------------ statistics
    def logits(self, model_id: str, method: str | None = None, field: str = "logits") -> np.ndarray:
        """Logits ``[n + n_test, c]`` of a cached model (``field="original_logits"``: of the own-family original
        stored with a scrub)."""
        opts = self.options(method) if method is not None and model_id.startswith(("scrub/", "eps/")) \
            and anchor_role(method) is None else None
        return self.cache.load(model_id, opts)[field].double().numpy()

    def phi_d(self, model_id: str, method: str | None = None, field: str = "logits") -> np.ndarray:
        """φ on D ``[n]`` (kept in memory: the statistics read every model several times)."""
        return self.phi_all(model_id, method, field)[:self.data.n]

    def _in_id(self, m: str, s: int, f: int) -> str:
        return {"original": f"original/{s}", "retrain": f"retrain/{s}/{f}"}.get(anchor_role(m), f"scrub/{m}/{s}/{f}")

    def _pairs(self, m: str) -> int:
        return self.plan.pairs.get(m, self.plan.pairs.get(self._user_of(m), 1)) if anchor_role(m) is None \
            else self.plan.forget_sets

    def ulira_rows(self, m: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n, S = self.data.n, self.plan.splits
        ref = band_of(m)
        rows_in, sh_in, rows_out, sh_out = [], [], [], []
        for s in range(S):
            trained = np.zeros(n, bool)
            trained[self.data.halves[s]] = True
            for f in range(self._pairs(m)):
                phi = self.phi_d(self._in_id(m, s, f), m)
                mask = np.zeros(n, bool)
                mask[self.data.forget[(s, f)]] = True
                rows_in.append(np.where(mask, phi, np.nan))
                sh_in.append(s < self.plan.shadow_splits)
            ref_pairs = self.plan.forget_sets if anchor_role(ref) == "retrain" else self._pairs(ref)
            for f in range(ref_pairs):
                phi = self.phi_d(self._in_id(ref, s, f), ref)
                rows_out.append(np.where(~trained, phi, np.nan))
                sh_out.append(s < self.plan.shadow_splits)
        return np.array(rows_in), np.array(rows_out), np.array(sh_in), np.array(sh_out)

    def _accuracy(self, model_id: str, method: str | None, idx: np.ndarray, test: bool) -> float:
        lg = self.logits(model_id, method)
        n = self.data.n
        if test:
            return float((lg[n:].argmax(1) == self.split.y_test.numpy()).mean())
        return float((lg[:n][idx].argmax(1) == self.split.y.numpy()[idx]).mean())

    def epsilon_rows(self, m: str) -> dict:
        """φ on F_{0,0} (and on the retain part of T_0 and on D_test, for KLoM) under U models of the method and
        U = R retrains (the first U of ``eps-retrain``: both scales equal on every row)."""
        F0 = self.data.forget[(0, 0)]
        retain = np.setdiff1d(self.data.halves[0], F0)
        U = self.plan.eps_models.get(m, 3)
        u_ids = ["original/0"] * U if anchor_role(m) == "original" else [f"eps/{m}/{u}" for u in range(U)]
        r_ids = [f"eps-retrain/{r}" for r in range(U)]
        phi_u = np.array([self.phi_all(i, m) for i in u_ids])
        phi_r = np.array([self.phi_all(i) for i in r_ids])
        acc = {k: (float(np.mean([self._accuracy(i, m, retain, k == "test") for i in u_ids])),
                   float(np.mean([self._accuracy(i, None, retain, k == "test") for i in r_ids])))
               for k in ("retain", "test")}
        res = epsilon_score(phi_u[:, F0], phi_r[:, F0], retain_accuracy=acc["retain"], test_accuracy=acc["test"])
        n = self.data.n
        points = {"forget": F0, "retain": retain, "validation": n + np.arange(len(self.split.y_test))}
        return {"result": res, "accuracy": acc, "U": U, "R": len(r_ids), "phi_u": phi_u, "phi_r": phi_r,
                "points": points}

    def phi_all(self, model_id: str, method: str | None = None, field: str = "logits") -> np.ndarray:
        """φ on D followed by D_test ``[n + n_test]`` (memoised per model, method and stored field)."""
        key = (model_id, method, field)
        if key not in self._phi:
            y = np.concatenate([self.split.y.numpy(), self.split.y_test.numpy()])
            self._phi[key] = logit_confidence(self.logits(model_id, method, field), y)
        return self._phi[key]

    # ------------------------------------------------------------------ the U-MIA game and LiRA rows
    def _rows(self, ids: list[tuple], in_masks: list[np.ndarray],
              out_masks: list[np.ndarray]) -> tuple:
        """IN and OUT φ matrices (NaN outside the masks), shadow flags and clusters (= target split index)."""
        phis = [self.phi_d(*t[1:]) for t in ids]  # (split, model id, method[, stored field])
        phi_in = np.array([np.where(k, p, np.nan) for p, k in zip(phis, in_masks)])
        phi_out = np.array([np.where(k, p, np.nan) for p, k in zip(phis, out_masks)])
        sh = np.array([t[0] < self.plan.shadow_splits for t in ids])
        cl = np.array([t[0] - self.plan.shadow_splits for t in ids])
        return phi_in, phi_out, sh, cl

    def _mask(self, idx: np.ndarray) -> np.ndarray:
        m = np.zeros(self.data.n, bool)
        m[idx] = True
        return m

    def game_rows(self, m: str) -> tuple:
        """The U-MIA game: every model is one of the method's unlearned models (s, f); IN = its forget set
        F_{s,f}, OUT = the examples its split never trained on. ``original`` is plain LiRA: IN = T_s, each
        original once."""
        ids, ins, outs = [], [], []
        for s in range(self.plan.splits):
            never = ~self._mask(self.data.halves[s])
            if anchor_role(m) == "original":
                ids.append((s, f"original/{s}", m))
                ins.append(~never)
                outs.append(never)
                continue
            for f in range(self._pairs(m)):
                ids.append((s, self._in_id(m, s, f), m))
                ins.append(self._mask(self.data.forget[(s, f)]))
                outs.append(never)
        return self._rows(ids, ins, outs)

    def retained(self, s: int) -> np.ndarray:
        """R_s = T_s minus every forget set of split s (retained by every model of the split), as a mask."""
        keep = self._mask(self.data.halves[s])
        for f in range(self.plan.forget_sets):
            keep[self.data.forget[(s, f)]] = False
        return keep

    def retain_rows(self, m: str, f: int = 0, before: bool = False) -> tuple:
        """Per-example LiRA rows on retained examples, **one model per split**: IN = R_s, OUT = never trained on,
        under the method's model of forget set ``f`` (the original for ``original``). ``before=True``: the model
        the method started from — the original, or for a method that trains its own family (ML-Forgetting) that
        family's original, stored with its scrub of (s, 0)."""
        ids, ins, outs = [], [], []
        for s in range(self.plan.splits):
            if before and own_family(m):
                ids.append((s, self._in_id(m, s, 0), m, "original_logits"))
            elif before or anchor_role(m) == "original":
                ids.append((s, f"original/{s}", None))
            else:
                ids.append((s, self._in_id(m, s, f), m))
            ins.append(self.retained(s))
            outs.append(~self._mask(self.data.halves[s]))
        return self._rows(ids, ins, outs)

    def retain_leakage(self, m: str, replicates: int, seed: int) -> dict:
        """:func:`retain_leakage` of ``m``: its models of each forget set (one per split) against the model it
        started from (one per split)."""
        fs = [0] if anchor_role(m) == "original" else list(range(self._pairs(m)))
        return retain_leakage(self.retain_rows(m, before=True), [self.retain_rows(m, f) for f in fs],
                              self.plan.splits - self.plan.shadow_splits, self.data.n, replicates, seed)

    def pool_fit(self) -> dict:
        """How many trained pool models ended with the stopping rule met / at zero training error."""
        out: dict = {}
        for it in self.train_items():
            t = self.cache.load(it["id"])
            if "fit:met" not in t:
                continue
            kind = it["id"].split("/")[0]
            d = out.setdefault(kind, {"models": 0, "rule_not_met": 0, "above_zero_error": 0, "max_final_error": 0.0})
            d["models"] += 1
            d["rule_not_met"] += int(int(t["fit:met"]) == 0)
            err = float(t["fit:final_error"])
            d["above_zero_error"] += int(err > 0)
            d["max_final_error"] = max(d["max_final_error"], err)
        return out

    def results(self, replicates: int = BOOTSTRAP_PAIRS, seed: int | None = None) -> dict:
        """audit.json's ``methods`` content (without the configuration) and the pairwise comparisons."""
        seed = self.audit_seed if seed is None else int(seed)
        n, C = self.data.n, self.plan.splits - self.plan.shadow_splits
        out: dict = {}
        reps: dict[str, dict] = {}
        for m in self.methods:
            d: dict = {}
            # --- the U-MIA game (default statistic)
            phi_in, phi_out, sh, cl = self.game_rows(m)
            p, _ = lira_pairs(phi_in, phi_out, sh, sh, cl, cl)
            r = bootstrap_pairs(p, C, n, replicates, seed)
            reps[m] = r
            g = summarize(p, r)
            d.update({f"ulira_game_{k}": v for k, v in g.items()})
            u = ulira(phi_in, phi_out, sh, sh)
            d["ulira_game_spread"] = u.spread()
            d["ulira_game_roc"] = _thin_roc(u.fpr, u.tpr)
            d["ulira_game_models"] = {"rows": int(len(sh)), "shadow": int(sh.sum()), "target": int((~sh).sum())}
            # the same game under the references' estimators (the measured effect of each choice)
            pr, _ = lira_pairs(phi_in, phi_out, sh, sh, cl, cl, estimator="reference")
            fpr_r, tpr_r = roc_reference(pr.label, pr.score)
            rm = roc_metrics_reference(fpr_r, tpr_r)
            d["ulira_game_estimators"] = {
                "default": g["balanced_accuracy"],
                "default_best_threshold": float(np.max(1 - (u.fpr + (1 - u.tpr)) / 2)),
                "fixed_variance": ulira(phi_in, phi_out, sh, sh, fixed_variance=True).balanced_accuracy,
                "lira_reference": rm["acc"], "lira_reference_at_ratio_1": float(pair_statistics(pr)["balanced_accuracy"][0]),
                "lira_reference_auc": rm["auc"], "deepunlearn": self._deepunlearn_accuracy(m)}
            # --- today's statistic: OUT from retrained models (distance to retraining)
            ri, ro, rsi, rso = self.ulira_rows(m)
            clr_i = np.repeat(np.arange(self.plan.splits), len(rsi) // self.plan.splits) - self.plan.shadow_splits
            clr_o = np.repeat(np.arange(self.plan.splits), len(rso) // self.plan.splits) - self.plan.shadow_splits
            pr2, _ = lira_pairs(ri, ro, rsi, rso, clr_i, clr_o)
            r2 = bootstrap_pairs(pr2, C, n, replicates, seed)
            d.update({f"ulira_retrain_out_{k}": v for k, v in summarize(pr2, r2).items()})
            d["ulira_retrain_out_reference"] = band_of(m)
            # --- retain-set leakage: LiRA on retained examples, after the method minus before (what it started from)
            lk = self.retain_leakage(m, replicates, seed)
            d["retain_leakage"], d["retain_leakage_ci95"] = lk["leakage"], lk["ci95"]
            d["retain_lira_balanced_accuracy"] = lk["after"]
            d["retain_lira_balanced_accuracy_original"] = lk["before"]
            d["retain_leakage_before"] = "own_family_original" if own_family(m) else "original"
            # --- ε-score (U = R) and KLoM on the ε pool
            e = self.epsilon_rows(m)
            er = e["result"]
            F0 = e["points"]["forget"]
            d.update({"epsilon_forget_score": er.forget_score, "epsilon_score": er.score,
                      "epsilon_u": e["U"], "epsilon_r": e["R"], "epsilon_buckets_for": er.num_models,
                      "epsilon_accuracy": {"retain": list(e["accuracy"]["retain"]), "test": list(e["accuracy"]["test"])},
                      "epsilon_median": float(np.median(er.epsilons))})
            eps_reps = epsilon_bootstrap(e["phi_u"][:, F0], e["phi_r"][:, F0], er.epsilons, er.num_models,
                                         BOOTSTRAP_EPSILON, seed)
            d["epsilon_forget_score_ci95"] = centered_ci95(eps_reps, er.forget_score)
            kl, kl_ref, kr, kl_forget_vals = klom_rows(e["phi_u"], e["phi_r"], e["points"], seed)
            reps[m]["klom_forget"] = kr
            d["klom_forget"] = kl["forget"]["mean"]
            d["klom_forget_ci95"] = kl["forget"]["mean_ci95"]
            d["klom"] = kl
            d["klom_reference"] = kl_ref  # mean over the examples where the benchmark's code is not NaN
            d["standard"] = self.standard(m)
            d["seconds_per_model"] = float(np.mean(self.times[m])) if self.times.get(m) else None
            d["per_example"] = self._per_example(u.per_example_accuracy, F0, er.epsilons, kl_forget_vals)
            out[m] = d
        return {"methods": out, "comparisons": _comparisons(reps)}

    def _per_example(self, game_accuracy: np.ndarray, forget_idx, epsilons, klom_vals) -> list[dict]:
        """audit.json's ``per_example`` rows: each example with a finite U-MIA game accuracy (over the ``n``
        examples) or an ε-score (``epsilons`` and ``klom_vals`` over the forget examples ``forget_idx``)."""
        eps_of = {int(j): float(v) for j, v in zip(forget_idx, epsilons)}
        kl_of = {int(j): float(v) for j, v in zip(forget_idx, klom_vals)}
        per = []
        for j in range(self.data.n):
            a = game_accuracy[j]
            if np.isfinite(a) or j in eps_of:
                per.append({"index": j, "label": int(self.split.y[j]),
                            "ulira_game_accuracy": float(a) if np.isfinite(a) else None,
                            "epsilon": eps_of.get(j), "klom": kl_of.get(j)})
        return per

    def standard(self, m: str) -> dict:
        """The field's standard metrics of ``m`` (UA, RA, TA, MIA-efficacy; fractions) on every (split,
        forget set) of its pool, and Avg. Gap to the retrain model of the same pair, averaged over the pairs."""
        n, y, yt = self.data.n, self.split.y.numpy(), self.split.y_test.numpy()
        rows = []
        for s in range(self.plan.splits):
            for f in range(self._pairs(m)):
                F0 = self.data.forget[(s, f)]
                R0 = np.setdiff1d(self.data.halves[s], F0)

                def metrics(model_id, method):
                    lg = self.logits(model_id, method)
                    return metrics_from_logits((lg[:n][R0], y[R0]), (lg[:n][F0], y[F0]), (lg[n:], yt),
                                               seed=self.audit_seed)
                mine, ret = metrics(self._in_id(m, s, f), m), metrics(f"retrain/{s}/{f}", None)
                rows.append({**mine.as_dict(), "avg_gap": avg_gap(mine, ret)})
        out = {k: float(np.mean([r[k] for r in rows])) for k in ("ua", "ra", "ta", "mia_efficacy", "avg_gap")}
        out["mia_degenerate"] = int(sum(r["mia_degenerate"] for r in rows))
        out["pairs"] = len(rows)
        return out

    def _deepunlearn_accuracy(self, m: str) -> float | None:
        """Mean over examples of DeepUnlearn's per-example accuracy (p > 0.5) on all splits (no shadow/target
        split), for methods run on every forget set (the game needs one model per (s, f))."""
        S = self.plan.splits
        F = 1 if anchor_role(m) == "original" else self._pairs(m)
        phi = np.array([[self.phi_d(f"original/{s}" if anchor_role(m) == "original" else self._in_id(m, s, f), m)
                         for f in range(F)] for s in range(S)])
        train = np.array([self._mask(self.data.halves[s]) for s in range(S)])
        forget = np.array([[train[s] if anchor_role(m) == "original" else self._mask(self.data.forget[(s, f)])
                            for f in range(F)] for s in range(S)])
        a = ulira_game_reference(phi, train, forget).acc_balanced
        a = a[np.isfinite(a)]
        return float(a.mean()) if a.size else None


def _comparisons(reps: dict[str, dict]) -> dict:
    """For each pair of methods and each of the game's balanced accuracy and KLoM on the forget set: the
    difference's 95 % interval over common bootstrap replicates, and whether it excludes 0."""
    out: dict = {}
    ms = list(reps)
    for key in ("balanced_accuracy", "klom_forget"):
        rows = []
        for i, a in enumerate(ms):
            for b in ms[i + 1:]:
                ci = difference_ci(reps[a][key], reps[b][key])
                rows.append({"a": a, "b": b, "difference_ci95": ci,
                             "distinguishable": bool(ci is not None and (ci[0] > 0 or ci[1] < 0))})
        out["ulira_game_balanced_accuracy" if key == "balanced_accuracy" else key] = rows
    return out


def klom_rows(phi_u: np.ndarray, phi_r: np.ndarray, points: dict[str, np.ndarray], seed: int) -> tuple:
    """KLoM of the ε pool on each set of points, and beside it the benchmark's code (``mode="reference"``).

    Parameters
    ----------
    phi_u, phi_r : array ``[U, n + n_test]``, ``[R, n + n_test]``
        Margins of the unlearned and of the retrained models.
    points : dict name → index array
        The point sets (forget, retain, validation).
    seed : int
        Bootstrap seed.

    Returns
    -------
    (dict, dict, array, array)
        Per set {mean, mean_ci95, p95, points}; per set the reference mode's {mean over its non-NaN examples,
        nan count, max |reference − default|}; the forget set's replicates re-centred on its mean (as its
        interval); the forget set's per-example values (nats)."""
    kl, kl_ref, kr_forget, forget_vals = {}, {}, None, None
    for name, idx in points.items():
        vals = klom(phi_u[:, idx], phi_r[:, idx])
        ref = klom(phi_u[:, idx], phi_r[:, idx], mode="reference")
        ok = np.isfinite(ref)
        kl_ref[name] = {"mean": float(ref[ok].mean()) if ok.any() else None, "nan": int((~ok).sum()),
                        "max_abs_difference": float(np.abs(ref - vals)[ok].max()) if ok.any() else None}
        kr = klom_bootstrap(phi_u[:, idx], phi_r[:, idx], BOOTSTRAP_KLOM, seed)
        kl[name] = {"mean": float(vals.mean()), "mean_ci95": centered_ci95(kr, float(vals.mean())),
                    "p95": float(np.percentile(vals, 95)), "points": int(len(idx))}
        if name == "forget":
            kr_forget, forget_vals = kr - kr.mean() + vals.mean(), vals
    return kl, kl_ref, kr_forget, forget_vals


def epsilon_bootstrap(phi_u: np.ndarray, phi_r: np.ndarray, eps: np.ndarray, num_models: int, replicates: int,
                      seed: int) -> np.ndarray:
    """Replicates of the ε forget score: unlearned and retrained models and forget examples drawn with
    replacement (ε recomputed per replicate; a point-mass method stays a point mass and keeps its score)."""
    rng = np.random.default_rng([seed, 1])
    U, R, n = phi_u.shape[0], phi_r.shape[0], phi_u.shape[1]
    constant = bool(np.all(phi_u == phi_u[0]))
    out = np.empty(replicates)
    for b in range(replicates):
        ex = rng.integers(0, n, n)
        if constant:
            e = eps[ex]
        else:
            iu, ir = rng.integers(0, U, U), rng.integers(0, R, R)
            cols = np.unique(ex)
            e_cols = dict(zip(cols, example_epsilons(phi_u[iu][:, cols], phi_r[ir][:, cols])))
            e = np.array([e_cols[j] for j in ex])
        out[b] = forget_score(e, num_models)
    return out


def klom_bootstrap(phi_u: np.ndarray, phi_r: np.ndarray, replicates: int, seed: int) -> np.ndarray:
    """Replicates of the mean KLoM: models of both ensembles and points drawn with replacement."""
    rng = np.random.default_rng([seed, 2])
    U, R, n = phi_u.shape[0], phi_r.shape[0], phi_u.shape[1]
    out = np.empty(replicates)
    for b in range(replicates):
        wu = np.bincount(rng.integers(0, U, U), minlength=U)
        wr = np.bincount(rng.integers(0, R, R), minlength=R)
        ex = rng.integers(0, n, n)
        out[b] = float(klom(phi_u[:, ex], phi_r[:, ex], weights_unlearned=wu, weights_oracle=wr).mean())
    return out


def _thin_roc(fpr: np.ndarray, tpr: np.ndarray, points: int = 400) -> dict:
    """The ROC on ≤ ``points`` log-spaced FPR values (for the figure), as lists."""
    if len(fpr) <= points:
        return {"fpr": fpr.tolist(), "tpr": tpr.tolist()}
    grid = np.unique(np.concatenate([[0.0], np.logspace(-5, 0, points)]))
    idx = np.searchsorted(fpr, grid, "right") - 1
    return {"fpr": grid.tolist(), "tpr": np.maximum.accumulate(tpr)[np.clip(idx, 0, None)].tolist()}


def run_audit(cfg: ExperimentConfig, methods: list[str], out_dir: Path, *, plan: P.PoolPlan, engine=None,
              audit_seed: int | None = None, threads: int = 1, device: str = "cpu", progress: bool = True,
              console=None, user_methods: list[str] | None = None) -> dict:
    """Fill the pool (cache under ``out_dir/cache``), compute the statistics, write audit.json, audit.md and
    the figures; returns the audit.json content."""
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    audit = Audit(cfg, methods, plan, out_dir / "cache", audit_seed=audit_seed, threads=threads, device=device)
    audit.shared["user_methods"] = list(user_methods or [])  # ``module:Class`` specs, registered on each worker
    with make_progress(enabled=progress, console=console) as bar:
        task = bar.add_task("scrubnet audit: models", total=audit.total_models())
        audit.run(engine, bar, task)
    results = {"config": {**cfg.to_dict(), "audit": {"seed": audit.audit_seed, "plan": plan.to_dict(),
                                                    "engine": getattr(engine, "name", "local"),
                                                    "device": device,
                                                    "n_pool": audit.data.n,
                                                    "forget_set_size": int(len(audit.data.forget[(0, 0)]))}},
               **audit.results(), "pool_fit": audit.pool_fit()}
    results["power"] = game_power(results, anchor_method("original"), anchor_method("retrain"))
    results["seconds"] = time.perf_counter() - t0
    write_audit(results, out_dir)
    return results
