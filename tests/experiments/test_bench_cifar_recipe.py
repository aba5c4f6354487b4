"""The field's CIFAR-10 recipe (scrubnet/experiments/bench_cifar.py): the protocol sets it, and each of its
parts not in scrubnet's own recipe — weight decay toward zero, the step schedule, the crop-and-flip augmentation —
equals a slow, written-out twin (torch's SGD + MultiStepLR; padding and cropping image by image)."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data.augment import CropFlip, make_augment
from scrubnet.experiments.bench_cifar import apply_cifar_protocol, scaled_milestones
from scrubnet.experiments.config import ExperimentConfig
from scrubnet.training.loops import TrainConfig, finetune, step_rate

def test_the_cifar_protocol_carries_the_fields_recipe():
    # the dry run's statement of it is checked in tests/experiments/test_bench_cli.py's dry-run test
    cfg = ExperimentConfig()
    cfg.data.dataset = "cifar10"
    t = apply_cifar_protocol(cfg).train
    assert (t.lr, t.momentum, t.wd, t.batch_size, t.max_epochs) == (0.1, 0.9, 5e-4, 256, 182)
    assert (t.decay_toward, t.lr_milestones, t.lr_gamma, t.augment, t.freeze_bn) == (
        "zero", [91, 136], 0.1, "crop_flip", False)
    assert scaled_milestones(4) == [2, 3] and scaled_milestones(1) == []


def test_step_schedule_and_decay_toward_zero_equal_torchs_sgd_with_multisteplr():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(3, (12,), generator=g)
    cfg = TrainConfig(lr=0.2, momentum=0.9, wd=0.05, batch_size=12, min_epochs=4, max_epochs=4, freeze_bn=False,
                      decay_toward="zero", lr_milestones=[1, 3], lr_gamma=0.5)
    out, hist = finetune(model, x, y, cfg, seed=0)
    assert hist.epochs == 4
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3], gamma=0.5)
    rates = []
    for epoch in range(4):            # one full batch per epoch: the order of the samples does not matter
        rates.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        sched.step()
    assert [step_rate(0.2, e, (1, 3), 0.5) for e in range(4)] == rates == [0.2, 0.1, 0.1, 0.05]
    for p, q in zip(out.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    # the default target is the pull toward the start (no ordinary decay): another end point
    init, _ = finetune(model, x, y, TrainConfig(**{**cfg.to_dict(), "decay_toward": "init"}), seed=0)
    assert any(not torch.allclose(p, q) for p, q in zip(init.parameters(), out.parameters()))


def test_crop_flip_is_a_padded_crop_and_a_horizontal_flip_image_by_image():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, 6, 5, generator=g)
    got = CropFlip(seed=7)(x)
    # the twin: the same draws (row offsets, column offsets, flips), then F.pad and slicing per image
    d = torch.Generator().manual_seed(7)
    rows, cols = torch.randint(0, 9, (16,), generator=d), torch.randint(0, 9, (16,), generator=d)
    flips = torch.rand(16, generator=d) < 0.5
    for i in range(16):
        padded = F.pad(x[i], (4, 4, 4, 4))
        want = padded[:, rows[i]:rows[i] + 6, cols[i]:cols[i] + 5]
        if flips[i]:
            want = want.flip(-1)
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert 0 < int(flips.sum()) < 16 and len(set(rows.tolist())) > 1
    assert isinstance(make_augment("crop_flip", 0), CropFlip)
