"""The fused residual add + RMSNorm + projection kernel (worker/model/norm_linear.py): against a
float64 reference of flashinfer's arithmetic in Triton's interpreter (CPU), its refusals by name,
and a whole model with it on against the unfused layers (CPU, and bf16 flashinfer on a GPU)."""

from __future__ import annotations

import pytest
import torch

from worker.model.norm_linear import (
    MAX_ROWS,
    Tiling,
    add_rms_norm_linear,
    linear_rows,
    tiling_for,
)

CUDA = torch.device("cuda")


def _case(rows, k, n, dtype, residual=True, bias=False, silu=False, seed=0, device="cpu", x_stride=None):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, x_stride or k, generator=g)
    x = wide[:, :k].to(dtype) if x_stride is None else wide.to(dtype)[:, :k]
    r = torch.randn(rows, k, generator=g).to(dtype) if residual else None
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(2 * n if silu else n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    on = [t if t is None else t.to(device) for t in (x, r, norm_w, w, b)]
    return on


def _expected(x, r, norm_w, w, b, eps, silu):
    """flashinfer's order in float64: the float32 sum (stored rounded), the norm of the unrounded
    sum, the normed row times the weight rounded once, a float64 GEMM, gate and up rounded."""
    dtype = x.dtype
    h = x.double() if r is None else (x.float() + r.float()).double()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.double()).to(dtype).double()
    y = normed @ w.double().T
    if b is not None:
        y = y + b.double()
    if silu:
        gate, up = y.to(dtype).double().chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    return y, (x if r is None else h.to(dtype))


def _close(got, want, dtype):
    """float32: to 1e-5 of the magnitude; 16-bit: within two output ulps (2**-7 relative in bf16).
    Triton's interpreter does not round float32 to bf16 to nearest (its casts land up to a unit
    off, toward zero: four casts of up to 2**-7 each on the SiLU path), so on CPU a 16-bit result is
    held to the whole vector's relative error instead, which a wrong row or weight would exceed
    a hundredfold."""
    want = want.float()
    if dtype != torch.float32 and got.device.type == "cpu":
        return ((got.float() - want).norm() / want.norm()).item() <= 3e-2
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    return ((got.float() - want).abs() <= want.abs().clamp_min(0.25) * 2 * tol).all()


def _same_sum(got, want):
    """The stored residual sum: exact, but within a unit of the interpreter's 16-bit casts on CPU."""
    if got.dtype != torch.float32 and got.device.type == "cpu":
        return ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
    return torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("residual, bias, silu", [(False, False, False), (True, False, False), (True, True, False),
                                                  (False, False, True), (True, False, True)])
def test_equals_flashinfers_arithmetic_in_the_interpreter(dtype, rows, residual, bias, silu):
    # K and N off every tile size, so the masked edges of both loops are exercised.
    x, r, norm_w, w, b = _case(rows, 200, 72, dtype, residual, bias, silu)
    before = [t.clone() for t in (x, r) if t is not None]
    out, new_residual = add_rms_norm_linear(x, r, norm_w, 1e-5, w, b, silu)
    want, want_residual = _expected(x, r, norm_w, w, b, 1e-5, silu)
    assert out.shape == (rows, 72) and out.dtype == dtype
    assert _close(out, want, dtype)
    if r is None:
        assert new_residual is x
    else:
        assert _same_sum(new_residual, want_residual)
    assert all(torch.equal(a, c) for a, c in zip(before, (t for t in (x, r) if t is not None)))  # inputs only read


@pytest.mark.parametrize("tiling", [Tiling(16, 16), Tiling(32, 64), Tiling(64, 256)])
def test_every_tiling_gives_the_same_result(tiling):
    x, r, norm_w, w, _ = _case(3, 96, 100, torch.float32, silu=True)
    out, _ = add_rms_norm_linear(x, r, norm_w, 1e-6, w, silu_mul=True, tiling=tiling)
    assert _close(out, _expected(x, r, norm_w, w, None, 1e-6, True)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_without_its_norm_is_a_plain_linear(dtype, bias):
    """``linear_rows``: the same kernel with the norm and residual switched off (o_proj, down)."""
    x, _, _, w, b = _case(5, 200, 72, dtype, residual=False, bias=bias)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert _close(linear_rows(x, w, b), want, dtype)
    with pytest.raises(ValueError, match="1-16 rows"):
        linear_rows(torch.zeros(17, 200, dtype=dtype), w)
    with pytest.raises(ValueError, match="does not fit weight"):
        linear_rows(x, w, torch.zeros(3, dtype=dtype))


def test_rows_may_be_a_strided_view():
    x, r, norm_w, w, _ = _case(4, 64, 48, torch.float32, x_stride=160)
    assert x.stride(0) == 160
    out, new_residual = add_rms_norm_linear(x, r, norm_w, 1e-5, w)
    want, want_residual = _expected(x, r, norm_w, w, None, 1e-5, False)
    assert _close(out, want, torch.float32) and torch.equal(new_residual, want_residual)
    assert new_residual.is_contiguous()


def test_default_tiling_keeps_registers_for_the_row_tile():
    # 16 weight rows a program; K steps of 256 for one row's vector product, 128 for tl.dot's 16 rows.
    assert tiling_for(2560, 2048, 1) == Tiling(16, 256)
    assert tiling_for(5632, 2048, 16) == Tiling(16, 128)
    assert tiling_for(72, 48, 3) == Tiling(16, 64)


@pytest.mark.parametrize("change, needle", [
    (lambda c: c.update(x=torch.zeros(MAX_ROWS + 1, 32)), "1-16 rows"),
    (lambda c: c.update(x=torch.zeros(0, 32)), "1-16 rows"),
    (lambda c: c.update(x=c["x"].double()), "one float dtype"),
    (lambda c: c.update(w=torch.zeros(8, 32, dtype=torch.int32), x=torch.zeros(2, 32, dtype=torch.int32)),
     "one float dtype"),
    (lambda c: c.update(norm_w=torch.ones(31)), "disagree on the input size"),
    (lambda c: c.update(w=torch.zeros(8, 40)), "disagree on the input size"),
    (lambda c: c.update(w=torch.zeros(9, 32), silu=True), "even row count"),
    (lambda c: c.update(r=torch.zeros(3, 32)), "does not match x"),
    (lambda c: c.update(b=torch.zeros(7)), "does not fit weight"),
    (lambda c: c.update(b=torch.zeros(8), silu=True), "silu_mul with a bias"),
    (lambda c: c.update(w=torch.zeros(32, 8).T), "contiguous"),
    (lambda c: c.update(x=torch.zeros(32, 2).T), "contiguous last dim"),
])
def test_bad_inputs_are_refused_by_name(change, needle):
    case = {"x": torch.randn(2, 32), "r": torch.randn(2, 32), "norm_w": torch.ones(32), "w": torch.randn(8, 32),
            "b": None, "silu": False}
    change(case)
    kept = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=needle):
        add_rms_norm_linear(case["x"], case["r"], case["norm_w"], 1e-5, case["w"], case["b"], case["silu"])
    assert all(torch.equal(v, case[k]) for k, v in kept.items())


def _decode_run(path, rows, dtype=torch.float32, device="cpu", backend="torch", kernels=None, rope=True):
    """A prefill of three prompts (more tokens than the kernel's rows: the unfused layers) and
    eight decode steps of three rows; returns (logits of every step, greedy tokens)."""
    from tests.reference import OwnModel, prefill_then_greedy

    own = OwnModel(path, dtype=dtype, device=device, backend=backend, kernels=kernels)
    own.model.use_norm_linear(rows, rope)
    assert all((layer._qkv_rope is not None) == (rows > 0 and rope and not own.arch.qk_norm)
               for layer in own.model.layers)
    return prefill_then_greedy(own, [list(range(3, 3 + n)) for n in (5, 17, 30)], 8)


@pytest.fixture
def one_thread():
    """One intra-op thread: a multi-threaded CPU GEMM may split its sums by however many threads it
    gets while the interpreter's numpy threads still spin, which moves float32 results by a few ulps
    from run to run; with one thread two runs of the same layers agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("preset, rope", [("tiny-llama", True), ("tiny-llama", False), ("tiny-qwen2", True),
                                          ("tiny-qwen3", True)])
def test_model_with_the_fused_layers_equals_the_unfused_ones(preset, rope, checkpoint_dir, one_thread):
    """float32 on CPU (the interpreter): Llama, Qwen2 (qkv bias, tied head) and Qwen3 (q/k norms:
    no RoPE in the qkv kernel) give the unfused layers' logits to 1e-5 and the same greedy tokens,
    with RoPE and the KV write in the qkv kernel (worker/model/norm_qkv_rope.py) and without; the
    prefill (30+ tokens) does not take the kernels and equals the unfused run exactly."""
    from tests.reference import rel_err

    path = checkpoint_dir(preset)
    off_logits, off_tokens = _decode_run(path, 0)
    on_logits, on_tokens = _decode_run(path, 4, rope=rope)
    assert on_tokens == off_tokens
    assert torch.equal(on_logits[0], off_logits[0])
    err = max(rel_err(a, b) for a, b in zip(on_logits[1:], off_logits[1:]))
    assert err <= 1e-5, err
    assert not all(torch.equal(a, b) for a, b in zip(on_logits[1:], off_logits[1:]))  # the kernel did run


def test_model_refuses_rows_past_the_kernels_tile(checkpoint_dir):
    from worker.model.loader import load_model

    model, _ = load_model(checkpoint_dir("tiny-llama"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="1-16"):
        model.use_norm_linear(MAX_ROWS + 1)
    assert all(layer.norm_linear_rows == 0 for layer in model.layers)


def test_config_key_rejects_rows_past_the_tile_by_name():
    from configkit import ConfigError
    from worker.config import ModelConfig

    assert ModelConfig(norm_linear_rows=16).norm_linear_rows == 16
    with pytest.raises(ConfigError, match="norm_linear_rows"):
        ModelConfig(norm_linear_rows=17)
    with pytest.raises(ConfigError, match="norm_linear_rows"):
        ModelConfig(norm_linear_rows=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, n, silu", [(2048, 2560, False), (2048, 5632, True), (4096, 6144, False),
                                        (4096, 14336, True)])
def test_gpu_kernel_equals_the_reference(dtype, k, n, silu):
    for rows in (1, 7, MAX_ROWS):
        x, r, norm_w, w, _ = _case(rows, k, n, dtype, silu=silu, device="cuda")
        out, new_residual = add_rms_norm_linear(x, r, norm_w, 1e-5, w, silu_mul=silu)
        want, want_residual = _expected(x, r, norm_w, w, None, 1e-5, silu)
        assert _close(out, want, dtype), (rows, (out.float() - want.float()).abs().max().item())
        assert _same_sum(new_residual, want_residual)


@pytest.mark.gpu
def test_gpu_kernel_replays_from_a_graph_with_new_inputs():
    x, r, norm_w, w, _ = _case(4, 2048, 5632, torch.bfloat16, silu=True, device="cuda")
    add_rms_norm_linear(x, r, norm_w, 1e-5, w, silu_mul=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_residual = add_rms_norm_linear(x, r, norm_w, 1e-5, w, silu_mul=True)
    x2, r2, *_ = _case(4, 2048, 5632, torch.bfloat16, silu=True, seed=1, device="cuda")
    x.copy_(x2)
    r.copy_(r2)
    graph.replay()
    torch.cuda.synchronize()
    want, want_residual = _expected(x2, r2, norm_w, w, None, 1e-5, True)
    assert _close(out, want, torch.bfloat16) and _same_sum(new_residual, want_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("preset, rope", [("tiny-llama", True), ("tiny-llama", False), ("tiny-qwen3", True)])
def test_gpu_model_with_the_fused_layers_equals_the_unfused_ones(preset, rope, checkpoint_dir):
    """bf16 on flashinfer, with RoPE and the KV write in the qkv kernel and without: the same greedy
    tokens, logits within bf16 noise."""
    pytest.importorskip("flashinfer")
    from tests.reference import rel_l2
    from worker.model.kernels import select_kernels

    path = checkpoint_dir(preset)
    runs = {rows: _decode_run(path, rows, torch.bfloat16, "cuda", "flashinfer", select_kernels(CUDA), rope)
            for rows in (0, MAX_ROWS)}
    assert runs[MAX_ROWS][1] == runs[0][1]
    err = rel_l2(torch.cat(runs[MAX_ROWS][0]), torch.cat(runs[0][0]))
    print(f"{preset} (rope in the kernel: {rope}): norm_linear vs unfused layers: logits rel L2 {err:.2e}")
    assert err <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_gpu_decode_graphs_with_the_fused_layers_match_eager(backend, checkpoint_dir):
    """Decode graphs captured with ``use_norm_linear(16)`` (bf16, flashinfer) against the eager step
    with the same setting, over 100 random batches of 1-16 rows padded into the ladder's shapes."""
    import random

    pytest.importorskip("flashinfer")
    from graphs.backends import create_backend
    from graphs.decode import DecodeGraphRunner
    from tests.graph_harness import eager_logits, fill_cache_randomly, random_decode_batch
    from tests.reference import OwnModel, rel_l2
    from worker.model.kernels import select_kernels
    from worker.model_steps import ModelDecodeStep

    own = OwnModel(checkpoint_dir("tiny-llama"), dtype=torch.bfloat16, device="cuda", backend="flashinfer",
                   num_pages=4096, kernels=select_kernels(CUDA), max_rows=32, max_pages_per_row=16)
    fill_cache_randomly(own)
    own.model.use_norm_linear(MAX_ROWS)
    step = ModelDecodeStep(own.model, own.attention, breakable=backend == "breakable")
    runner = DecodeGraphRunner(step, create_backend(backend, CUDA), [1, 2, 4, 8, 16])
    runner.capture_all(progress=False)
    assert not runner.failed, runner.failed
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, MAX_ROWS)
        batch = random_decode_batch(own, rng, n, 200)
        ref = eager_logits(own, batch).clone()
        got = runner.execute(batch.live, runner.decide(batch.live))
        assert rel_l2(got, ref) <= 2e-2, f"{backend}: batch {n}"
    assert sum(s.hits for s in runner.backend.shapes.values()) == 100
    runner.release()
