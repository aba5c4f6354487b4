"""Every tensor on the model's device: the --device choice, generators, and the protocol on each device.

CPU always; CUDA only when a GPU is present (skipped otherwise). On CUDA the numbers may differ from the
CPU ones by seed noise (other kernels, other generator streams); on the CPU they equal the default run's.
"""
import pytest
import torch
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.device import model_device, resolve_device, seeded_generator
from scrubnet.experiments.runner import measure, prepare_seed, run_method
from tests.conftest import tiny_config
from tests.cli.test_cli import TINY_TOML

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]
METHODS = ["original", "retrain", "finetune", "neggrad", "randomlabels", "fisher", "ntk-fisher", "newton"]


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_seeded_generator_gives_the_cpu_numbers_of_before():
    a = torch.randperm(50, generator=seeded_generator(123))
    b = torch.randperm(50, generator=torch.Generator().manual_seed(123))
    assert torch.equal(a, b)


@pytest.fixture(scope="module", params=DEVICES)
def seed_run(request):
    return request.param, prepare_seed(tiny_config(), 0, request.param)


def test_protocol_lives_on_the_device(seed_run):
    device, sr = seed_run
    for model in (sr.start, sr.original, sr.retrain):
        assert all(t.device.type == device for t in model.state_dict().values())
    assert sr.split.x.device.type == device and sr.split.forget_idx.device.type == device
    assert all(v.device.type == device for v in sr.ctx.center(sr.start).values())


@pytest.mark.parametrize("method", METHODS)
def test_methods_and_readouts_run_on_the_device(seed_run, method):
    device, sr = seed_run
    res, _ = run_method(method, sr)
    assert model_device(res.model).type == device
    readouts = measure(method, res, sr)
    assert all(isinstance(v, float) for v in readouts.values())
    assert 0.0 <= readouts["error_forget"] <= 1.0 and readouts["relearn_epochs"] >= 1
    if res.noise is not None:
        assert readouts["info_weights_nats"] >= 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_readouts_within_seed_noise_of_cpu():
    cpu, gpu = prepare_seed(tiny_config(), 0, "cpu"), prepare_seed(tiny_config(), 0, "cuda")
    for method in ("original", "retrain", "finetune"):
        a = measure(method, run_method(method, cpu)[0], cpu)
        b = measure(method, run_method(method, gpu)[0], gpu)
        for k in ("error_retain", "error_test", "mia_forget"):
            assert abs(a[k] - b[k]) <= 0.15, (method, k, a[k], b[k])


def test_cli_run_on_cpu_and_refuses_a_missing_gpu(tmp_path):
    runner = CliRunner()
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    r = runner.invoke(app, ["run", "--config", str(cfg), "--methods", "original,retrain", "--seeds", "1",
                            "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    if not torch.cuda.is_available():
        out = tmp_path / "run-cuda"
        r = runner.invoke(app, ["run", "--config", str(cfg), "--out", str(out), "--quiet", "--device", "cuda"])
        assert r.exit_code == 2 and "no CUDA device" in r.output and not out.exists()
    for cmd in (["train"], ["forget"], ["evaluate"], ["report"], ["sweep"], ["mlforget", "train"],
                ["mlforget", "forget"], ["mlforget", "forget-all"], ["mlforget", "show"]):
        assert "--device" in runner.invoke(app, [*cmd, "--help"]).output, cmd
