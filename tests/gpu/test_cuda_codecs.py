"""xcomm's CUDA codec kernels against its CPU codecs, bit for bit (GPU only).

The CPU codecs are the reference: they are tested against the math and
against torch elsewhere (tests/python). On a GPU bucket the same codec
object runs its CUDA kernels (csrc/compress/cuda), which must produce the
same payload bytes, the same residual bits and the same decoded bits, step
after step of error feedback, including chunks that hold NaN/Inf, chunk
sizes that leave the scales unaligned or overflow the registers, ties in
top-k, and every world size's shard layout. Float results are compared as
bits (``view(torch.int32)``), except that NaN equals NaN: arithmetic on a NaN
yields the GPU's canonical NaN (0x7fffffff) where an x86 CPU passes the
input's NaN on (0x7fc00000), and a NaN's payload carries no meaning.
"""

from __future__ import annotations

import pytest
import torch

from xcomm import _C

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.cuda_codecs),
    reason="needs a GPU and xcomm built with its CUDA kernels",
)

DEV = "cuda"


def _bits_equal(gpu: torch.Tensor, cpu: torch.Tensor, what: str) -> None:
    gpu = gpu.cpu()
    assert gpu.shape == cpu.shape, f"{what}: shape {tuple(gpu.shape)} != {tuple(cpu.shape)}"
    both_nan = torch.zeros(cpu.shape, dtype=torch.bool)
    if cpu.dtype == torch.float32:
        both_nan = gpu.isnan() & cpu.isnan()
        gpu, cpu = gpu.view(torch.int32), cpu.view(torch.int32)
    diff = ((gpu != cpu) & ~both_nan).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} of {cpu.numel()} entries differ, first at {diff[0].tolist()}"
    )


def _input(n: int, seed: int, kind: str = "normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct magnitudes, many zeros: top-k's ties by index
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "layers":  # stretches of 4096 at scales 1e-3..10: large entries crowd together
        scales = 10 ** (4 * torch.rand((n + 4095) // 4096, generator=g) - 3)
        return torch.randn(n, generator=g) * scales.repeat_interleave(4096)[:n]
    x = torch.randn(n, generator=g)
    if kind == "special" and n > 10:
        x[3] = float("nan")
        x[n // 2] = float("inf")
        x[n // 3] = -0.0
    return x


@pytest.mark.parametrize("chunk", [1024, 100, 5000])
@pytest.mark.parametrize("n", [1, 1000, 70_001])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("kind", ["normal", "special"])
def test_int8_equals_the_cpu_codec(chunk: int, n: int, world: int, kind: str) -> None:
    codec = _C.Int8Codec(chunk)
    fb_cpu, fb_gpu = _C.ErrorFeedback(), _C.ErrorFeedback()
    shard = codec.shard_elems(n, world)
    for step in range(3):
        x = _input(n, step, kind)
        p_cpu = codec.pack_shards_with_feedback(x, world, fb_cpu, 7)
        p_gpu = codec.pack_shards_with_feedback(x.to(DEV), world, fb_gpu, 7)
        assert p_gpu.is_cuda
        _bits_equal(p_gpu, p_cpu, f"step {step}: payload")
        _bits_equal(fb_gpu.get(7), fb_cpu.get(7), f"step {step}: residual")
        _bits_equal(codec.pack_shards(x.to(DEV), world), codec.pack_shards(x, world), "no EF")
        # The reduce-scatter's second half: the "received" rows are this
        # rank's shards standing in for every rank's version of one shard.
        rows = p_cpu[:, : codec.packed_bytes(shard)].contiguous()
        _bits_equal(
            codec.reduce_and_pack(rows.to(DEV), shard, float(world)),
            codec.reduce_and_pack(rows, shard, float(world)),
            f"step {step}: reduce_and_pack",
        )
        _bits_equal(
            codec.reduce_shards(rows.to(DEV), shard),
            codec.reduce_shards(rows, shard),
            f"step {step}: reduce_shards",
        )
        out_cpu = torch.empty(n)
        out_gpu = torch.empty(n, device=DEV)
        codec.unpack_all(p_cpu, shard, out_cpu)
        codec.unpack_all(p_gpu, shard, out_gpu)
        _bits_equal(out_gpu, out_cpu, f"step {step}: decode")


def test_int8_rows_and_single_pack_equal_the_cpu_codec() -> None:
    codec = _C.Int8Codec(256)
    x = _input(4 * 3000, 1)
    fb_cpu, fb_gpu = _C.ErrorFeedback(), _C.ErrorFeedback()
    for _ in range(2):
        _bits_equal(
            codec.pack_rows(x.to(DEV), 4, fb_gpu, 1), codec.pack_rows(x, 4, fb_cpu, 1), "rows"
        )
        _bits_equal(fb_gpu.get(1), fb_cpu.get(1), "rows residual")
    _bits_equal(codec.pack(x[:777].to(DEV)), codec.pack(x[:777]), "pack")


@pytest.mark.parametrize("n", [1, 999, 100_003])
@pytest.mark.parametrize("density", [0.01, 0.3, 1.0])
def test_randomk_equals_the_cpu_codec(n: int, density: float) -> None:
    codec = _C.RandomKCodec(5, False)
    fb_cpu, fb_gpu = _C.ErrorFeedback(), _C.ErrorFeedback()
    for step in range(3):
        pos_cpu = codec.positions(3, step, n, density)
        pos_gpu = codec.positions(3, step, n, density, torch.device(DEV))
        assert pos_gpu.is_cuda
        _bits_equal(pos_gpu, pos_cpu, f"step {step}: positions")
        x = _input(n, step, "special")
        v_cpu = codec.encode_with_feedback(3, x, pos_cpu, fb_cpu)
        v_gpu = codec.encode_with_feedback(3, x.to(DEV), pos_gpu, fb_gpu)
        _bits_equal(v_gpu, v_cpu, f"step {step}: values")
        _bits_equal(fb_gpu.get(3), fb_cpu.get(3), f"step {step}: residual")
        out_cpu, out_gpu = torch.empty(n), torch.empty(n, device=DEV)
        codec.decode(v_cpu * 3, pos_cpu, out_cpu, 3.0)
        codec.decode(v_gpu * 3, pos_gpu, out_gpu, 3.0)
        _bits_equal(out_gpu, out_cpu, f"step {step}: decode")


def _topk_cases() -> list[tuple[int, float, str]]:
    cases = [
        (n, density, kind)
        for n in (1, 5000, 300_007)
        for density in (0.001, 0.01, 0.3, 1.0)
        for kind in ("normal", "ties", "special", "layers")
    ]
    # Large buckets at low density: the sampled path's home.
    cases += [(2_000_003, d, kind) for d in (0.001, 0.01) for kind in ("normal", "layers")]
    return cases


def _topk_matches_the_cpu_codec(
    inputs: list[torch.Tensor], k: int, segments: list[int] | None = None, route: str | None = None
) -> None:
    """Encodes ``inputs`` as successive steps with error feedback on the CPU
    and on the GPU (per tensor over ``segments`` when given), and checks the
    payloads, the residuals and the decode of all three payloads (standing in
    for three ranks', with overlapping indices) bit for bit; ``route``: the
    GPU selection expected (``last_selection()``)."""
    codec = _C.TopKCodec(False, False)
    extra = [segments] if segments is not None else []
    fb_cpu, fb_gpu = _C.ErrorFeedback(), _C.ErrorFeedback()
    payloads_cpu, payloads_gpu = [], []
    for step, x in enumerate(inputs):
        p_cpu = codec.encode_with_feedback(0, x, k, fb_cpu, *extra)
        p_gpu = codec.encode_with_feedback(0, x.to(DEV), k, fb_gpu, *extra)
        assert p_gpu.is_cuda
        if route is not None:
            assert codec.last_selection()["route"] == route
        # [k int32 indices | k float32 values]
        _bits_equal(p_gpu[: 4 * k].view(torch.int32), p_cpu[: 4 * k].view(torch.int32), "indices")
        _bits_equal(
            p_gpu[4 * k :].view(torch.float32), p_cpu[4 * k :].view(torch.float32), "values"
        )
        _bits_equal(fb_gpu.get(0), fb_cpu.get(0), f"step {step}: residual")
        payloads_cpu.append(p_cpu)
        payloads_gpu.append(p_gpu)
    n = inputs[0].numel()
    out_cpu, out_gpu = torch.empty(n), torch.empty(n, device=DEV)
    codec.decode(torch.stack(payloads_cpu), k, out_cpu, 3.0)
    codec.decode(torch.stack(payloads_gpu), k, out_gpu, 3.0)
    _bits_equal(out_gpu, out_cpu, "decode")


@pytest.mark.parametrize("select", ["radix", "sampled"])
@pytest.mark.parametrize("n,density,kind", _topk_cases())
def test_topk_equals_the_cpu_codec(
    n: int, density: float, kind: str, select: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both selections: with XCOMM_TOPK_SELECT=radix the radix select over
    every entry, and by default a sampled threshold and candidates where the
    bucket is large and k small (the radix select otherwise, and where the
    sample misled, as ties make it)."""
    if select == "radix":
        monkeypatch.setenv("XCOMM_TOPK_SELECT", "radix")
    else:
        monkeypatch.delenv("XCOMM_TOPK_SELECT", raising=False)
    k = _C.TopKCodec.k_for(n, density)
    _topk_matches_the_cpu_codec([_input(n, step, kind) for step in range(3)], k)


@pytest.mark.parametrize("kind", ["normal", "layers"])
def test_topk_per_tensor_equals_the_cpu_codec(kind: str) -> None:
    """Per tensor a GPU bucket takes at::topk per segment (the CUDA kernels
    select bucket-wide): without ties, the CPU scan's payload, residual and
    decode, bit for bit, its indices ascending for the CUDA decode."""
    n, sizes = 300_007, [7, 100_000, 4096, 195_904]
    x0 = _input(n, 0, kind)
    x0[100_007:104_103] = 0.0  # a tensor of zeros: by its share, k_i = 0
    k = _C.TopKCodec.k_for(n, 0.01)
    inputs = [x0, _input(n, 1, kind), _input(n, 2, kind)]
    _topk_matches_the_cpu_codec(inputs, k, sizes, route="torch")


def test_kernels_run_on_the_callers_stream() -> None:
    """Work queued on a side stream is ordered by that stream, not the default one."""
    codec = _C.Int8Codec(1024)
    x = _input(1 << 20, 0)
    staged = x.to(DEV)
    src = torch.zeros_like(staged)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # holds the side stream back
        src.copy_(staged)  # so a kernel on any other stream would read zeros
        packed = codec.pack_shards(src, 1)
        out = torch.empty_like(src)
        codec.unpack_all(packed, codec.shard_elems(src.numel(), 1), out)
    side.synchronize()
    _bits_equal(out, codec.round_trip(x), "round trip on a side stream")


def test_auto_times_its_codecs_on_the_gpu_and_offers_them_there() -> None:
    """auto's cost model calibrates the codecs where the buckets are: on the
    GPU its int8 and top-k cost far less per element than on the host, and
    a GPU bucket on a slow link may then choose a compressor."""
    from xcomm import hooks
    from xcomm.hooks.auto import METHODS, calibrate_codecs

    gpu = calibrate_codecs(numel=1 << 22, device=torch.device(DEV))
    cpu = calibrate_codecs(numel=1 << 22)
    assert set(gpu) == set(cpu)
    for key, cost in gpu.items():
        assert 0 < cost < float("inf"), f"{key}: {cost}"
    assert gpu["int8"] < cpu["int8"] / 5 and gpu["topk"] < cpu["topk"] / 5, (gpu, cpu)
    state = hooks.AutoState(methods=METHODS)
    assert state.candidates("cuda") == state.allowed
    link = hooks.LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=1.25e8)  # 1 Gbit/s
    predicted = state._predict(0, 1 << 22, [(2048, 2048)], 4, "cuda", 2, link, gpu)
    assert min(predicted, key=predicted.get) not in ("none", "bf16", "fp16"), predicted


# -- PowerSGD's products (XCOMM_POWERSGD_MATMUL=xcomm) -----------------------


def _matrix_of_bucket(rows: int, cols: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """A rows x cols matrix inside a flat bucket at `offset` entries, as the
    codec slices it: an offset not a multiple of 4 leaves it without 16-byte
    alignment, which the kernels must not assume."""
    g = torch.Generator().manual_seed(rows * 7 + cols)
    flat = torch.randn(offset + rows * cols + 3, generator=g, dtype=dtype).to(DEV)
    return flat.narrow(0, offset, rows * cols).view(rows, cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "rows,cols,rank,offset",
    [
        (2048, 2048, 4, 0),  # a transformer-sized layer: 8 column steps per block
        (2048, 2048, 4, 1),  # the same, unaligned
        (8, 27, 2, 0),  # a small conv kernel: one partial column step
        (1000, 37, 1, 5),
        (37, 1000, 3, 0),  # rank not a power of two
        (300, 64, 17, 2),  # rank past 16
        (4096, 96, 32, 0),  # the largest rank; many row stretches in M^T P
        (5, 3, 3, 0),
    ],
)
def test_powersgd_products_match_torch_mm(
    rows: int,
    cols: int,
    rank: int,
    offset: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P = M Q and Q = M^T P from xcomm's kernels equal torch.mm up to the
    summation order, are deterministic (the same bits twice), keep Q where
    P was not finite, and are declined (False) unless asked for."""
    m = _matrix_of_bucket(rows, cols, offset, dtype)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(cols, rank, generator=g, dtype=dtype).to(DEV)
    p = torch.empty(rows, rank, dtype=dtype, device=DEV)
    monkeypatch.delenv("XCOMM_POWERSGD_MATMUL", raising=False)
    assert not _C._powersgd_project(p, m, q), "ran without XCOMM_POWERSGD_MATMUL=xcomm"
    monkeypatch.setenv("XCOMM_POWERSGD_MATMUL", "xcomm")

    assert _C._powersgd_project(p, m, q)
    first = p.clone()
    assert _C._powersgd_project(p, m, q)
    assert torch.equal(p, first), "P = M Q is not deterministic"

    def close(got: torch.Tensor, want64: torch.Tensor) -> None:
        # Rounding errors scale with the sums' terms: relative to the largest entry.
        rel = 1e-4 if dtype == torch.float32 else 1e-12
        scale = float(want64.abs().max()) or 1.0
        torch.testing.assert_close(got.double(), want64, rtol=rel, atol=rel * scale)

    close(p, m.double() @ q.double())

    finite = torch.ones((), dtype=torch.bool, device=DEV)
    q_new = torch.full_like(q, 7.0)
    assert _C._powersgd_project_back(q_new, m, p, finite)
    again = torch.full_like(q, -1.0)
    assert _C._powersgd_project_back(again, m, p, finite)
    assert torch.equal(q_new, again), "Q = M^T P is not deterministic"
    close(q_new, m.double().t() @ p.double())

    kept = q.clone()
    assert _C._powersgd_project_back(kept, m, p, torch.zeros((), dtype=torch.bool, device=DEV))
    assert torch.equal(kept, q), "Q changed although P was not finite"


def test_powersgd_products_decline_what_they_do_not_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half precision, rank above 32, mismatched shapes, host tensors: False,
    nothing written (the codec then calls torch.mm)."""
    monkeypatch.setenv("XCOMM_POWERSGD_MATMUL", "xcomm")
    m = torch.randn(64, 48, device=DEV)

    def out(rows: int, rank: int, device: str = DEV) -> torch.Tensor:
        return torch.full((rows, rank), 5.0, device=device)

    cases = [
        (out(64, 4).half(), m.half(), torch.randn(48, 4, device=DEV).half()),
        (out(64, 33), m, torch.randn(48, 33, device=DEV)),
        (out(63, 4), m, torch.randn(48, 4, device=DEV)),
        (out(64, 4, "cpu"), m.cpu(), torch.randn(48, 4)),
        (out(64, 4), m.t(), torch.randn(64, 4, device=DEV)),  # not contiguous
    ]
    for p, mm, q in cases:
        assert not _C._powersgd_project(p, mm, q), (p.shape, mm.shape, q.shape, p.dtype)
        assert bool((p == 5.0).all()), "a declined product wrote its output"


def _gram_schmidt_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's hook's steps in double: each column divided by (its norm +
    eps), then taken out of the later ones."""
    y = x.double().clone()
    for i in range(y.shape[1]):
        col = y[:, i : i + 1]
        col /= col.norm() + eps
        if i + 1 < y.shape[1]:
            rest = y[:, i + 1 :]
            rest -= (col * rest).sum(0, keepdim=True) * col
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gram_schmidt_batch_matches_torch_steps_and_flags_non_finite(dtype: torch.dtype) -> None:
    """Every P of a bucket in one call: matrices the register kernel holds
    (several ranks), one too tall for it and one of too high a rank (the
    global-memory kernel), an empty one, and two that are not finite."""
    shapes = [(2048, 4), (300, 4), (8193, 4), (50, 1), (40, 20), (1000, 4), (0, 4), (64, 8)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(r, c, generator=g, dtype=dtype) for r, c in shapes]
    xs[5][17, 2] = float("inf")
    xs[7][3, 0] = float("nan")
    wants = [_gram_schmidt_reference(x, 1e-8) for x in xs]
    on_gpu = [x.to(DEV) for x in xs]
    finite = torch.zeros(len(xs), dtype=torch.bool, device=DEV)
    assert _C._gram_schmidt_batch(on_gpu, 1e-8, finite)
    assert finite.cpu().tolist() == [True, True, True, True, True, False, True, False]
    tol = 2e-4 if dtype == torch.float32 else 1e-10
    for i, (got, want) in enumerate(zip(on_gpu, wants)):
        if finite[i] and got.numel():
            err = (got.cpu().double() - want).abs().max().item()
            assert err <= tol, f"matrix {i} {tuple(got.shape)}: off by {err}"
    assert not _C._gram_schmidt_batch([torch.zeros(4, 2, device=DEV).half()], 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_error", [False, True])
def test_powersgd_unpacking_equals_the_aten_ops_it_replaces(
    dtype: torch.dtype, with_error: bool
) -> None:
    """The uncompressed tensors after their allreduce: one kernel, bit for bit
    what the ATen route's ops give on the GPU (a division by the world size,
    the residual where the average is finite, two scatters), NaN and Inf in
    the sums included."""
    g = torch.Generator().manual_seed(5)
    n_bucket, world = 5000, 3
    index = torch.cat([torch.arange(10, 1210), torch.arange(3000, 3777)]).to(DEV)
    n = index.numel()
    buffer = torch.randn(n_bucket, generator=g).to(dtype).to(DEV)
    wire = (torch.randn(n + 40, generator=g) * 3).to(dtype).to(DEV)  # P follows in the wire
    wire[7], wire[900] = float("nan"), float("-inf")
    error = torch.randn(n_bucket, generator=g).to(dtype).to(DEV) if with_error else None

    want_buffer, want_error = buffer.clone(), None if error is None else error.clone()
    avg = wire[:n].div(world)
    if want_error is not None:
        grad, err = want_buffer.index_select(0, index), want_error.index_select(0, index)
        want_error.index_copy_(0, index, torch.where(torch.isfinite(avg), grad - avg, err))
    want_buffer.index_copy_(0, index, avg)

    assert _C._powersgd_unpack_uncompressed(buffer, error, wire, index, world)
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)

    def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        differ = (got.view(as_int) != want.view(as_int)) & ~(got.isnan() & want.isnan())
        assert not bool(differ.any()), f"{what}: {int(differ.sum())} entries differ"

    same(buffer, want_buffer, "bucket")
    assert bool(buffer[17].isnan()), "the NaN sum's entry"  # wire[7] -> bucket entry 10 + 7
    if error is not None:
        same(error, want_error, "residual")


def test_powersgd_device_route_keeps_error_feedback_when_p_is_not_finite() -> None:
    """A NaN in one matrix's gradient: that matrix comes back NaN, as on the
    CPU route and in torch's hook; the other matrix and the error feedback
    of both follow the CPU route."""
    shapes = [(64, 48), (100, 30)]
    sizes = [r * c for r, c in shapes]

    def bucket(device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        buf = torch.zeros(sum(sizes), device=device)
        grads, at = [], 0
        for (r, c), n in zip(shapes, sizes):
            grads.append(buf[at : at + n].view(r, c))
            at += n
        return buf, grads

    codecs = {d: _C.PowerSgdCodec(matrix_approximation_rank=4) for d in ("cpu", DEV)}
    buckets = {d: bucket(d) for d in codecs}
    for step in range(3):
        g = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(step))
        if step == 1:
            g[5] = float("nan")
        for d, codec in codecs.items():
            buf, grads = buckets[d]
            buf.copy_(g)
            codec.set_layout(0, buf, grads, [0, 1])
            seed = 7 if codec.needs_seed(0) else None
            wire, _, _, _ = codec.prepare(0, buf, seed)
            q = codec.reduce_p(0, wire.clone(), 1)
            codec.finish(0, q.clone(), 1)
        cpu, gpu = buckets["cpu"][1], buckets[DEV][1]
        for i in range(len(shapes)):
            if step == 1 and i == 0:
                assert gpu[0].isnan().all() and cpu[0].isnan().all()
                continue
            scale = float(cpu[i].abs().max())
            torch.testing.assert_close(gpu[i].cpu(), cpu[i], rtol=0, atol=1e-4 * scale)
