import math

import numpy as np
import pytest
import torch
from torch import nn

from scrubnet.readouts.basic import activation_l1, entropy, error_and_loss
from scrubnet.readouts.mia import membership_attack, membership_attack_from_entropies
from scrubnet.readouts.relearn import relearn_time


class FixedLogits(nn.Module):
    """Returns a fixed logit row per input index (x holds the index)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(torch.as_tensor(logits, dtype=torch.float32))

    def forward(self, x):
        return self.logits[x[:, 0].long()]


def test_error_and_loss_hand_computed():
    m = FixedLogits([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = torch.tensor([[0.0], [1.0], [2.0]])
    y = torch.tensor([0, 0, 1])
    err, loss = error_and_loss(m, x, y)
    # predictions: 0, 1, 0 (tie → first) ; wrong on samples 1 and 2
    assert err == pytest.approx(2 / 3)
    l0 = -2.0 + math.log(math.exp(2) + 1)
    l1 = -0.0 + math.log(1 + math.e)
    l2 = math.log(2.0)
    assert loss == pytest.approx((l0 + l1 + l2) / 3, rel=1e-6)


def test_entropy_hand_computed():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    h = entropy(p)
    assert h.tolist() == pytest.approx([math.log(2), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])


def test_activation_l1_hand_computed():
    a = FixedLogits([[0.0, 0.0], [math.log(3.0), 0.0]])   # softmax (0.5, 0.5), (0.75, 0.25)
    b = FixedLogits([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])  # (0.75, 0.25) twice
    x = torch.tensor([[0.0], [1.0]])
    # sample 0: |0.5-0.75| + |0.5-0.25| = 0.5 ; sample 1: 0
    assert activation_l1(a, b, x) == pytest.approx(0.25, rel=1e-6)


def test_membership_attack_on_separable_entropies():
    rng = np.random.default_rng(0)
    members = rng.uniform(0.0, 0.1, 50)
    non = rng.uniform(0.9, 1.0, 50)
    assert membership_attack_from_entropies(members, non, rng.uniform(0.0, 0.1, 10)) == 1.0
    assert membership_attack_from_entropies(members, non, rng.uniform(0.9, 1.0, 10)) == 0.0
    mixed = np.concatenate([rng.uniform(0.0, 0.1, 6), rng.uniform(0.9, 1.0, 4)])
    assert membership_attack_from_entropies(members, non, mixed) == pytest.approx(0.6)


def test_membership_attack_on_models():
    # confident on indices 0..9 (members, forget) and uniform on 10..19 (test)
    logits = [[8.0, 0.0]] * 10 + [[0.0, 0.0]] * 10
    m = FixedLogits(logits)
    idx = torch.arange(20, dtype=torch.float32)[:, None]
    y = torch.zeros(20, dtype=torch.long)
    out = membership_attack(m, (idx[:6], y[:6]), (idx[6:10], y[6:10]), (idx[10:], y[10:]))
    assert out == 1.0


def _linear_problem():
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    return x, y


def test_relearn_time_already_below_threshold_is_one():
    x, y = _linear_problem()
    m = nn.Linear(3, 2)
    _, loss = error_and_loss(m, x[:8], y[:8])
    assert relearn_time(m, x, y, x[:8], y[:8], threshold=loss, wd=0.1) == 1


def test_relearn_time_matches_a_manual_loop():
    x, y = _linear_problem()
    torch.manual_seed(1)
    m = nn.Linear(3, 2)
    xf, yf = x[:8], y[:8]
    _, l0 = error_and_loss(m, xf, yf)
    thr = l0 - 0.05
    got = relearn_time(m, x, y, xf, yf, threshold=thr, lr=0.5, wd=0.0, seed=3, max_epochs=50)
    # the same protocol written out by hand
    mm = nn.Linear(3, 2)
    mm.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(mm.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(10_007 * 3 + 4)
    expected = 50
    for epoch in range(50):
        with torch.no_grad():
            lf = float(nn.functional.cross_entropy(mm(xf), yf))
        if lf <= thr + 1e-5:
            expected = epoch + 1
            break
        idx_all = torch.randint(len(y), (500,), generator=g)
        for i in range(0, 500, 128):
            idx = idx_all[i:i + 128]
            loss = nn.functional.cross_entropy(mm(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert got == expected and 1 < got < 50


def test_relearn_time_caps():
    x, y = _linear_problem()
    m = nn.Linear(3, 2)
    assert relearn_time(m, x, y, x[:8], y[:8], threshold=-1.0, wd=0.1, max_epochs=4) == 4
