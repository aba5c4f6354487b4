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
from scrubnet.audit.report import write_audit
from scrubnet.audit.stats import epsilon_score, logit_confidence, ulira
from scrubnet.device import resolve_device
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.experiments.progress import make_progress
from scrubnet.experiments.runner import band_reference, get_split

#: methods whose U-LiRA/ε rows are other pool models, not scrubs
ANCHORS = ("original", "retrain")


#: documented ranges of the pool's size (splits) and of U = R (ε-score models per side), checked on entry
POOL_RANGE = (4, 512)
EPS_MODELS_RANGE = (3, 512)


def default_plan(methods: list[str], pool: int | None = None, eps_models: int | None = None) -> P.PoolPlan:
    """The pool for ``methods``: ``pool`` splits (default 32, ¾ shadows), 2 forget sets per split, and
    U = R = ``eps_models`` (default 32) models for the ε-score.

    ML-Forgetting (``mlforget``, ``mlforget-retrain``) trains its own mixed-linear model for every scrub
    (≈ 2 s on the embedded experiment, one thread, against ≤ 0.25 s for every other method without the
    information readouts), so it runs on 1 forget set per split and U/2 ε-models; the default audit then
    takes a few minutes on 2 cores (README)."""
    S = (4 if tiny_mode() else 32) if pool is None else int(pool)
    if not POOL_RANGE[0] <= S <= POOL_RANGE[1]:
        raise ValueError(f"--pool must lie in [{POOL_RANGE[0]}, {POOL_RANGE[1]}] (U-LiRA needs ≥ 3 shadow splits "
                         f"and a target split; each split trains 5+ models), got {S}")
    slow = {"mlforget", "mlforget-retrain"}
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
        if "retrain" in self.all_methods:
            items += [{"id": f"eps/retrain/{u}", "seed": P.derive(self.audit_seed, f"eps/{u}"),
                       "start_seed": self.seed_split(0), "half": d.halves[0].tolist(),
                       "forget": d.forget[(0, 0)].tolist()} for u in range(self.plan.eps_models["retrain"])]
        return items

    def eps_retrains(self) -> int:
        return max(self.plan.eps_models.values()) if self.plan.eps_models else 0

    def scrub_runs(self) -> list[dict]:
        """One entry per (original, forget set) with the method runs it needs."""
        d, S = self.data, self.plan.splits
        groups: dict[tuple, dict] = {}
        for m in self.all_methods:
            if m in ANCHORS:
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
            runs = [r for r in g["runs"] if not self.cache.has(r["id"], r["options"])]
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

    # ------------------------------------------------------------------ statistics
    def logits(self, model_id: str, method: str | None = None) -> np.ndarray:
        opts = self.options(method) if method is not None and model_id.startswith(("scrub/", "eps/")) \
            and method not in ANCHORS else None
        return self.cache.load(model_id, opts)["logits"].double().numpy()

    def phi_d(self, model_id: str, method: str | None = None) -> np.ndarray:
        n = self.data.n
        return logit_confidence(self.logits(model_id, method)[:n], self.split.y.numpy())

    def _in_id(self, m: str, s: int, f: int) -> str:
        return {"original": f"original/{s}", "retrain": f"retrain/{s}/{f}"}.get(m, f"scrub/{m}/{s}/{f}")

    def _pairs(self, m: str) -> int:
        return self.plan.pairs.get(m, self.plan.pairs.get(self._user_of(m), 1)) if m not in ANCHORS \
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
            ref_pairs = self.plan.forget_sets if ref == "retrain" else self._pairs(ref)
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
        F0 = self.data.forget[(0, 0)]
        retain = np.setdiff1d(self.data.halves[0], F0)
        U = self.plan.eps_models.get(m, 3)
        u_ids = [f"original/0"] * U if m == "original" else [f"eps/{m}/{u}" for u in range(U)]
        r_ids = [f"eps-retrain/{r}" for r in range(self.eps_retrains())]
        phi_u = np.array([self.phi_d(i, m)[F0] for i in u_ids])
        phi_r = np.array([self.phi_d(i)[F0] for i in r_ids])
        acc = {k: (float(np.mean([self._accuracy(i, m, retain, k == "test") for i in u_ids])),
                   float(np.mean([self._accuracy(i, None, retain, k == "test") for i in r_ids])))
               for k in ("retain", "test")}
        res = epsilon_score(phi_u, phi_r, retain_accuracy=acc["retain"], test_accuracy=acc["test"])
        return {"result": res, "accuracy": acc, "U": U, "R": len(r_ids)}

    def results(self) -> dict:
        """audit.json's content (without the configuration)."""
        out: dict = {}
        for m in self.methods:
            phi_in, phi_out, sh_in, sh_out = self.ulira_rows(m)
            u = ulira(phi_in, phi_out, sh_in, sh_out)
            uf = ulira(phi_in, phi_out, sh_in, sh_out, fixed_variance=True)
            e = self.epsilon_rows(m)
            er = e["result"]
            per = []
            F0 = self.data.forget[(0, 0)]
            eps_of = {int(j): float(v) for j, v in zip(F0, er.epsilons)}
            for j in range(self.data.n):
                a, af = u.per_example_accuracy[j], uf.per_example_accuracy[j]
                if np.isfinite(a) or j in eps_of:
                    per.append({"index": j, "label": int(self.split.y[j]),
                                "ulira_accuracy": float(a) if np.isfinite(a) else None,
                                "ulira_accuracy_fixed_variance": float(af) if np.isfinite(af) else None,
                                "epsilon": eps_of.get(j)})
            out[m] = {
                "ulira_balanced_accuracy": u.balanced_accuracy, "ulira_auc": u.auc,
                "ulira_tpr_at_1pct_fpr": u.tpr_at_1pct_fpr, "ulira_tpr_at_01pct_fpr": u.tpr_at_01pct_fpr,
                "ulira_spread": u.spread(),
                "ulira_fixed_variance": {"balanced_accuracy": uf.balanced_accuracy, "auc": uf.auc,
                                         "tpr_at_1pct_fpr": uf.tpr_at_1pct_fpr,
                                         "tpr_at_01pct_fpr": uf.tpr_at_01pct_fpr, "spread": uf.spread()},
                "ulira_models": {"in": int(len(sh_in)), "out": int(len(sh_out)), "in_shadow": int(sh_in.sum()),
                                 "out_shadow": int(sh_out.sum()), "positives": u.n_positive,
                                 "negatives": u.n_negative},
                "ulira_out_reference": band_of(m),
                "ulira_roc": _thin_roc(u.fpr, u.tpr),
                "epsilon_forget_score": er.forget_score, "epsilon_score": er.score,
                "epsilon_models": {"unlearned": e["U"], "retrained": e["R"], "buckets_for": er.num_models},
                "epsilon_accuracy": {"retain": list(e["accuracy"]["retain"]), "test": list(e["accuracy"]["test"])},
                "epsilon_median": float(np.median(er.epsilons)),
                "seconds_per_model": float(np.mean(self.times[m])) if self.times.get(m) else None,
                "per_example": per,
            }
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
              console=None) -> dict:
    """Fill the pool (cache under ``out_dir/cache``), compute the statistics, write audit.json, audit.md and
    the figures; returns the audit.json content."""
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    audit = Audit(cfg, methods, plan, out_dir / "cache", audit_seed=audit_seed, threads=threads, device=device)
    with make_progress(enabled=progress, console=console) as bar:
        task = bar.add_task("scrubnet audit: models", total=audit.total_models())
        audit.run(engine, bar, task)
    results = {"config": {**cfg.to_dict(), "audit": {"seed": audit.audit_seed, "plan": plan.to_dict(),
                                                    "engine": getattr(engine, "name", "local"),
                                                    "device": device,
                                                    "n_pool": audit.data.n,
                                                    "forget_set_size": int(len(audit.data.forget[(0, 0)]))}},
               "methods": audit.results()}
    results["seconds"] = time.perf_counter() - t0
    write_audit(results, out_dir)
    return results
