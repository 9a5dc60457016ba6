"""AnDPro's window scores in the compiled CPU kernel
(`cpu_kernel.window_projection_sums`, vllm_kvevict/cpu_kernel/window_projection.h)
against the torch float32 path, `window_scores.raw_scores_torch` (`projection=True`),
and a float64 reference, on every instruction path this CPU has.

The avx2 path runs on any x86 CI machine (VLLM_KVEVICT_CPU_ISA=avx2 forces it in
production); amx and avx512bf16 where the CPU has them (skipped, saying so,
elsewhere). Tolerances, measured on a Xeon with AMX (docs/design.md, the
precision table's AnDPro row):
  amx, avx512bf16  E (the exps) and Y carried as hi + lo bf16 pairs (2^-16 relative):
                   norm-relative error <= 3.3e-6 measured, held to 1e-5; the
                   largest error <= 4.4e-6 of the largest score, held to 1.5e-5
  avx2             float32 throughout: <= 1e-6 measured, held to 3e-6 / 5e-6
and after `finalize` the kept sets (top-k per (layer, head)) of the kernel and of
torch overlap by at least the floors below.

`split=False` (the default in serving, VLLM_KVEVICT_SCORE_PRECISION=model) is
the papers' model-dtype contract on the avx512bf16 path: E and Y rounded to
bf16 before their products. It is held to its own plain-torch reference
(`_model_dtype`: the same roundings, everything else float64) at 3e-5 / 6e-5
(measured <= 5.9e-6 / 1.5e-5 on a Zen 4: a 1-ulp exp may round E the other
way), to the first-order bound of those roundings against float64
(`_rounding_bound`, measured <= 0.18 of it), and to the same kept-set floor
against torch float32 (measured >= 0.996). The amx and avx2 paths ignore it.
"""

import pytest
import torch
from conftest import kernel_isas

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.eviction import kernel_dispatch
from vllm_kvevict.core.eviction.kernel_dispatch import cpu_projection_isa
from vllm_kvevict.core.scoring import window_scores
from vllm_kvevict.core.scoring.window_scores import finalize, raw_scores_torch

TOL = {"amx": (1e-5, 1.5e-5), "avx512bf16": (1e-5, 1.5e-5), "avx2": (3e-6, 5e-6)}  # (norm, max)


def _torch_andpro(q, k, v, scale):
    """The float32 torch path (the Triton kernel's reference too)."""
    return raw_scores_torch(q, k, v, scale, projection=True)


def _float64(q, k, v, scale):
    """AnDPro written out in float64: a = causal softmax, y = a v,
    s_i = sum_{g,t} a[t, i] <y_t, v_i>."""
    a = _causal_logits(q, k, scale).softmax(-1)
    y = torch.einsum("bhgtn,bhnd->bhgtd", a, v.double())
    z = torch.einsum("bhgtd,bhnd->bhgtn", y, v.double())
    return (a * z).sum(dim=(2, 3))


def _causal_logits(q, k, scale):
    """(b, h, g, w, n) float64 logits of the window, -inf past each query."""
    b, w, hq, d = q.shape
    h, n = k.shape[1], k.shape[2]
    qg = q.double().view(b, w, h, hq // h, d).permute(0, 2, 3, 1, 4)
    logits = torch.einsum("bhgtd,bhnd->bhgtn", qg, k.double()) * scale
    t, i = torch.arange(w).view(w, 1), torch.arange(n).view(1, n)
    return logits.masked_fill(i > n - w + t, float("-inf"))


def _bf16(x):
    return x.float().bfloat16().double()


def _model_dtype(q, k, v, scale):
    """AnDPro at the papers' precision, as `split=False` computes it: the exps
    e = exp(l - max l) and the outputs y rounded to bf16 before they multiply
    the values (round to nearest even), everything else float64;
    a[t, i] <y_t, v_i> = e[t, i] <r_t^2 (E V)_t, v_i>, r_t = 1 / sum_i e[t, i]."""
    logits = _causal_logits(q, k, scale)
    e = (logits - logits.amax(-1, keepdim=True)).exp()
    r = 1 / e.sum(-1, keepdim=True)
    y = torch.einsum("bhgtn,bhnd->bhgtd", _bf16(e), v.double()) * r * r
    z = torch.einsum("bhgtd,bhnd->bhgtn", _bf16(y), v.double())
    return (e * z).sum(dim=(2, 3))


def _rounding_bound(q, k, v, scale):
    """sum_{g,t} a[t, i] <ybar_t, |v_i|>, ybar_t = sum_j a[t, j] |v_j|: rounding
    each e (in y) and each y to bf16 moves s_i by at most 2^-9 of this, twice,
    to first order."""
    a = _causal_logits(q, k, scale).softmax(-1)
    va = v.double().abs()
    ybar = torch.einsum("bhgtn,bhnd->bhgtd", a, va)
    return (a * torch.einsum("bhgtd,bhnd->bhgtn", ybar, va)).sum(dim=(2, 3))


def _inputs(b, w, h, g, d, n, dtype, gen, real=False):
    """Random window queries, keys, values; `real`: shaped like a model's, with
    a few heavy keys (a sink at 0 and scattered heavy hitters) that the queries
    align with, and peaky attention, so the kept set is decided by a minority."""
    q = torch.randn(b, w, h * g, d, generator=gen)
    k = torch.randn(b, h, n, d, generator=gen)
    v = torch.randn(b, h, n, d, generator=gen)
    if real:  # logits: noise of std 2, heavy keys about 4 above it
        heavy = torch.randint(0, n, (b, h, max(2, n // 50)), generator=gen)
        heavy[..., 0] = 0
        u = torch.randn(b, h, 1, d, generator=gen)
        u = u / u.norm(dim=-1, keepdim=True)
        k.scatter_add_(2, heavy[..., None].expand(-1, -1, -1, d), u.expand(-1, -1, heavy.shape[-1], -1) * 4)
        q = q + u.repeat_interleave(g, dim=1).transpose(1, 2) * 2
        v = v * torch.rand(b, h, n, 1, generator=gen) * 2
    return (x.to(dtype).contiguous() for x in (q * 2, k, v))


def _errors(got, want):
    got, want = got.double(), want.double()
    return (float((got - want).norm() / want.norm()),
            float((got - want).abs().max() / want.abs().max()))


RANDOM_SHAPES = [  # (b, w, h, g, d, n): GQA 1-7, head sizes 32-128 (amx takes 32/64 in tiles,
    (2, 32, 3, 3, 64, 203),  # the rest through its vdpbf16ps code), n = w, ragged n
    (1, 8, 2, 7, 128, 77),
    (2, 16, 1, 1, 32, 16),
    (1, 5, 2, 2, 48, 33),
    (1, 32, 2, 3, 96, 150),
    (3, 1, 1, 2, 64, 1),
    (1, 32, 1, 3, 64, 100),  # one (b, h): its 6 row blocks split over tasks, summed
]


@pytest.mark.parametrize("isa", kernel_isas())
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "b{}w{}h{}g{}d{}n{}".format(*s))
def test_random_inputs_match_torch_and_float64(isa, shape):
    b, w, h, g, d, n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    dtypes = [torch.bfloat16] + ([torch.float32, torch.float16] if isa == "avx2" else [])
    for dtype in dtypes:
        q, k, v = _inputs(b, w, h, g, d, n, dtype, gen)
        got = cpu_kernel.window_projection_sums(q, k, v, d ** -0.5, isa)
        assert got.shape == (b, h, n) and got.dtype == torch.float32 and got.isfinite().all()
        norm, mx = TOL[isa]
        for want in (_torch_andpro(q, k, v, d ** -0.5), _float64(q, k, v, d ** -0.5)):
            e_norm, e_max = _errors(got, want)
            assert e_norm < norm and e_max < mx, (dtype, e_norm, e_max)


# Kept sets after finalize, per (layer, head): the fraction of torch's top-k
# (budget = n // 4, at least w + 4) that the kernel keeps too. Measured over
# these inputs: 1.0 for every (layer, head), n and path, bf16 and float32 inputs
# (and torch float32's against float64's: 1.0 too). Held to 1 - CHUNK / budget:
# one chunk of 4 tokens at the cut may swap with its neighbour on a near-tie.
def _overlap_floor(budget):
    return 1 - window_scores.CHUNK / budget


@pytest.mark.parametrize("isa", kernel_isas())
@pytest.mark.parametrize("n", [40, 272, 513, 1040, 1100])
def test_real_looking_shapes_and_kept_sets(isa, n):
    """SmolLM2's heads (H 3, G 3, D 64), the papers' window (w 32), two layers."""
    b, w, h, g, d = 2, 32, 3, 3, 64
    gen = torch.Generator().manual_seed(n)
    dtypes = [torch.bfloat16] + ([torch.float32] if isa == "avx2" else [])
    for dtype in dtypes:
        q, k, v = _inputs(b, w, h, g, d, n, dtype, gen, real=True)
        want = _torch_andpro(q, k, v, 0.125)
        budget = max(w + 4, n // 4)
        sel_want = finalize(want, w)
        for split in (True, False):  # float32-accurate, then the model dtype's
            got = cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=split)
            if split:
                e_norm, e_max = _errors(got, want)
                norm, mx = TOL[isa]
                assert e_norm < norm and e_max < mx, (dtype, e_norm, e_max)
            sel_got = finalize(got, w)
            for layer in range(b):
                for head in range(h):
                    kept = set(sel_got[layer, head].topk(budget).indices.tolist())
                    ref = set(sel_want[layer, head].topk(budget).indices.tolist())
                    overlap = len(kept & ref) / budget
                    assert overlap >= _overlap_floor(budget), (dtype, split, layer, head, overlap)


MODEL_TOL = (3e-5, 6e-5)  # (norm, max) against _model_dtype


@pytest.mark.parametrize("isa", [p for p in kernel_isas() if p.values[0] == "avx512bf16"])
@pytest.mark.parametrize("real", [False, True], ids=["random", "heavy"])
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=lambda s: "b{}w{}h{}g{}d{}n{}".format(*s))
def test_model_dtype_scores_match_their_reference_and_bound(isa, shape, real):
    """split=False against `_model_dtype` (the same roundings, in float64);
    against float64 itself within the roundings' bound; and rounded for real:
    farther from float64 than the split scores."""
    b, w, h, g, d, n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v = _inputs(b, w, h, g, d, n, torch.bfloat16, gen, real=real)
    scale = d ** -0.5
    got = cpu_kernel.window_projection_sums(q, k, v, scale, isa, split=False)
    assert got.shape == (b, h, n) and got.isfinite().all()
    e_norm, e_max = _errors(got, _model_dtype(q, k, v, scale))
    assert e_norm < MODEL_TOL[0] and e_max < MODEL_TOL[1], (e_norm, e_max)
    exact = _float64(q, k, v, scale)
    slack = 1e-5 * float(exact.abs().max())  # the float32 sums
    assert ((got.double() - exact).abs() <= 2 ** -8 * _rounding_bound(q, k, v, scale) + slack).all()
    if n > 1:
        split = cpu_kernel.window_projection_sums(q, k, v, scale, isa, split=True)
        assert _errors(got, exact)[0] > 10 * _errors(split, exact)[0]


@pytest.mark.parametrize("isa", [p for p in kernel_isas() if p.values[0] != "avx512bf16"])
def test_split_changes_nothing_off_avx512bf16(isa):
    """amx always splits, avx2 is float32: split=False gives the same bits."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _inputs(2, 32, 3, 3, 64, 203, torch.bfloat16, gen, real=True)
    assert torch.equal(cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=False),
                       cpu_kernel.window_projection_sums(q, k, v, 0.125, isa, split=True))


@pytest.mark.parametrize("isa", kernel_isas())
def test_threads_give_the_same_scores(isa):
    """Two threads (tasks split over them, a (b, h)'s row blocks too) against one."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = _inputs(1, 32, 2, 7, 64, 500, torch.bfloat16, gen, real=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.window_projection_sums(q, k, v, 0.125, isa)
        torch.set_num_threads(2)
        two = cpu_kernel.window_projection_sums(q, k, v, 0.125, isa)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6 * float(one.abs().max()))


def test_the_dispatcher_says_where_the_kernel_runs(monkeypatch):
    if cpu_kernel.module() is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    q = torch.zeros(1, 32, 9, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 3, 100, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "auto")
    best = cpu_kernel.isa()
    # auto: amx where torch's GEMMs are full-width AVX-512 (Intel); every path
    # where they are not (both cases on every machine, the answer stubbed).
    monkeypatch.setattr(kernel_dispatch, "_torch_gemms_full_width", lambda: True)
    assert cpu_projection_isa(q, k, v) == (best if best == "amx" else None)
    assert cpu_projection_isa(q.float(), k.float(), v.float()) is None
    monkeypatch.setattr(kernel_dispatch, "_torch_gemms_full_width", lambda: False)
    assert cpu_projection_isa(q, k, v) == best
    assert cpu_projection_isa(q.float(), k.float(), v.float()) == "avx2"
    assert cpu_projection_isa(q[..., :56], k[..., :56], v[..., :56]) is None  # D % 16
    assert cpu_projection_isa(q, k[:, :, :20], v[:, :, :20]) is None  # n < w
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx2")
    assert cpu_projection_isa(q, k, v) == "avx2"
    assert cpu_projection_isa(q.float(), k.float(), v.float()) == "avx2"
    if cpu_kernel.module().supports("avx512bf16"):
        monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", "avx512bf16")
        assert cpu_projection_isa(q, k, v) == "avx512bf16"
        assert cpu_projection_isa(q, k, v.float()) == "avx2"  # mixed dtypes: the float32 path
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", "torch")
    assert cpu_projection_isa(q, k, v) is None


@pytest.mark.parametrize("forced", ["avx2", "auto"])
def test_the_kernel_runs_where_the_dispatcher_sends_it(forced, monkeypatch):
    """A spy on the compiled function: the dispatcher's path reaches it (forced
    avx2, as an AVX2-only CI machine runs; auto, the best path), once, with
    that path, and its scores are torch's."""
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    monkeypatch.setenv("VLLM_KVEVICT_CPU_ISA", forced)
    gen = torch.Generator().manual_seed(5)
    q, k, v = _inputs(2, 32, 3, 3, 64, 300, torch.bfloat16, gen, real=True)
    isa = cpu_projection_isa(q, k, v)
    if isa is None:
        pytest.skip(f"the kernel does not run AnDPro by default on this CPU ({cpu_kernel.isa()})")
    calls = []
    real = mod.window_projection_sums
    monkeypatch.setattr(mod, "window_projection_sums", lambda *a: calls.append(a[4]) or real(*a))
    got = cpu_kernel.window_projection_sums(q, k, v, 0.125, isa)
    assert calls == [isa] and isa == (forced if forced != "auto" else cpu_kernel.isa())
    e_norm, e_max = _errors(got, _torch_andpro(q, k, v, 0.125))
    assert e_norm < TOL[isa][0] and e_max < TOL[isa][1]


def test_window_scores_andpro_runs_the_kernel(monkeypatch):
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    gen = torch.Generator().manual_seed(6)
    q, k, v = _inputs(2, 32, 3, 3, 64, 300, torch.bfloat16, gen)
    isa = cpu_projection_isa(q, k, v)
    if isa is None:
        pytest.skip(f"the kernel does not run AnDPro by default on this CPU ({cpu_kernel.isa()})")
    calls = []
    real = mod.window_projection_sums
    monkeypatch.setattr(mod, "window_projection_sums", lambda *a: calls.append(a[4:]) or real(*a))
    monkeypatch.delenv("VLLM_KVEVICT_SCORE_PRECISION", raising=False)
    default = window_scores.value_projection(q, k, v, 0.125)
    monkeypatch.setenv("VLLM_KVEVICT_SCORE_PRECISION", "float32")
    exact = window_scores.value_projection(q, k, v, 0.125)
    assert calls == [(isa, False), (isa, True)]  # model dtype by default
    want = _torch_andpro(q, k, v, 0.125)
    assert _errors(exact, want)[0] < TOL[isa][0]
    # the model dtype's rounding (2^-9) where it applies, measured <= 4.4e-4
    assert _errors(default, want)[0] < (2e-3 if isa == "avx512bf16" else TOL[isa][0])
    monkeypatch.setenv("VLLM_KVEVICT_SCORE_PRECISION", "fp16")
    with pytest.raises(ValueError, match="VLLM_KVEVICT_SCORE_PRECISION"):
        window_scores.value_projection(q, k, v, 0.125)


def test_bad_inputs_are_refused():
    mod = cpu_kernel.module()
    if mod is None:
        pytest.fail("the CPU kernel is not built: scripts/setup.sh builds it")
    q = torch.zeros(1, 32, 9, 64)
    k = torch.zeros(1, 3, 100, 64)
    short = k[:, :, :20].contiguous()
    with pytest.raises(RuntimeError, match="last w"):
        mod.window_projection_sums(q, short, short, 1.0, "avx2")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mod.window_projection_sums(q[..., :40].contiguous(), k[..., :40].contiguous(),
                                   k[..., :40].contiguous(), 1.0, "avx2")
    with pytest.raises(RuntimeError, match="contiguous"):
        mod.window_projection_sums(q, k[..., :32], k[..., :32], 1.0, "avx2")
    with pytest.raises(RuntimeError, match="head sizes"):
        mod.window_projection_sums(q[:, :, :8].contiguous(), k, k, 1.0, "avx2")
    with pytest.raises(RuntimeError, match="one dtype"):
        mod.window_projection_sums(q, k, k.bfloat16(), 1.0, "avx2")
    if mod.supports("avx512bf16"):
        with pytest.raises(RuntimeError, match="takes bf16"):
            mod.window_projection_sums(q, k, k, 1.0, "avx512bf16")


@pytest.mark.parametrize("vendor, flags, full_width", [
    ("GenuineIntel", "fpu avx2 avx512f avx512_bf16 amx_bf16", True),  # Xeon: MKL beats avx512bf16
    ("AuthenticAMD", "fpu avx2 avx512f avx512_bf16", False),  # Zen 4: 256-bit units
    ("GenuineIntel", "fpu avx2 fma", False),  # AVX2 only: the avx2 path wins
    (None, None, True),  # unreadable: keep torch
])
def test_torch_gemm_width_is_read_from_cpuinfo(vendor, flags, full_width, monkeypatch):
    """`_torch_gemms_full_width` (which decides AnDPro's default path) from
    /proc/cpuinfo texts: a Xeon and a Zen 4 EPYC (both measured), an AVX2-only
    Intel CPU (the vendor alone does not make GEMMs full-width) and none."""
    text = None if vendor is None else (
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\nflags\t\t: {flags}\n\n"
        f"processor\t: 1\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n")
    monkeypatch.setattr(cpu_kernel, "_cpuinfo", lambda: text)
    kernel_dispatch._torch_gemms_full_width.cache_clear()
    try:
        assert cpu_kernel.cpu_vendor() == (vendor or "?")
        assert kernel_dispatch._torch_gemms_full_width() is full_width
    finally:
        kernel_dispatch._torch_gemms_full_width.cache_clear()


def test_bad_precision_is_refused_where_the_worker_logs_its_path(monkeypatch, caplog):
    """The worker logs the scoring path at startup (`log_cpu_path_once`): a bad
    VLLM_KVEVICT_SCORE_PRECISION stops it there; a good one is in the line."""
    monkeypatch.setenv("VLLM_KVEVICT_SCORE_PRECISION", "half")
    kernel_dispatch.log_cpu_path_once.cache_clear()
    with pytest.raises(ValueError, match="expected one of"):
        kernel_dispatch.log_cpu_path_once()
    monkeypatch.setenv("VLLM_KVEVICT_SCORE_PRECISION", "float32")
    kernel_dispatch.log_cpu_path_once.cache_clear()
    with caplog.at_level("INFO", logger="vllm.kvevict"):
        kernel_dispatch.log_cpu_path_once()
    kernel_dispatch.log_cpu_path_once.cache_clear()
    assert "in float32 precision" in caplog.text
