"""The primal's cost estimate (training and one request of a forgettable model): its FLOP count as documented,
the rows priced by measuring them, the request's cost independent of N."""
from __future__ import annotations

import pytest
import torch

from scrubnet.mlforget.finetune import tangent_network
from scrubnet.mlforget.primal import FLOAT64_SLOWDOWN, primal_cost
from scrubnet.training.cost import gemm_seconds
from tests.mlforget.test_forgettable import pretrained_cnn


@pytest.mark.parametrize("names,block", [(["fc.weight", "fc.bias"], True), (["conv2.weight", "fc.weight"], False)])
def test_primal_cost_counts_the_gram_the_eigendecomposition_and_the_request(names, block):
    net = pretrained_cnn()
    lin = tangent_network(net, names)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    q = 17 if block else sum(p.numel() for n, p in net.named_parameters() if n in names)
    per = 1 if block else 3
    small = primal_cost(lin, x, y, 3, 5.0, block, 1000, 10)
    big = primal_cost(lin, x, y, 3, 5.0, block, 4000, 10)
    gram = lambda n: 2.0 * n * per * q * (q + 1.0) + 9.0 * q ** 3          # noqa: E731
    down = 2.0 * 10 * per * q ** 2 + q ** 3 / 3.0 + 6.0 * q ** 2
    assert small.flops == pytest.approx(gram(1000) + down) and big.flops == pytest.approx(gram(4000) + down)
    assert small.details["request_flops"] == big.details["request_flops"] == pytest.approx(down)
    for est, n in ((small, 1000), (big, 4000)):
        ps, pc = est.details["rows_seconds_per_sample"], est.details["rows_seconds_per_chunk"]
        assert ps >= 0 and pc >= 0 and ps + pc > 0
        assert est.details["request_seconds"] == pytest.approx(pc + 10 * ps + FLOAT64_SLOWDOWN * gemm_seconds(down))
        # the build is the rows of n samples (chunks of 256) at the rates this call measured, plus the Gram and the
        # eigendecomposition; compared with the estimate's own rates: two calls measure the rows apart, and on a
        # busy machine the second may time faster than the first
        rows = -(-n // 256) * pc + n * ps
        assert est.details["build_seconds"] == pytest.approx(rows + FLOAT64_SLOWDOWN * gemm_seconds(gram(n)))
        assert rows + FLOAT64_SLOWDOWN * gemm_seconds(gram(4 * n)) > est.details["build_seconds"]
