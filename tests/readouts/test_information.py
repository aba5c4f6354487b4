"""White-box bound: Gaussian KL by hand, both conventions, and the scrub-both-models readout."""
import math

import pytest
import torch
from torch import nn

from scrubnet.readouts.information import gaussian_kl_diag, scrub_information, weight_information


def test_gaussian_kl_three_parameters_by_hand():
    mp, vp = torch.tensor([0.0, 1.0, -2.0]), torch.tensor([1.0, 0.5, 2.0])
    mq, vq = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2.0, 0.5, 1.0])
    # ½ Σ [vp/vq + (mq−mp)²/vq − 1 + log(vq/vp)], term by term:
    t1 = 1.0 / 2.0 + 1.0 / 2.0 - 1 + math.log(2.0)    # = log 2
    t2 = 1.0 + 0.0 - 1 + 0.0                          # = 0
    t3 = 2.0 / 1.0 + 4.0 / 1.0 - 1 + math.log(0.5)    # = 5 − log 2
    want = 0.5 * (t1 + t2 + t3)
    assert want == pytest.approx(2.5)
    assert gaussian_kl_diag(mp, vp, mq, vq) == pytest.approx(2.5, rel=1e-6)
    # reverse direction by hand: ½ Σ [vq/vp + (mp−mq)²/vp − 1 + log(vp/vq)]
    rev = 0.5 * ((2.0 + 1.0 - 1 + math.log(0.5)) + 0.0 + (0.5 + 2.0 - 1 + math.log(2.0)))
    assert gaussian_kl_diag(mq, vq, mp, vp) == pytest.approx(rev, rel=1e-6)
    out = weight_information({"a": mp}, {"a": vp}, {"a": mq}, {"a": vq})
    assert out["info_weights_nats"] == pytest.approx(2.5, rel=1e-6)
    assert out["info_weights_nats_code"] == pytest.approx(2 * rev, rel=1e-6)


def test_kl_matches_torch_distributions_and_dicts():
    g = torch.Generator().manual_seed(0)
    mp, mq = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    vp, vq = torch.rand(2, 3, generator=g) + 0.1, torch.rand(2, 3, generator=g) + 0.1
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mp, vp.sqrt()),
                                            torch.distributions.Normal(mq, vq.sqrt())).sum()
    assert gaussian_kl_diag(mp, vp, mq, vq) == pytest.approx(float(ref), rel=1e-5)
    d = gaussian_kl_diag({"x": mp[0], "y": mp[1]}, {"x": vp[0], "y": vp[1]},
                         {"y": mq[1], "x": mq[0]}, {"x": vq[0], "y": vq[1]})
    assert d == pytest.approx(float(ref), rel=1e-5)
    assert gaussian_kl_diag(mp, vp, mp, vp) == pytest.approx(0.0, abs=1e-12)


def test_kl_bad_input():
    a = torch.ones(3)
    with pytest.raises(ValueError, match="positive"):
        gaussian_kl_diag(a, torch.tensor([1.0, 0.0, 1.0]), a, a)
    with pytest.raises(ValueError, match="shapes"):
        gaussian_kl_diag(a, a, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="lacks"):
        gaussian_kl_diag({"a": a}, {"a": a}, {"b": a}, {"b": a})


def test_scrub_information_uses_each_models_own_noise():
    orig, ref = nn.Linear(2, 1), nn.Linear(2, 1)
    with torch.no_grad():
        orig.weight.copy_(torch.tensor([[1.0, 2.0]]))
        orig.bias.fill_(0.0)
        ref.weight.copy_(torch.tensor([[1.0, 0.0]]))
        ref.bias.fill_(1.0)

    def noise_of(m):  # variance 1 for the original, 2 for the reference
        v = 1.0 if m is orig else 2.0
        return ({k: p.detach() for k, p in m.named_parameters()},
                {k: torch.full_like(p, v) for k, p in m.named_parameters()})

    out = scrub_information(noise_of, orig, ref)
    # forward: ½ Σ [1/2 + d²/2 − 1 + log 2], d = (0, −2, 1)
    fwd = 0.5 * sum(0.5 + d * d / 2 - 1 + math.log(2) for d in (0.0, -2.0, 1.0))
    rev = 0.5 * sum(2.0 + d * d / 1 - 1 - math.log(2) for d in (0.0, -2.0, 1.0))
    assert out["info_weights_nats"] == pytest.approx(fwd, rel=1e-9)
    assert out["info_weights_nats_code"] == pytest.approx(2 * rev, rel=1e-9)
    with pytest.raises(ValueError, match="retrain"):
        scrub_information(noise_of, orig, None)


def test_sweep_writes_json_and_figure(tmp_path):
    import json

    from scrubnet.data.registry import DataConfig
    from scrubnet.experiments.config import ExperimentConfig
    from scrubnet.experiments.sweep import run_sweep
    from scrubnet.training import TrainConfig

    cfg = ExperimentConfig(
        data=DataConfig(dataset="digits", core_classes=[5, 6], task_classes=[0, 1, 2], n_train_per_class=12,
                        n_test_per_class=6, core_per_class=20, forget_class=0, forget_count=4),
        train=TrainConfig(wd=0.03, max_epochs=3, extra_epochs=0, pretrain_epochs=1, batch_size=16),
        model="mlp", model_options={"hidden": 16, "depth": 1}, seeds=[0], relearn_max_epochs=2)
    res = run_sweep("fisher", "alpha", [1e-6, 1e-3], cfg, tmp_path, progress=False)
    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert on_disk["values"] == [1e-6, 1e-3] and len(on_disk["runs"]) == 2
    assert (tmp_path / "sweep_fisher.png").stat().st_size > 1000
    info = [s["readouts"]["info_weights_nats"]["mean"] for s in res["summary"]]
    assert info[0] > info[1] > 0  # more noise, less information
    assert "error_test" in res["anchors"]["retrain"]
    with pytest.raises(ValueError, match="bad option"):
        run_sweep("fisher", "not_an_option", [1.0], cfg, tmp_path, progress=False)
    with pytest.raises(ValueError, match="at least one"):
        run_sweep("fisher", "alpha", [], cfg, tmp_path, progress=False)
