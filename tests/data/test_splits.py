import pytest
import torch

from scrubnet.data.splits import (
    SplitError,
    make_split,
    select_forget,
    validate_forget_ids,
)


def _pools():
    # 6 classes, 30 train / 10 test samples each; x encodes the sample's identity
    y = torch.arange(6).repeat_interleave(30)
    x = torch.arange(len(y), dtype=torch.float32)[:, None].repeat(1, 3)
    yt = torch.arange(6).repeat_interleave(10)
    xt = 1000 + torch.arange(len(yt), dtype=torch.float32)[:, None].repeat(1, 3)
    return x, y, xt, yt


def test_split_rule_counts_relabelling_and_disjointness():
    x, y, xt, yt = _pools()
    s = make_split(x, y, xt, yt, core_classes=[4, 5], task_classes=[2, 0, 1], n_train_per_class=7,
                   n_test_per_class=4, forget_class=1, forget_count=3, seed=3)
    assert s.num_classes == 3 and s.num_core_classes == 2
    assert torch.equal(torch.bincount(s.y), torch.tensor([7, 7, 7]))
    assert torch.equal(torch.bincount(s.y_test), torch.tensor([4, 4, 4]))
    assert len(s.y_core) == 60 and set(s.y_core.tolist()) == {0, 1}
    # task label 0 is original class 2: its x values come from rows 60..89
    ids = s.x[s.y == 0, 0]
    assert torch.all((ids >= 60) & (ids < 90))
    # core and D never share a sample
    assert not set(s.x[:, 0].tolist()) & set(s.x_core[:, 0].tolist())
    # forget set: 3 samples of task class 1, retain is the complement
    assert len(s.forget_idx) == 3 and torch.all(s.y[s.forget_idx] == 1)
    assert len(s.retain_idx) == 18 and not set(s.retain_idx.tolist()) & set(s.forget_idx.tolist())
    assert s.forget_class is None


def test_split_is_seeded():
    x, y, xt, yt = _pools()
    kw = dict(core_classes=[5], task_classes=[0, 1], n_train_per_class=10, n_test_per_class=5, forget_class=0,
              forget_count=4)
    a, b = make_split(x, y, xt, yt, seed=1, **kw), make_split(x, y, xt, yt, seed=1, **kw)
    c = make_split(x, y, xt, yt, seed=2, **kw)
    assert torch.equal(a.x, b.x) and torch.equal(a.forget_idx, b.forget_idx)
    assert not torch.equal(a.x, c.x)


def test_whole_class_and_explicit_ids():
    y = torch.tensor([0, 1, 0, 1, 2, 2])
    idx, fc = select_forget(y, forget_class=1)
    assert idx.tolist() == [1, 3] and fc == 1
    idx, fc = select_forget(y, forget_ids=[5, 0])
    assert idx.tolist() == [0, 5] and fc is None


@pytest.mark.parametrize("ids,msg", [([7], "out of range"), ([-1], "out of range"), ([1, 1], "duplicated"),
                                     ([], "empty"), ([0, 1, 2, 3, 4, 5], "all 6 samples")])
def test_bad_forget_ids(ids, msg):
    with pytest.raises(SplitError, match=msg):
        validate_forget_ids(ids, 6)


def test_bad_class_requests():
    y = torch.tensor([0, 1, 0, 1])
    with pytest.raises(SplitError, match="not a task class"):
        select_forget(y, forget_class=4)
    with pytest.raises(SplitError, match="exceeds"):
        select_forget(y, forget_class=0, forget_count=3)
    x, yy, xt, yt = _pools()
    with pytest.raises(SplitError, match="overlap"):
        make_split(x, yy, xt, yt, core_classes=[0], task_classes=[0, 1], n_train_per_class=2, n_test_per_class=2,
                   forget_class=0, forget_count=1)
