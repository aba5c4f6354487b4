"""Forgettable fine-tuning: exact deletion on a pretrained transformer (LoRA, attention masks) and a CNN (named
layers), against dense closed-form references and retraining from scratch, in float64."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from scrubnet.mlforget.finetune import (
    accuracy,
    deletion_account,
    forgettable_finetune,
    ordinary_finetune,
    split_batch,
    state_dict_sha256,
)
from scrubnet.mlforget.model import MLConfig, forget_request, retrain_user_weights
from scrubnet.mlforget.solve import SolverConfig
from scrubnet.models.call import ModelInputs
from scrubnet.models.lora import LoRA, LoRALinear, apply_lora, merge_lora
from tests.dense_refs import dense_jacobian

transformers = pytest.importorskip("transformers")

MU, SCALE = 0.05, 5.0


def tiny_bert(num_labels: int = 3, seed: int = 0) -> nn.Module:
    """A BertForSequenceClassification from a config (nothing downloaded), float64, eval mode."""
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg).double().eval()


def token_batch(n: int, seed: int = 1, length: int = 8) -> dict:
    """Right-padded token ids (pad 0), their mask, labels from the visible ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, length), generator=g)
    lens = torch.randint(2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lens[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": (ids.sum(1) % 3).long()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def forward_mode_jacobian(state, x) -> torch.Tensor:
    """J (N·c × p) of the ML module, one forward-mode product per user weight (independent of the rows' path)."""
    eye = torch.eye(state.model.num_linearized, dtype=torch.float64)
    return vmap(lambda v: state.model.jvp(x, v).reshape(-1), out_dims=1)(eye)


def closed_form(jac: torch.Tensor, f0: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, c: int) -> torch.Tensor:
    """argmin (1/n_R) Σ_R ½‖f0 + J w − s·onehot‖² + (µ/2)‖w‖² by a dense solve of the normal equations."""
    rows = keep.repeat_interleave(c)
    j = jac[rows]
    r = (SCALE * F.one_hot(y[keep], c).double() - f0[keep]).reshape(-1)
    n = int(keep.sum())
    return torch.linalg.solve(j.T @ j / n + MU * torch.eye(j.shape[1], dtype=j.dtype), j.T @ r / n)


def test_bert_lora_exact_deletion_with_masks():
    model = tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sha = state_dict_sha256(model)
    batch = token_batch(30)
    spec = LoRA(["query", "value"], rank=2, modules_to_save=["classifier"], seed=3)
    state = forgettable_finetune(model, batch, user_weights=spec, mu=MU, target_scale=SCALE)
    x, y = split_batch(batch)
    assert isinstance(x, ModelInputs) and state.base_sha256 == sha
    assert state.train_info["train_solver"] == "primal"
    # 2 layers × (query, value) × B (16 × 2) + classifier (3 × 16 + 3)
    assert state.model.num_linearized == 4 * 32 + 51
    jac = forward_mode_jacobian(state, x)
    with torch.no_grad():
        f0 = state.model.core_forward(x)
    keep = torch.ones(30, dtype=torch.bool)
    assert rel(state.model.delta_flat(), closed_form(jac, f0, y, keep, 3)) <= 1e-8
    for request in ([2, 7, 11], [0, 19]):
        out = forget_request(state, x, y, request, noise_seed=5)
        keep[request] = False
        ref = closed_form(jac, f0, y, keep, 3)
        assert rel(out.w_before_noise, ref) <= 1e-8
        assert rel(out.w_before_noise, retrain_user_weights(state, x, y)) <= 1e-8
        assert out.info.extra["certificate"]["kl_bound_nats"] < 1e-6
    acct = deletion_account(state)
    assert acct["deleted_ids"] == [0, 2, 7, 11, 19] and acct["remaining"] == 25 and acct["base_sha256"] == sha
    # the ML module's logits are f0 + J w, and the mask reaches the model: padded ids do not matter
    with torch.no_grad():
        logits = state.model(x)
        assert rel(logits.reshape(-1), (f0.reshape(-1) + jac @ state.model.delta_flat())) <= 1e-10
        noisy = ModelInputs(torch.where(x.extras["attention_mask"].bool(), x.main, 7), x.extras)
        assert float((state.model(noisy) - logits).abs().max()) <= 1e-10
        unmasked = ModelInputs(noisy.main, {"attention_mask": torch.ones_like(x.main)})
        assert float((state.model(unmasked) - logits).abs().max()) > 1e-4
    # the pretrained model was never modified
    assert state_dict_sha256(model) == sha
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bert_lora_certified_cg_request():
    """CG (JVPs through the attention with masks) stops at its proven bound; the bound holds."""
    model = tiny_bert()
    batch = token_batch(20, seed=2)
    cfg = MLConfig(mu=MU, target_scale=SCALE, sigma=1e-3, leaky_slope=None,
                   solver=SolverConfig(solver="cg", precond_rank=16))
    state = forgettable_finetune(model, batch, user_weights=LoRA(["value"], rank=2, modules_to_save=["classifier"]),
                                 config=cfg)
    x, y = split_batch(batch)
    assert state.train_info["train_solver"] == "cg"
    out = forget_request(state, x, y, [4, 9], budget_nats=0.01)
    keep = torch.ones(20, dtype=torch.bool)
    keep[[4, 9]] = False
    with torch.no_grad():
        f0 = state.model.core_forward(x)
    ref = closed_form(forward_mode_jacobian(state, x), f0, y, keep, 3)
    err = float(torch.linalg.vector_norm(out.w_before_noise - ref))
    cert = out.info.extra["certificate"]
    assert cert["within_budget"] and err <= cert["weight_error_bound"]
    assert cert["kl_bound_nats"] <= 0.01


def test_lora_tangent_model():
    """B enters each adapted layer linearly: adapting the head, the model is exactly linear in B (the tangent
    model is the adapted network); adapting an inner layer, they differ at second order only."""
    model = tiny_bert()
    x, _ = split_batch(token_batch(12, seed=4))
    mask = x.extras["attention_mask"]
    for target, order in (("classifier", 0), ("bert.encoder.layer.1.attention.self.value", 2)):
        spec = LoRA([target], rank=3, alpha=6.0)
        net, names = apply_lora(model, spec)
        lin = forgettable_finetune(model, token_batch(12, seed=4), user_weights=spec).model
        b = lin.delta[0].detach().clone()
        assert float(b.abs().max()) > 1e-3  # it trained
        gaps = []
        with torch.no_grad():
            for eps in (1.0, 0.5):
                dict(net.named_parameters())[names[0]].copy_(eps * b)
                lin.delta[0].copy_(eps * b)
                gaps.append(float((lin(x) - net(input_ids=x.main, attention_mask=mask).logits).abs().max()))
        if order == 0:
            assert max(gaps) <= 1e-12
        else:
            assert gaps[1] > 1e-12 and 3.5 <= gaps[0] / gaps[1] <= 4.5  # O(ε²)


def test_lora_matches_peft_convention():
    peft = pytest.importorskip("peft")
    model = tiny_bert()
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query"], lora_dropout=0.0)
    spec = LoRA.from_peft(cfg)
    assert (spec.rank, spec.scale, spec.target_modules) == (2, 2.0, ["query"])
    ours, names = apply_lora(model, spec)
    theirs = peft.get_peft_model(copy.deepcopy(model), cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, m in ours.named_modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g, dtype=torch.float64))
                pm = theirs.get_submodule("base_model.model." + n)
                pm.lora_A["default"].weight.copy_(m.lora_A.weight)
                pm.lora_B["default"].weight.copy_(m.lora_B.weight)
        x, _ = split_batch(token_batch(5))
        a = ours(input_ids=x.main, attention_mask=x.extras["attention_mask"]).logits
        b = theirs(input_ids=x.main, attention_mask=x.extras["attention_mask"]).logits
    assert len(names) == 2 and rel(a, b) <= 1e-12


def test_bad_specs_refused():
    model = tiny_bert()
    batch = token_batch(8)
    with pytest.raises(ValueError, match="matches no module"):
        forgettable_finetune(model, batch, user_weights=LoRA(["nonexistent"]))
    with pytest.raises(ValueError, match="nn.Linear"):
        forgettable_finetune(model, batch, user_weights=LoRA(["LayerNorm"]))
    with pytest.raises(ValueError, match="dual"):
        forgettable_finetune(model, batch, user_weights=LoRA(["query"]), solver="dual")
    with pytest.raises(ValueError, match="labels"):
        forgettable_finetune(model, {"input_ids": batch["input_ids"]}, user_weights="head")


class SmallCNN(nn.Module):
    def __init__(self, c: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.pool(torch.tanh(self.conv2(h)))
        return self.fc(h.flatten(1))


def pretrained_cnn() -> nn.Module:
    torch.manual_seed(0)
    net = SmallCNN().double()
    with torch.no_grad():  # non-trivial running statistics, as a pretrained network has
        net.train()
        net(torch.randn(64, 1, 6, 6, dtype=torch.float64) * 2 + 0.5)
    return net.eval()


@pytest.mark.parametrize("solver", ["primal", "dual"])
def test_cnn_named_layers_exact_deletion(solver):
    net = pretrained_cnn()
    sha = state_dict_sha256(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=g)
    state = forgettable_finetune(net, x, y, user_weights=["conv2", "fc"], solver=solver)
    names = ["conv2.weight", "conv2.bias", "fc.weight", "fc.bias"]
    assert state.model.linearized_names == names and state.train_info["train_solver"] == solver
    jac = dense_jacobian(net, x, names)
    with torch.no_grad():
        f0 = net(x)
    keep = torch.ones(24, dtype=torch.bool)
    assert rel(state.model.delta_flat(), closed_form(jac, f0, y, keep, 3)) <= 1e-8
    for request in ([1, 5], [10, 11, 20]):
        out = forget_request(state, x, y, request)
        keep[request] = False
        assert rel(out.w_before_noise, closed_form(jac, f0, y, keep, 3)) <= 1e-8
        assert rel(out.w_before_noise, retrain_user_weights(state, x, y)) <= 1e-8
    assert state_dict_sha256(net) == sha


def test_accuracy_against_ordinary_finetuning(capsys):
    """Forgettable vs ordinary fine-tuning of the same layers on a shifted synthetic task (numbers reported; the
    assertion only rules out a broken model: well above chance)."""
    net = pretrained_cnn()
    g = torch.Generator().manual_seed(2)
    protos = torch.randn(3, 1, 6, 6, generator=g, dtype=torch.float64)

    def draw(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return protos[y] + 0.8 * torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), y

    (xtr, ytr), (xte, yte) = draw(90), draw(300)
    state = forgettable_finetune(net, xtr, ytr, user_weights=["conv2", "fc"], mu=1e-3)
    ordinary = ordinary_finetune(net, xtr, ytr, user_weights=["conv2", "fc"], lr=1e-2, epochs=30)
    acc_f, acc_o = accuracy(state.model, xte, yte), accuracy(ordinary, xte, yte)
    with capsys.disabled():
        print(f"\nforgettable {acc_f:.3f}  ordinary {acc_o:.3f}  pretrained {accuracy(net, xte, yte):.3f}")
    assert acc_f > 0.6 and acc_o > 0.6


def test_hf_model_from_directory_head(tmp_path):
    """A HuggingFace model saved and loaded offline (from_pretrained, local files only), head as user weights."""
    tiny_bert().save_pretrained(tmp_path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, local_files_only=True, torch_dtype=torch.float64).eval()
    sha = state_dict_sha256(model)
    batch = token_batch(16, seed=6)
    state = forgettable_finetune(model, batch)
    assert state.model.linearized_names == ["classifier.weight", "classifier.bias"]
    assert state.user_weights == {"kind": "head", "prefixes": ["classifier"]}
    x, y = split_batch(batch)
    out = forget_request(state, x, y, [3])
    assert rel(out.w_before_noise, retrain_user_weights(state, x, y)) <= 1e-8
    assert state_dict_sha256(model) == sha == state.base_sha256


def test_merge_lora_keeps_the_function():
    model = tiny_bert()
    net, names = apply_lora(model, LoRA(["query"], rank=2))
    with torch.no_grad():
        for n in names:
            dict(net.named_parameters())[n].normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    merged = merge_lora(net)
    x, _ = split_batch(token_batch(6))
    kw = {"input_ids": x.main, "attention_mask": x.extras["attention_mask"]}
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert rel(merged(**kw).logits, net(**kw).logits) <= 1e-12
    q = "bert.encoder.layer.0.attention.self.query"
    ad = net.get_submodule(q)
    want = model.get_submodule(q).weight + ad.scale * ad.lora_B.weight @ ad.lora_A.weight
    assert torch.equal(merged.get_submodule(q).weight, want) and not torch.equal(want, model.get_submodule(q).weight)


def test_core_point_named_layers():
    """Linearised at a point fine-tuned on never-deleted core samples: core requests refused, deletions exact
    at that point, the pretrained model untouched."""
    net = pretrained_cnn()
    sha = state_dict_sha256(net)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=g)
    state = forgettable_finetune(net, x, y, user_weights=["fc"], core_ids=[4, 0, 9],
                                 core_train={"epochs": 5, "lr": 0.05})
    assert state.core_ids.tolist() == [0, 4, 9] and state.user_weights["core"]["core_samples"] == 3
    core_net = state.model.base
    assert not torch.equal(core_net.fc.weight, net.fc.weight)  # the centre moved
    assert torch.equal(core_net.conv2.weight, net.conv2.weight)  # only the user weights were trained
    with pytest.raises(ValueError, match="core"):
        forget_request(state, x, y, [4])
    core_net = copy.deepcopy(core_net).requires_grad_(True)
    jac = dense_jacobian(core_net, x, ["fc.weight", "fc.bias"])
    with torch.no_grad():
        f0 = core_net(x)
    keep = torch.ones(24, dtype=torch.bool)
    out = forget_request(state, x, y, [1, 7])
    keep[[1, 7]] = False
    assert rel(out.w_before_noise, closed_form(jac, f0, y, keep, 3)) <= 1e-8
    assert deletion_account(state)["core"] == 3
    assert state_dict_sha256(net) == sha == state.base_sha256


def test_core_point_lora_merges_and_adds_a_fresh_adapter():
    model = tiny_bert()
    batch = token_batch(16, seed=7)
    spec = LoRA(["value"], rank=2, modules_to_save=["classifier"])
    state = forgettable_finetune(model, batch, user_weights=spec, core_ids=[0, 1, 2, 3], core_train={"epochs": 2})
    assert state.user_weights["seed"] == 1 and "core_sha256" in state.user_weights["core"]
    adapters = [m for m in state.model.base.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 2 and not any(isinstance(m, LoRALinear) for a in adapters for m in a.base_layer.modules())
    x, y = split_batch(batch)
    out = forget_request(state, x, y, [5, 11])
    assert rel(out.w_before_noise, retrain_user_weights(state, x, y)) <= 1e-8


def test_mu_auto_picks_the_largest_mu_within_a_tie_of_the_best_held_out_error():
    """mu='auto': each µ of the grid is fitted on the deletable samples but a held-out split (≥ 200 or half of
    them, at least 10 %) and scored on that split (never a core sample); the held-out errors are re-computed here by hand, the choice follows the rule, and the final
    model equals fine-tuning with that µ given."""
    from scrubnet.mlforget.chance import held_out_size
    from scrubnet.mlforget.finetune import MU_GRID, MU_TIE
    net = pretrained_cnn()
    g = torch.Generator().manual_seed(2)
    n = 240
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64) + 0.8 * y.double().view(-1, 1, 1, 1)
    state = forgettable_finetune(net, x, y, user_weights=["fc"], mu="auto", core_ids=[0, 1, 2, 3, 4],
                                 core_train={"epochs": 2})
    found = state.train_info["mu_search"]
    errors = {float(k): v for k, v in found["errors"].items()}
    assert set(errors) == set(MU_GRID) and found["held_out"] == held_out_size(n - 5) == 117
    best = min(errors.values())
    assert found["chosen"] == max(m for m, e in errors.items() if e <= best + MU_TIE) == state.config.mu
    given = forgettable_finetune(net, x, y, user_weights=["fc"], mu=found["chosen"], core_ids=[0, 1, 2, 3, 4],
                                 core_train={"epochs": 2})
    assert torch.equal(given.model.delta_flat(), state.model.delta_flat())
    # the held-out error of one µ by hand: the same split, a fit on the rest, the error on the held-out part
    deletable = torch.arange(5, n)
    val = deletable[torch.randperm(len(deletable), generator=torch.Generator().manual_seed(5))[:found["held_out"]]]
    fit = torch.tensor(sorted(set(range(n)) - set(val.tolist())))
    mu = found["chosen"]
    part = forgettable_finetune(net, x[fit], y[fit], 3, user_weights=["fc"], mu=mu,
                                core_ids=[0, 1, 2, 3, 4], core_train={"epochs": 2})
    assert accuracy(part.model, x[val], y[val]) == pytest.approx(1 - errors[mu], abs=1e-12)
    with pytest.raises(ValueError, match="too few"):
        forgettable_finetune(net, x[:30], y[:30], user_weights=["fc"], mu="auto")  # 15 held out
    with pytest.raises(ValueError, match="'auto'"):
        forgettable_finetune(net, x, y, user_weights=["fc"], mu="best")
