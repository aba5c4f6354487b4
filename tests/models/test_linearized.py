"""The JVP-linearised model against a dense Jacobian built with jacrev (float64, tiny networks)."""
import pytest
import torch
from torch import nn

from scrubnet.models.linearized import (
    LinearizedModel,
    convert_relu_to_leaky,
    select_parameter_names,
)
from tests import dense_refs


def tiny_net(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    net[1].running_mean.normal_()
    net[1].running_var.uniform_(0.5, 2.0)
    return net.double().eval()


@pytest.mark.parametrize("prefixes", [None, ["3", "5"]])
def test_jvp_equals_dense_jacobian_times_delta(prefixes):
    net = tiny_net()
    lin = LinearizedModel(net, prefixes=prefixes).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    torch.manual_seed(1)
    dw = torch.randn(lin.num_linearized, dtype=torch.float64)
    lin.set_delta_flat(dw)
    jac = dense_refs.dense_jacobian(net, x, lin.linearized_names)
    expected = net(x) + (jac @ dw).view(7, 3)
    lin.train()  # BN must stay in eval mode
    assert not lin.base[1].training
    out = lin(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # gradient w.r.t. the tangent (reverse-over-forward) equals Jᵀ·(dL/df)
    u = torch.randn(7, 3, dtype=torch.float64)
    (out * u).sum().backward()
    grad = torch.cat([d.grad.reshape(-1) for d in lin.delta])
    torch.testing.assert_close(grad, jac.T @ u.reshape(-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lin.vjp(x, u), jac.T @ u.reshape(-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lin.jvp(x, dw), (jac @ dw).view(7, 3), rtol=1e-10, atol=1e-10)


def test_zero_delta_is_the_frozen_network_and_input_untouched():
    net = tiny_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lin = LinearizedModel(net).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(lin(x), net(x))
    lin.set_delta_flat(torch.ones(lin.num_linearized, dtype=torch.float64))
    lin.reset_delta()
    assert torch.equal(lin(x), net(x))
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(not p.requires_grad for p in lin.base.parameters())
    assert [n for n, p in lin.named_parameters() if p.requires_grad] == [f"delta.{i}" for i in range(len(lin.delta))]


def test_leaky_conversion_and_prefix_errors():
    net = tiny_net()
    lin = LinearizedModel(net, leaky_slope=0.2)
    assert isinstance(lin.base[2], nn.LeakyReLU) and lin.base[2].negative_slope == 0.2
    assert isinstance(net[2], nn.ReLU)  # the input is not modified
    m = convert_relu_to_leaky(nn.Sequential(nn.Sequential(nn.ReLU())), 0.1)
    assert isinstance(m[0][0], nn.LeakyReLU)
    with pytest.raises(ValueError, match="matches no parameter"):
        select_parameter_names(net, ["head"])
    assert select_parameter_names(net, ["5"]) == ["5.weight", "5.bias"]
    with pytest.raises(ValueError, match="entries"):
        lin.set_delta_flat(torch.zeros(3))
