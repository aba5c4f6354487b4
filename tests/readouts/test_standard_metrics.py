"""The field's standard metrics (UA, RA, TA, MIA-efficacy, Avg. Gap) on a model whose logits are its inputs, so
every prediction and every attack feature is set by construction."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from scrubnet.readouts.standard import StandardMetrics, avg_gap, correct_and_features, mia_efficacy, \
    standard_metrics

C = 4


def _logits_for(y, conf, wrong=None):
    """Logits whose softmax gives probability ``conf`` to class ``y`` (or to ``wrong`` when given, so the
    prediction is wrong and the true label's probability is (1 − conf)/(C − 1))."""
    n = len(y)
    top = torch.as_tensor(y if wrong is None else wrong)
    rest = (1 - torch.as_tensor(conf, dtype=torch.float64)) / (C - 1)
    probs = rest[:, None].expand(n, C).clone()
    probs[torch.arange(n), top] = torch.as_tensor(conf, dtype=torch.float64)
    return probs.log()


def test_accuracies_and_features_on_known_predictions():
    model = nn.Identity()
    y = torch.tensor([0, 1, 2, 3, 0])
    wrong = torch.tensor([0, 2, 2, 0, 0])      # samples 1 and 3 predicted wrong
    x = _logits_for(y, torch.full((5,), 0.7), wrong)
    correct, feats = correct_and_features(model, (x, y))
    assert correct.tolist() == [True, False, True, False, True]
    np.testing.assert_allclose(feats["confidence"], [0.7, 0.1, 0.7, 0.1, 0.7])
    h = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))
    np.testing.assert_allclose(feats["entropy"], [h] * 5)
    m = standard_metrics(model, (x, y), (x[:4], y[:4]), (x[1:], y[1:]))
    assert (m.ua, m.ra, m.ta) == pytest.approx((0.5, 0.6, 0.5))


def _sets(conf_forget, n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    retain_conf = 0.95 + 0.04 * torch.rand(n, generator=g, dtype=torch.float64)     # members: confident
    test_conf = 0.3 + 0.2 * torch.rand(n, generator=g, dtype=torch.float64)         # non-members: not
    forget_conf = conf_forget + 0.02 * torch.rand(n, generator=g, dtype=torch.float64)
    return ((_logits_for(y, retain_conf), y), (_logits_for(y, forget_conf), y), (_logits_for(y, test_conf), y))


def test_mia_efficacy_is_one_on_a_forget_set_that_looks_like_test_data_and_zero_on_one_like_retain():
    model = nn.Identity()
    retain, forget, test = _sets(conf_forget=0.4)
    m = standard_metrics(model, retain, forget, test)
    assert m.mia_efficacy == 1.0 and not m.mia_degenerate
    retain, forget, test = _sets(conf_forget=0.96)
    assert standard_metrics(model, retain, forget, test).mia_efficacy == 0.0


def test_mia_members_are_a_test_sized_subset_of_retain():
    # 1,000 members, a tenth of them as unsure as the 30 test points: fit on all of D_r, the SVC calls the unsure
    # region "member" too (efficacy 0 for a test-like D_f); on a test-sized subset it calls it non-member
    rng = np.random.default_rng(0)
    f_r = np.concatenate([0.3 + 0.2 * rng.random(100), 0.9 + 0.09 * rng.random(900)])
    f_t, f_f = 0.3 + 0.2 * rng.random(30), 0.3 + 0.2 * rng.random(20)
    for seed in range(3):
        assert mia_efficacy(f_r, f_t, f_f, seed=seed) == (1.0, False)
    with pytest.raises(ValueError, match="non-empty"):
        mia_efficacy(f_r, f_t, f_f[:0])


def test_avg_gap_is_the_mean_absolute_difference_over_the_four_metrics():
    a = StandardMetrics(ua=0.10, ra=0.90, ta=0.80, mia_efficacy=0.50)
    b = {"ua": 0.20, "ra": 0.95, "ta": 0.80, "mia_efficacy": 0.30, "other": 7.0}
    assert avg_gap(a, b) == pytest.approx((0.10 + 0.05 + 0.0 + 0.20) / 4)
    assert avg_gap(a, a) == 0.0


def test_a_streamed_dataset_gives_the_same_metrics_as_tensors():
    model = nn.Identity()
    retain, forget, test = _sets(conf_forget=0.5)
    loaders = [torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*d), batch_size=7) for d in
               (retain, forget, test)]
    assert standard_metrics(model, *loaders, seed=3) == standard_metrics(model, retain, forget, test, seed=3)
