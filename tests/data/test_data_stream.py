"""DataStream: data as users hold it (tensors, Datasets, DataLoaders with tuple or dict batches), read in chunks;
full-batch quantities as sums over chunks equal their in-memory twins; a 50,000-sample lazy Dataset is scrubbed
and evaluated within a few chunks of memory."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from scrubnet.data.stream import BatchKeys, DataStream, as_stream
from scrubnet.methods.fisher import stream_fisher
from scrubnet.curvature.fisher import fisher_diag
from scrubnet.readouts.basic import error_and_loss, stream_error_and_loss
from tests.hang_guard import HANG_GUARD_S


class DictSet(Dataset):
    def __init__(self, x, y, extra=False):
        self.x, self.y, self.extra = x, y, extra

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        item = {"input": self.x[i], "label": int(self.y[i])}
        if self.extra:
            item["index"] = i
        return item


def _data(n=70):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_every_form_yields_the_same_samples():
    x, y = _data()
    forms = [(x, y), TensorDataset(x, y), DictSet(x, y), DataLoader(TensorDataset(x, y), batch_size=16),
             DataLoader(DictSet(x, y), batch_size=16)]
    for form in forms:
        s = as_stream(form, chunk_size=32)
        assert len(s) == 70
        xs, ys = s.tensors()
        assert torch.equal(xs, x) and torch.equal(ys, y)
        assert all(len(c[1]) <= 32 for c in s.chunks())


def test_extra_fields_need_a_stated_meaning():
    x, y = _data()
    with pytest.raises(ValueError, match="ignore_extra"):
        as_stream(DictSet(x, y, extra=True)).tensors()
    assert len(as_stream(DictSet(x, y, extra=True), BatchKeys(ignore_extra=True)).tensors()[0]) == 70
    with pytest.raises(ValueError, match="3 fields"):
        as_stream(DataLoader(TensorDataset(x, y, y), batch_size=8)).tensors()
    with pytest.raises(ValueError, match="no input key"):
        as_stream([{"pixels": x[0], "label": 0}] and DataLoader([{"pixels": x[0], "label": 0}])).tensors()
    s = as_stream(DataLoader([{"pixels": x[i], "cls": int(y[i])} for i in range(70)], batch_size=10),
                  BatchKeys(x=("pixels",), y=("cls",)))
    assert torch.equal(s.tensors()[1], y)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        list(DataStream(DictSet(bad, y)).chunks())


def test_chunk_sums_equal_the_in_memory_quantities():
    x, y = _data()
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    lazy = DataStream(DictSet(x, y), chunk_size=16)
    ref = fisher_diag(model, x, kind="true")
    got = stream_fisher(model, lazy, "true", None, None)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-8)
    e1, l1 = error_and_loss(model, x, y)
    e2, l2 = stream_error_and_loss(model, lazy)
    assert e1 == pytest.approx(e2) and l1 == pytest.approx(l2, rel=1e-5)


LAZY = textwrap.dedent('''
    import resource, torch
    from torch import nn
    import scrubnet
    torch.set_num_threads(1)
    D, N = 3 * 16 * 16, 50_000
    FREQ = torch.linspace(0.01, 1.0, D)

    class Lazy(torch.utils.data.Dataset):
        """sample i generated from its index on demand: 3 KB each, 150 MB if ever held at once"""
        def __init__(self, n, offset=0):
            self.n, self.offset = n, offset
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            j = self.offset + i
            return torch.sin(FREQ * (j % 997 + 1)) + j % 3, j % 3

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3))
    retain, forget = Lazy(N), Lazy(50, offset=N)
    scrubnet.forget(model, Lazy(600), forget, method="finetune", epochs=1, readouts=True, classifier="2")  # warm up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rec = scrubnet.TrainingRecipe(epochs=1, batch_size=256)
    a, ra = scrubnet.forget(model, retain, forget, method="finetune", recipe=rec, readouts=True, chunk_size=1024,
                             classifier="2")
    b, rb = scrubnet.forget(model, retain, forget, method="fisher", recipe=rec, readouts=True, force=True,
                            alpha=1e-8, chunk_size=1024, classifier="2")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) / 1024, ra.readouts["retain_error"], rb.readouts["retain_error"])
''')


def test_a_50k_lazy_dataset_is_scrubbed_and_evaluated_in_a_few_chunks_of_memory():
    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mb, err_ft, err_fi = (float(v) for v in out.stdout.split())
    # one chunk = 1024 × 3 KB = 3 MB; materialising D_r would take 150 MB (300 MB with the concatenation)
    assert growth_mb < 60, growth_mb
    assert 0 <= err_ft < 0.7 and 0 <= err_fi < 0.7


def test_newton_on_a_lazy_dataset_equals_newton_on_tensors():
    """The streamed Newton step (chunk sums of loss, gradient, Gauss–Newton products) is the in-memory one."""
    import scrubnet
    x, y = _data(90)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh())
    model.add_module("head", torch.nn.Linear(8, 3))
    opts = dict(method="newton", recipe=scrubnet.TrainingRecipe(wd=0.1), force=True, tol=1e-8, max_iter=200,
                on_failure="return")
    a, ra = scrubnet.forget(model, DictSet(x[10:], y[10:]), (x[:10], y[:10]), chunk_size=16, **opts)
    b, rb = scrubnet.forget(model, (x[10:], y[10:]), (x[:10], y[:10]), **opts)
    assert ra.ok and rb.ok
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(v, w, atol=1e-5, rtol=1e-4), k


@pytest.mark.parametrize("method", ["neggrad", "randomlabels"])
def test_neggrad_and_randomlabels_on_a_dataset_equal_the_in_memory_runs(method):
    """D_r as a Dataset (dict batches) is streamed; the seeded batches of D_r ⊔ D_f, the loss and the optimiser
    are those of the in-memory run, so the weights agree."""
    import scrubnet
    x, y = _data(90)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
    model.add_module("head", torch.nn.Linear(8, 3))
    model.eval()
    rec = scrubnet.TrainingRecipe(epochs=3, batch_size=16, wd=0.01)
    a, ra = scrubnet.forget(model, DictSet(x[10:], y[10:]), (x[:10], y[:10]), method=method, recipe=rec,
                            chunk_size=7)
    b, rb = scrubnet.forget(model, (x[10:], y[10:]), (x[:10], y[:10]), method=method, recipe=rec)
    assert ra.ok and rb.ok
    moved = 0.0
    for (k, v), w, w_in in zip(a.state_dict().items(), b.state_dict().values(), model.state_dict().values()):
        assert torch.allclose(v, w, atol=1e-6, rtol=1e-5), k
        if v.is_floating_point():
            moved = max(moved, float((v - w_in).abs().max()))
    assert moved > 1e-3   # it did train


def test_neggrad_reads_a_dataloader_over_a_map_style_set_by_index_and_refuses_an_iterable_one():
    import scrubnet
    x, y = _data(40)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    loader = DataLoader(TensorDataset(x[10:], y[10:]), batch_size=8)
    call = dict(method="neggrad", classifier="0", on_failure="return", epochs=1)
    a, _ = scrubnet.forget(model, loader, (x[:10], y[:10]), **call)
    b, _ = scrubnet.forget(model, TensorDataset(x[10:], y[10:]), (x[:10], y[:10]), **call)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x[10:], y[10:]))

    with pytest.raises(ValueError, match="DataLoader over a map-style Dataset"):
        scrubnet.forget(model, DataLoader(Stream(), batch_size=8), (x[:10], y[:10]), **call)
