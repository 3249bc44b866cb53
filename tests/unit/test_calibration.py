"""Calibrating a topology on this machine (``python -m autopar calibrate``): the fits recover
known constants from timings made with them, and the command writes a topology the planner takes.
"""

from __future__ import annotations

import json
import random

import pytest

import autopar
from autopar.cost_models.calibration import (
    CollectiveSample, KernelSample, fit_compute, fit_link, predicted_kernel_time,
)
from autopar.cost_models.comm import collective_time
from autopar.cost_models.links import AxisLink
from autopar.cost_models.topology import custom, get_preset, load_topology


def _kernels(truth, noise: float, seed: int = 0) -> list[KernelSample]:
    """Matmuls of several shapes (some memory-bound) and pointwise ops, timed as ``truth``
    prices them, each off by up to ``noise`` (relative)."""
    rng = random.Random(seed)
    out = []
    for m, k, n in ((4096, 512, 512), (4096, 512, 2048), (64, 4096, 4096), (8, 8192, 8192)):
        out.append(KernelSample(f"mm {m}x{k}x{n}", 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n),
                                "fp32", 0.0, count=rng.randint(1, 8)))
    for numel in (2**12, 2**18, 2**22):
        out.append(KernelSample(f"add {numel}", 0.0, 12.0 * numel, "fp32", 0.0, count=3))
    return [KernelSample(k.name, k.flops, k.bytes, k.dtype,
                         predicted_kernel_time(k, truth) * (1 + rng.uniform(-noise, noise)), k.count)
            for k in out]


def test_fit_compute_recovers_the_efficiencies_the_timings_were_made_with():
    base = get_preset("h100-dgx")
    truth = custom("truth", base=base, matmul_efficiency=0.62, pointwise_efficiency=0.71)
    fit = fit_compute(_kernels(truth, noise=0.0), base)
    # exact timings: the fitted constants are the true ones (the bisection's tolerance)
    assert fit.matmul_efficiency == pytest.approx(0.62, rel=1e-6)
    assert fit.pointwise_efficiency == pytest.approx(0.71, rel=1e-9)
    assert fit.clamped == () and fit.peak_flops == base.peak_flops
    # 5% noise on every timing: the constants within 5% (each fit matches a weighted sum)
    noisy = fit_compute(_kernels(truth, noise=0.05, seed=1), base)
    assert noisy.matmul_efficiency == pytest.approx(0.62, rel=0.05)
    assert noisy.pointwise_efficiency == pytest.approx(0.71, rel=0.05)


def test_fit_compute_holds_an_efficiency_above_the_datasheet_at_one_and_says_so():
    base = get_preset("a100-dgx")
    # a device 20% faster than its datasheet peak on every kernel
    fast = [KernelSample(k.name, k.flops, k.bytes, k.dtype, k.seconds / 1.2, k.count)
            for k in _kernels(custom("t", base=base, matmul_efficiency=1.0,
                                     pointwise_efficiency=1.0), noise=0.0)]
    fit = fit_compute(fast, base)
    assert fit.matmul_efficiency == 1.0 and fit.pointwise_efficiency == 1.0
    assert [c.split(" ")[0] for c in fit.clamped] == ["pointwise_efficiency", "matmul_efficiency"]
    # a device far slower than any efficiency explains on the base's peaks: refused, not floored
    slow = [KernelSample(k.name, k.flops, k.bytes, k.dtype, k.seconds * 1e5, k.count) for k in fast]
    with pytest.raises(ValueError, match="more than a matmul efficiency"):
        fit_compute(slow, base)
    with pytest.raises(ValueError, match="matmuls"):
        fit_compute([k for k in fast if k.flops == 0], base)


def test_fit_compute_on_a_compiled_step_and_attention_left_to_measured_rates():
    base = get_preset("h100-dgx")
    truth = custom("truth", base=base, matmul_efficiency=0.62, pointwise_efficiency=0.71)
    kernels = _kernels(truth, noise=0.0)
    # the compiled program ran the pointwise ops' bytes in 80% of the time the ops took alone
    fused = 0.8 * sum(k.seconds * k.count for k in kernels if k.flops == 0)
    assert fit_compute(kernels, base, fused_seconds=fused).pointwise_efficiency == \
        pytest.approx(0.71 / 0.8, rel=1e-9)
    with pytest.raises(ValueError, match="fused_seconds"):
        fit_compute(kernels, base, fused_seconds=0.0)
    # the bytes the planner prices a compiled step with (half, fused), where they were counted
    halved = [KernelSample(k.name, k.flops, k.bytes, k.dtype, k.seconds, k.count, k.bytes / 2)
              for k in kernels]
    assert fit_compute(halved, base, fused_seconds=fused).pointwise_efficiency == \
        pytest.approx(0.71 / 0.8 / 2, rel=1e-9)
    assert fit_compute(halved, base).pointwise_efficiency == pytest.approx(0.71, rel=1e-9)
    # an attention kernel three times slower than a matmul of its FLOPs: left out of the matmul
    # fit where the base prices attention by its own rates, pulling the efficiency down elsewhere
    sdpa = KernelSample("aten._scaled_dot_product_flash_attention.default", 1e12, 1e8, "bf16",
                        3e12 / (base.peak_flops["bf16"] * 0.62), count=4)
    assert fit_compute(kernels + [sdpa], base).matmul_efficiency == pytest.approx(0.62, rel=1e-6)
    no_rates = custom("no-rates", base=base, attention_efficiency=())
    assert fit_compute(kernels + [sdpa], no_rates).matmul_efficiency < 0.5


def test_fit_link_recovers_launch_latency_and_a_bandwidth_per_kind():
    # reduce-scatter at a third of the others' bandwidth, as gloo's on a CPU
    truth = AxisLink(bandwidth_Bps=2.5e9, latency_s=1.5e-4, launch_s=3e-4,
                     bandwidth_by_kind={"reduce_scatter": 0.8e9})
    samples = [CollectiveSample(kind, float(nbytes), ranks,
                                collective_time(kind, nbytes, ranks, truth))
               for kind, ranks in (("all_reduce", 4), ("all_gather", 4), ("reduce_scatter", 4),
                                   ("send_recv", 2))
               for nbytes in (4, 4096, 2**18, 2**22, 2**24)]
    link = fit_link(samples)
    assert link.bandwidth_Bps == pytest.approx(2.5e9, rel=1e-6)
    assert link.bandwidth_for("reduce_scatter") == pytest.approx(0.8e9, rel=1e-6)
    assert link.bandwidth_for("all_gather") == pytest.approx(2.5e9, rel=1e-6)
    assert link.latency_s == pytest.approx(1.5e-4, rel=1e-6)
    assert link.launch_s == pytest.approx(3e-4, rel=1e-6)
    # the link prices every sample as measured (the calibrated times, not the preset's)
    assert all(collective_time(s.kind, s.nbytes, s.ranks, link) == pytest.approx(s.seconds, rel=1e-6)
               for s in samples)
    # timings whose unconstrained fit has a negative launch (0.1 ms less per call than the
    # link without one gives): the fit holds launch at 0 and refits latency and bandwidths
    free = AxisLink(bandwidth_Bps=1e9, latency_s=2e-4, launch_s=0.0)
    fast = [CollectiveSample(s.kind, s.nbytes, s.ranks,
                             collective_time(s.kind, s.nbytes, s.ranks, free) - 1e-4)
            for s in samples]
    fitted = fit_link(fast)
    assert fitted.launch_s == 0.0 and fitted.latency_s > 0
    assert fitted.bandwidth_Bps == pytest.approx(1e9, rel=0.05)
    with pytest.raises(ValueError, match="no positive time"):
        fit_link(fast[:-1] + [CollectiveSample("send_recv", 8.0, 2, 0.0)])
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([CollectiveSample("all_reduce", 4.0, 2, 1e-3)] * 3)


def test_a_link_bandwidth_per_kind_round_trips_and_is_checked():
    link = AxisLink(1e9, 1e-5, 1e-5, bandwidth_by_kind={"all_gather": 2e9})
    assert AxisLink.from_dict(link.to_dict()) == link and link.bandwidth_for("all_reduce") == 1e9
    assert "bandwidth_by_kind" not in AxisLink(1e9, 0, 0).to_dict()  # older files unchanged
    old = {"bandwidth_Bps": 4e8, "latency_s": 2.5e-4, "launch_s": 1e-3}  # a file from before
    assert AxisLink.from_dict(old) == AxisLink(4e8, 2.5e-4, 1e-3)
    with pytest.raises(ValueError, match="expects a mapping"):
        AxisLink.from_dict([4e8])
    with pytest.raises(ValueError, match="unknown collective kind"):
        AxisLink(1e9, 0, 0, bandwidth_by_kind={"broadcast": 1e9})


def test_a_topology_file_is_taken_wherever_a_preset_name_is(tmp_path):
    topo = custom("my-cluster", base="h100-dgx", matmul_efficiency=0.5)
    path = tmp_path / "my.json"
    path.write_text(json.dumps(topo.to_dict()))
    assert load_topology(str(path)) == topo and load_topology(path) == topo
    mesh = autopar.Mesh.virtual(str(path), nodes=2, gpus_per_node=8)
    assert mesh.topology.matmul_efficiency == 0.5 and mesh.topology.name == "my-cluster"
    with pytest.raises(ValueError, match="neither a registered preset"):
        load_topology(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_topology(str(tmp_path / "bad.json"))


def test_calibrate_command_writes_a_topology_the_planner_takes(tmp_path, capsys, model_module):
    """The whole command on 2 CPU processes (gloo), quick: every operator of a small GPT timed
    (none refused by synthetic inputs), the collectives fitted, and the file planned with."""
    from autopar.cli import main
    from autopar.model_presets import load_model

    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--out", str(out), "--model", "mymodel:make", "--batch", "4",
                 "--seq", "16", "--nproc", "2", "--quick"]) == 0
    text = capsys.readouterr().out
    assert "not timed" not in text and "matmuls" in text and "all_reduce" in text, text
    topo = load_topology(str(out))
    assert topo.device_type == "cpu" and topo.gpus_per_node == 2
    assert 0 < topo.matmul_efficiency <= 1 and 0 < topo.pointwise_efficiency <= 1
    assert topo.intra_node.bandwidth_Bps > 0 and topo.intra_node.bandwidth_by_kind  # per kind
    assert "operators of mymodel:make" in topo.notes
    model, inputs = load_model("mymodel:make", 4, 16)
    plan = autopar.plan(model, autopar.Mesh.virtual(str(out), gpus_per_node=2), inputs)
    assert plan.predicted["step_time_s"] > 0 and plan.topology == topo.name


def test_a_model_built_under_fake_tensor_mode_is_given_real_weights_to_compile():
    # the compiled-step timing (calibrate --compiled) runs the model: a preset's fake weights
    # would be read as memory never allocated (an illegal address on a GPU)
    import torch

    from autopar._torch_private import FakeTensor, FakeTensorMode
    from autopar.calibrate import materialize

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                    torch.nn.Linear(16, 16))
        model.register_buffer("scale", torch.ones(16))
    model[1].weight.requires_grad_(False)
    model[2].bias = model[1].bias  # tied, as an LM head and its embedding are
    materialize(model, torch.device("cpu"))
    assert model[2].bias is model[1].bias
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and not any(isinstance(t, FakeTensor) for t in tensors)
    assert isinstance(model[0].weight, torch.nn.Parameter) and not model[1].weight.requires_grad
    assert 0 < float(model[0].weight.detach().std()) < 0.05  # N(0, 0.02), not N(0, 1)
    out = model[1](model[0](torch.randn(4, 8))) * model.scale
    assert torch.isfinite(out).all()


def test_model_kernels_count_the_bytes_a_compiler_fuses_away():
    import torch

    from autopar.calibrate import model_kernels

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):  # a matmul, then a chain of pointwise ops: gelu(x @ w) * 2 + 1
            return (torch.nn.functional.gelu(x @ self.w) * 2 + 1).sum()

    kernels = [k for k, _ in model_kernels(Chain(), (torch.randn(32, 64),))]
    pointwise = [k for k in kernels if k.flops == 0]
    assert all(k.fused_bytes is not None and k.fused_bytes <= k.bytes for k in kernels)
    # the chain's intermediate values stay in registers: fewer bytes in all
    assert sum(k.fused_bytes * k.count for k in pointwise) < sum(k.bytes * k.count for k in pointwise)


def test_the_compiled_calibration_asks_for_a_model_and_a_gpu():
    from autopar.calibrate import calibrate

    with pytest.raises(ValueError, match="compiled=True"):
        calibrate(None, compiled=True)
