import torch

from scrubnet.experiments.runner import prepare_seed
from scrubnet.training import finetune, replace_forgotten, retrain
from tests.conftest import tiny_config


def _flat(m):
    return torch.cat([v.reshape(-1) for v in m.state_dict().values()])


def test_same_seed_gives_identical_weights():
    cfg = tiny_config()
    a, b = prepare_seed(cfg, 0), prepare_seed(cfg, 0)
    assert torch.equal(_flat(a.original), _flat(b.original))
    assert torch.equal(_flat(a.retrain), _flat(b.retrain))
    c = prepare_seed(cfg, 1)
    assert not torch.equal(_flat(a.original), _flat(c.original))


def test_finetune_pulls_toward_w0_and_stops_after_zero_error():
    cfg = tiny_config()
    sr = prepare_seed(cfg, 0)
    h = sr.histories["original"]
    if h.zero_error_epoch is not None:
        assert h.epochs == min(h.zero_error_epoch + cfg.train.extra_epochs, cfg.train.max_epochs)
    else:
        assert h.epochs == cfg.train.max_epochs
    # a huge pull keeps the weights at w0
    cfg.train.wd = 1e4
    cfg.train.lr = 1e-5
    m, _ = finetune(sr.start, sr.split.x, sr.split.y, cfg.train, 0)
    diff = (_flat(m) - _flat(sr.start)).abs().max()
    assert diff < 1e-3


def test_replace_mode_keeps_size_and_drops_forgotten():
    x = torch.arange(10, dtype=torch.float32)[:, None]
    y = torch.arange(10) % 2
    f = torch.tensor([2, 5])
    x2, y2 = replace_forgotten(x, y, f, seed=0)
    assert len(x2) == 10
    assert 2.0 not in x2[:, 0].tolist() and 5.0 not in x2[:, 0].tolist()
    keep = [i for i in range(10) if i not in (2, 5)]
    assert torch.equal(x2[keep], x[keep])


def test_retrain_remove_equals_finetune_on_retain():
    cfg = tiny_config()
    sr = prepare_seed(cfg, 0)
    s = sr.split
    m1, _ = retrain(sr.start, s.x, s.y, s.forget_idx, cfg.train, 0, mode="remove")
    m2, _ = finetune(sr.start, *s.retain, cfg.train, 0)
    assert torch.equal(_flat(m1), _flat(m2))
