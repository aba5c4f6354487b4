"""Inputs beyond x reach the model everywhere: dict batches {input_ids, attention_mask, labels} on a tiny
HuggingFace BERT (built from a config, nothing downloaded), checked against hand loops that pass the mask."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import scrubnet
from scrubnet.data.stream import BatchKeys, DataStream
from scrubnet.models.call import ModelInputs
from scrubnet.recipe import TrainingRecipe
from tests.hf_models import Wrapper, tiny_bert, token_batch

pytest.importorskip("transformers")


class Dicts(Dataset):
    """A map-style dataset of dict items, as a HuggingFace tokenised dataset gives them."""

    def __init__(self, batch):
        self.b = batch

    def __len__(self):
        return len(next(iter(self.b.values())))

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.b.items()}


RECIPE = TrainingRecipe(lr=0.05, momentum=0.9, batch_size=8, epochs=2)


def as_inputs(b):
    return ModelInputs(b["input_ids"], {"attention_mask": b["attention_mask"]})


def hand_error_and_loss(model, b):
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return float((logits.argmax(1) != b["labels"]).float().mean()), float(F.cross_entropy(logits, b["labels"]))


def hand_finetune(model, b, recipe, seed=0, mask=True):
    """The fine-tuning baseline written out: seeded permutation, mean CE, SGD(+momentum), the mask passed."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(10_007 * seed + 100)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=recipe.lr,
                          momentum=recipe.momentum)
    n = len(b["labels"])
    for _ in range(recipe.epochs):
        model.train()
        order = torch.randperm(n, generator=g)
        for i in range(0, n, recipe.batch_size):
            idx = order[i:i + recipe.batch_size]
            kw = {"attention_mask": b["attention_mask"][idx]} if mask else {}
            loss = F.cross_entropy(model(input_ids=b["input_ids"][idx], **kw).logits, b["labels"][idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def max_weight_gap(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def data():
    return token_batch(48, seed=0), token_batch(8, seed=1)


def test_the_mask_changes_the_logits(data):
    b, _ = data
    m = tiny_bert()
    padded = b["attention_mask"].sum(1) < b["attention_mask"].shape[1]
    assert padded.sum() >= 10
    with torch.no_grad():
        with_mask = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        without = m(input_ids=b["input_ids"]).logits
    assert float((with_mask - without)[padded].abs().max()) > 1e-2
    assert float((with_mask - without)[~padded].abs().max()) < 1e-5


def test_dict_batches_yield_model_inputs(data):
    b, _ = data
    for source in (Dicts(b), DataLoader(Dicts(b), batch_size=10)):
        s = DataStream(source)
        x, y = s.tensors()
        assert isinstance(x, ModelInputs) and set(x.extras) == {"attention_mask"}
        assert torch.equal(x.main, b["input_ids"]) and torch.equal(x.extras["attention_mask"], b["attention_mask"])
        assert x.main.dtype == torch.int64 and torch.equal(y, b["labels"])
    x, _ = DataStream(Dicts(b)).take(torch.tensor([5, 2]))
    assert torch.equal(x.extras["attention_mask"], b["attention_mask"][[5, 2]])


def test_unknown_fields_are_refused_with_a_correct_hint(data):
    b, _ = data
    extra = dict(b, special_tokens_mask=b["attention_mask"])
    with pytest.raises(ValueError, match=r"BatchKeys\(extra=.*special_tokens_mask.*ignore_extra=True"):
        DataStream(Dicts(extra)).tensors()
    x, _ = DataStream(Dicts(extra), BatchKeys(extra=BatchKeys().extra + ("special_tokens_mask",))).tensors()
    assert set(x.extras) == {"attention_mask", "special_tokens_mask"}
    x, _ = DataStream(Dicts(extra), BatchKeys(ignore_extra=True)).tensors()   # the explicit opt-out
    assert set(x.extras) == {"attention_mask"}
    renamed = {"tokens": b["input_ids"], "labels": b["labels"]}
    with pytest.raises(ValueError, match=r"BatchKeys\(x=\('your_key',\)\)"):
        DataStream(Dicts(renamed)).tensors()
    no_label = {"input_ids": b["input_ids"], "cls": b["labels"]}
    with pytest.raises(ValueError, match=r"BatchKeys\(y=\('your_key',\)\)"):
        DataStream(Dicts(no_label)).tensors()


def test_finetune_uses_the_mask_as_a_hand_loop_does(data):
    b, f = data
    m = tiny_bert()
    want = hand_finetune(m, b, RECIPE)
    for retain in (Dicts(b), (as_inputs(b), b["labels"])):
        # the retain guard off (tolerance 1): this compares the loop itself with the hand loop, on an untrained
        # model whose retain error the loop is free to raise
        got, res = scrubnet.forget(m, retain, Dicts(f), method="finetune", recipe=RECIPE, readouts=True,
                                   on_failure="return", epochs=RECIPE.epochs, retain_error_tolerance=1.0)
        assert max_weight_gap(got, want) < 1e-5
        err, loss = hand_error_and_loss(got, b)
        assert res.readouts["retain_error"] == pytest.approx(err, abs=1e-6)
        assert res.readouts["retain_loss"] == pytest.approx(loss, rel=1e-5)
    assert max_weight_gap(hand_finetune(m, b, RECIPE, mask=False), want) > 1e-3  # the mask matters


@pytest.mark.parametrize("method", ["neggrad", "randomlabels"])
def test_mixed_methods_read_the_mask_streamed_or_in_memory(data, method):
    b, f = data
    m = tiny_bert()
    streamed, res = scrubnet.forget(m, Dicts(b), Dicts(f), method=method, recipe=RECIPE, readouts=True,
                                    on_failure="return", epochs=1)
    in_memory, _ = scrubnet.forget(m, (as_inputs(b), b["labels"]), (as_inputs(f), f["labels"]), method=method,
                                   recipe=RECIPE, on_failure="return", epochs=1)
    assert max_weight_gap(streamed, in_memory) < 1e-5
    for part, batch in (("retain", b), ("forget", f)):
        err, loss = hand_error_and_loss(streamed, batch)
        assert res.readouts[f"{part}_error"] == pytest.approx(err, abs=1e-6)
        assert res.readouts[f"{part}_loss"] == pytest.approx(loss, rel=1e-5)
        err0, loss0 = hand_error_and_loss(m, batch)
        assert res.readouts[f"original_{part}_loss"] == pytest.approx(loss0, rel=1e-5)


def test_nested_classifier_and_model_output_work_for_finetune(data):
    b, f = data
    inner = tiny_bert(num_labels=4)
    wrapped = Wrapper(inner)           # head at bert.classifier, returns a ModelOutput
    with pytest.raises(ValueError):
        scrubnet.models.find_classifier(wrapped)
    got, res = scrubnet.forget(wrapped, Dicts(b), Dicts(f), method="finetune", recipe=RECIPE, on_failure="return",
                               epochs=RECIPE.epochs)
    want = hand_finetune(inner, b, RECIPE)
    assert max_weight_gap(got.bert, want) < 1e-5
    with pytest.raises(ValueError, match="hiding applies|classifier="):
        scrubnet.forget(wrapped, Dicts(b), Dicts(f), method="hiding", forget_class=0)


def test_hiding_names_classifier_option_for_a_nested_head(data):
    b, f = data
    wrapped = Wrapper(tiny_bert())
    with pytest.raises(ValueError, match="classifier=NAME"):
        scrubnet.forget(wrapped, Dicts(b), Dicts(f), method="hiding", forget_class=0, on_failure="return")
    got, _ = scrubnet.forget(wrapped, Dicts(b), Dicts(f), method="hiding", forget_class=0, on_failure="return",
                             classifier="bert.classifier", retain_error_tolerance=1.0)
    w0, w1 = wrapped.bert.classifier.weight, got.bert.classifier.weight
    assert not torch.equal(w0[0], w1[0]) and torch.equal(w0[1:], w1[1:])


@pytest.mark.parametrize("method", ["fisher", "ntk", "ntk-fisher", "newton"])
def test_curvature_methods_read_the_mask(data, method):
    b, f = data
    m = tiny_bert()
    opts = dict(recipe=TrainingRecipe(wd=1e-2), force=True, on_failure="return", readouts=True,
                retain_error_tolerance=1.0)
    got, res = scrubnet.forget(m, Dicts(b), Dicts(f), method=method, **opts)
    for part, batch in (("retain", b), ("forget", f)):
        err, loss = hand_error_and_loss(got, batch)
        assert res.readouts[f"{part}_error"] == pytest.approx(err, abs=1e-6)
        assert res.readouts[f"{part}_loss"] == pytest.approx(loss, rel=1e-5)
    # the same scrub from the same inputs given as tensors; without the mask it is another scrub
    same, _ = scrubnet.forget(m, (as_inputs(b), b["labels"]), (as_inputs(f), f["labels"]), method=method, **opts)
    assert max_weight_gap(same, got) < 1e-5
    unmasked = {k: v for k, v in b.items() if k != "attention_mask"}
    other, _ = scrubnet.forget(m, Dicts(unmasked), Dicts({k: v for k, v in f.items() if k != "attention_mask"}),
                               method=method, **opts)
    assert max_weight_gap(other, got) > 1e-6


#: iteration caps for the every-method readout test (tiny BERT, 48 + 8 samples)
CAPS = {"newton": dict(max_iter=30), "ntk": dict(cg_max_iter=100), "ntk-fisher": dict(cg_max_iter=100),
        "neggrad-plus": dict(epochs=1), "l1-sparse": dict(epochs=1), "salun": dict(epochs=1),
        "scrub": dict(epochs=1), "finetune": dict(epochs=1), "neggrad": dict(epochs=1),
        "randomlabels": dict(epochs=1), "ssd": dict(selection_threshold=1.0)}
#: methods that refuse a user's token model, and the cause their one-line refusal names
REFUSE = {"mlforget": "mixed-linear", "mlforget-retrain": "mixed-linear",
          "unsir": "floating-point", "boundary-shrink": "floating-point"}


def hand_error_and_loss_unmasked(model, b):
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"]).logits
    return float(F.cross_entropy(logits, b["labels"]))


@pytest.mark.parametrize("method", scrubnet.methods.available_methods())
def test_every_methods_readouts_are_computed_with_the_mask(data, method):
    b, f = data
    m = tiny_bert()
    kw = dict(CAPS.get(method, {}))
    if scrubnet.methods.method_class(method).class_only:
        kw["forget_class"] = 0
        keep = b["labels"] != 0
        b, f = {k: v[keep] for k, v in b.items()}, {k: v[~keep] for k, v in b.items()}
    call = dict(recipe=TrainingRecipe(wd=1e-2, epochs=1, batch_size=8), force=True, on_failure="return",
                readouts=True, retain_error_tolerance=1.0, chunk_size=20, **kw)
    if method in REFUSE:
        with pytest.raises(ValueError, match=REFUSE[method]) as e:
            scrubnet.forget(m, Dicts(b), Dicts(f), method=method, **call)
        assert "\n" not in str(e.value)
        return
    got, res = scrubnet.forget(m, Dicts(b), Dicts(f), method=method, **call)
    for tag, model in (("", got), ("original_", m)):
        for part, batch in (("retain", b), ("forget", f)):
            err, loss = hand_error_and_loss(model, batch)
            assert res.readouts[f"{tag}{part}_error"] == pytest.approx(err, abs=1e-6), (tag, part)
            assert res.readouts[f"{tag}{part}_loss"] == pytest.approx(loss, rel=1e-5), (tag, part)
    # the hand evaluation without the mask is another number: the readouts could not match it by chance
    assert abs(res.readouts["retain_loss"] - hand_error_and_loss_unmasked(got, b)) > 1e-5
