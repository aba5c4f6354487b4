"""Write a demo pool in the ``scrubnet-audit-logits/1`` format (README, "Per-example audits"): 16 splits × 2
forget sets of a synthetic 3-class problem, where unlearning leaves a small trace on the forgotten examples.

    python examples/audit_logits_demo.py runs/demo-logits.npz
    scrubnet audit --logits runs/demo-logits.npz --out runs/audit-files
"""
import sys
from pathlib import Path

import numpy as np

from scrubnet.audit.logits_file import write_logits_file


def main(path: str) -> None:
    rng = np.random.default_rng(0)
    S, F, n, c = 16, 2, 200, 3
    labels = rng.integers(0, c, n)
    easy = rng.normal(1.0, 1.0, n)                      # how easy each example is
    M = S * F
    trained, unlearned = np.zeros((M, n), bool), np.zeros((M, n), bool)
    for s in range(S):
        half = rng.permutation(n)[: n // 2]
        for f in range(F):
            trained[s * F + f, half] = True
            unlearned[s * F + f, rng.choice(half, 20, replace=False)] = True
    logits = rng.normal(0.0, 1.0, (M, n, c))
    boost = easy[None, :] + 1.5 * (trained & ~unlearned) + 1.0 * unlearned   # the trace: +1 on forgotten
    logits[np.arange(M)[:, None], np.arange(n)[None, :], labels[None, :]] += boost
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_logits_file(Path(path), logits=logits, labels=labels, trained=trained, unlearned=unlearned,
                      split=np.repeat(np.arange(S), F), method="demo")
    print(f"wrote {path}: {M} models, {n} examples, {c} classes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo-logits.npz")
