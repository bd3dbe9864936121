"""The fused attention-sink epilogue (kernels/_sink_triton) against the float64 formula, per row and head:
on the GPU (where _common.with_sinks routes CUDA tensors to it), and on the CPU under Triton's
interpreter where Triton is installed (a subprocess: the interpreter is chosen when the kernel is built).

Tolerance, per element: the kernel computes the factor sigmoid(a - s), a = lse * scale, in float32 and
rounds the product once to o's dtype, so |out - exact| <= (u + e) |exact| + u * tiny, with u the unit
roundoff of o's dtype (2^-8 bf16, 2^-11 fp16, 2^-24 float32; u * tiny: half the spacing of its
subnormals, for products that underflow), and e the factor's float32 error. The argument a - s carries
the roundings of scale (ln 2 in float32), of lse * scale and of the subtraction, and exp's own product
x * log2(e): at most 2^-24 (4 |a| + 2 |s|) in all; an error d in the argument moves sigmoid by a relative
(1 - sigmoid) d <= d; exp (ex2.approx), 1 + exp, the division and the product with o add a few ulps (8
allowed): e = 2^-24 (4 |a| + 2 |s| + 8)."""

import math

import numpy as np
import pytest
import torch

from tests.helpers import fresh_seed
from tests.support.interpreted import run_interpreted

U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
SHAPES = ((1, 8, 64), (7, 64, 64), (300, 8, 128), (33, 4, 80), (5, 16, 256))


def _inputs(seed, T, H, D, dtype, device):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(T, H, D, generator=g).to(dtype)
    lse = (3.0 * torch.randn(T, H, generator=g) + 2.0).float()  # around the sinks' scale: sigmoid far from 0 and 1
    sinks = (1.0 + 2.0 * torch.randn(H, generator=g)).float()
    return o.to(device), lse.to(device), sinks.to(device)


def _check(out, o, lse, sinks, scale, seed, rounding=1.0):
    """Every (row, head, element) of out within rounding * u of o * sigmoid(lse * scale - sinks) computed
    in float64 (rounding 2: a cast that truncates, as Triton's interpreter does to bfloat16, errs by
    up to one ulp = 2u instead of half of one)."""
    arg = lse.double() * scale
    exact = o.double() * torch.sigmoid(arg - sinks.double())[..., None]
    err = (out.double() - exact).abs()
    factor = 2.0**-24 * (4 * arg.abs() + 2 * sinks.double().abs()[None, :] + 8)[..., None]
    u = rounding * U[o.dtype]
    bound = (u + factor) * exact.abs() + u * torch.finfo(o.dtype).tiny
    ratio = err / bound
    worst, at = ratio.max().item(), ratio.argmax().item()
    t, h = at // (o.shape[1] * o.shape[2]), at // o.shape[2] % o.shape[1]
    assert worst <= 1.0, (f"seed {seed}, shape {tuple(o.shape)}, {o.dtype}: error {worst:.2f}x its bound at token {t} "
                          f"head {h} (lse * scale {arg[t, h].item():.4g}, sink {sinks[h].item():.4g}, exact "
                          f"{exact.flatten()[at].item():.6g}, got {out.flatten()[at].item():.6g})")
    moved = (out.double() - o.double()).abs().max().item()
    assert moved > 0.1, f"seed {seed}: the sinks changed nothing ({moved})"  # (they were applied, not dropped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_epilogue_on_cuda_matches_the_formula(dtype):
    from mstar_attn.kernels import _common, _sink_triton

    seed = fresh_seed()
    for i, (T, H, D) in enumerate(SHAPES):
        o, lse, sinks = _inputs(seed + i, T, H, D, dtype, "cuda")
        assert _sink_triton.available(o, lse, sinks), "Triton does not serve CUDA here: sinks would take six launches"
        assert not _sink_triton.available(o, lse[:, :1].contiguous(), sinks)  # (misfit shapes: the torch path's to refuse)
        assert not _sink_triton.available(o, lse, torch.cat([sinks, sinks]))
        for base2 in (False, True):
            out = _common.with_sinks(o, lse, sinks, lse_base2=base2, fused=True)
            assert out.dtype == dtype and out.shape == o.shape
            _check(out, o, lse, sinks, math.log(2) if base2 else 1.0, seed + i)
    empty = torch.empty(0, 8, 64, dtype=dtype, device="cuda")
    assert _common.with_sinks(empty, torch.empty(0, 8, device="cuda"), sinks[:8].contiguous(), fused=True).shape == (0, 8, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_epilogue_replays_in_a_graph():
    from mstar_attn.kernels import _common

    seed = fresh_seed()
    o, lse, sinks = _inputs(seed, 64, 64, 64, torch.bfloat16, "cuda")
    _common.with_sinks(o, lse, sinks, lse_base2=True, fused=True)  # (compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _common.with_sinks(o, lse, sinks, lse_base2=True, fused=True)
    o2, lse2, sinks2 = _inputs(seed + 1, 64, 64, 64, torch.bfloat16, "cuda")
    o.copy_(o2), lse.copy_(lse2), sinks.copy_(sinks2)
    graph.replay()
    _check(out, o2, lse2, sinks2, math.log(2), seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_first_use_inside_a_capture_or_a_failing_kernel_takes_the_torch_path(monkeypatch):
    """The kernel's first launch for a head dim cannot load its module inside a graph capture: that capture
    records the torch path, right all the same. A kernel whose launch raises is warned about once and
    never tried again for that key; the torch path serves."""
    from mstar_attn.kernels import _common, _sink_triton

    seed = fresh_seed()
    o, lse, sinks = _inputs(seed, 8, 8, 40, torch.bfloat16, "cuda")  # (head dim 40: launched by no other test)
    key = _sink_triton.launch_key(o, lse, sinks)
    _sink_triton._launched.discard(key)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _common.with_sinks(o, lse, sinks, lse_base2=True, fused=True)
    graph.replay()
    _check(out, o, lse, sinks, math.log(2), seed)
    assert key not in _sink_triton._launched, "a launch inside the capture"

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler here")

    o, lse, sinks = _inputs(seed, 8, 8, 24, torch.bfloat16, "cuda")
    key = _sink_triton.launch_key(o, lse, sinks)
    monkeypatch.setattr(_sink_triton, "_kernel", lambda: (__import__("triton"), Broken()))
    monkeypatch.setattr(_sink_triton, "_failed", set())
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        _check(_common.with_sinks(o, lse, sinks, fused=True), o, lse, sinks, 1.0, seed)
    assert key in _sink_triton._failed
    _check(_common.with_sinks(o, lse, sinks, fused=True), o, lse, sinks, 1.0, seed)  # (no second warning, no raise)


_INTERPRETED = """
import math, sys, torch
sys.path.insert(0, {root!r})
from mstar_attn.kernels import _sink_triton
from tests.kernels.test_sink_triton import SHAPES, _check, _inputs
seed = {seed}
for i, (T, H, D) in enumerate(SHAPES):
    for dtype in (torch.bfloat16, torch.float32):
        o, lse, sinks = _inputs(seed + i, T, H, D, dtype, "cpu")
        out = _sink_triton.apply(o, lse, sinks, math.log(2))  # (the interpreter truncates to bfloat16)
        _check(out, o, lse, sinks, math.log(2), seed + i, rounding=2.0 if dtype == torch.bfloat16 else 1.0)
print("ok")
"""


def test_fused_epilogue_under_the_triton_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED, fresh_seed())


def test_cpu_tensors_and_the_reference_take_the_torch_path():
    """On the CPU with_sinks never launches Triton (fused or not), and its torch path meets the same bound."""
    from mstar_attn.kernels import _common, _sink_triton

    seed = fresh_seed()
    o, lse, sinks = _inputs(seed, 9, 8, 64, torch.bfloat16, "cpu")
    assert not _sink_triton.available(o, lse, sinks)
    _check(_common.with_sinks(o, lse, sinks, lse_base2=True, fused=True), o, lse, sinks, math.log(2), seed)
    assert np.isfinite(_common.with_sinks(o, lse, sinks).float().numpy()).all()
