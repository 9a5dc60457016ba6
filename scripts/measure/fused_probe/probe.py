"""A prototype, not the product: causal attention and H2O's column sums in one
pass (fused_attention.cpp, bf16 logits by vdpbf16ps, softmax and P V in
float32), against what H2O runs on CPU today: vLLM's own attention
(`cpu_attention_with_kv_cache`) and then the plugin's scoring kernel, over the
same queries and keys (one request's prefill chunk, SmolLM2's heads).

    .venv/bin/python scripts/measure/fused_probe/probe.py     # AVX-512 BF16 CPUs only

Prints, per shape and thread count: each output's largest error against a
float64 reference, the share of bf16 output elements where the fused pass and
vLLM differ (and where each differs from the float64 result rounded to bf16),
the column sums' relative error, and the times (median of 5). The prototype
reads dense K and V (the engine's would read the paged cache) and packs them
on one thread; its P V takes four query rows at a time.
"""
import sys, time, torch
from torch.utils.cpp_extension import load
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
import cpu_kernel as ck
from vllm import _custom_ops as ops
from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.layouts.cpu_layout import KVLayout

ext = load("fused_probe", [str(HERE / "fused_attention.cpp")],
           extra_cflags=["-O3", "-fopenmp", "-march=native"], extra_ldflags=["-fopenmp"], verbose=False)
H, G, D, BS = 3, 3, 64, 32
layout = KVLayout.discover(ops.cpu_attn_reshape_and_cache, "vec", torch.bfloat16, BS, D, H)

def med(fn, reps=5):
    fn(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(1e3 * (time.perf_counter() - t0))
    return sorted(ts)[len(ts) // 2]

def case(n, nq, threads, seed=0):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    nblk = -(-n // BS); nb = nblk + 8
    kv = torch.randn(nb, H, BS, 2 * D, generator=g).bfloat16()
    kc, vc = layout.split(kv)
    rows = torch.randperm(nb, generator=g)[:nblk].unsqueeze(0)
    q = (torch.randn(1, nq, H * G, D, generator=g) * 2).bfloat16()
    K = layout.gather_keys(kc, rows)[0, :, :n].contiguous()  # (H, n, D)
    V = layout.gather_values(vc, rows)[0, :, :n].contiguous()
    scale = D ** -0.5
    f, vout = ck.vllm_attention(ops, "vec", q, kc, vc, rows, n, True)
    f()
    out, col = ext.attend_sums(q[0].contiguous(), K, V, scale)
    # float64 reference
    s = torch.einsum("thd,hnd->htn", q[0].double(), K.double().repeat_interleave(G, 0)) * scale
    vis = torch.arange(n - nq + 1, n + 1)
    s = s.masked_fill(torch.arange(n)[None, None, :] >= vis[None, :, None], float("-inf"))
    p = s.softmax(-1)
    ref = torch.einsum("htn,hnd->thd", p, V.double().repeat_interleave(G, 0))
    refcol = p.view(H, G, nq, n).sum((1, 2))
    vis_t = vis.expand(1, nq).contiguous()
    ours_col_ref = cpu_kernel.column_sums(layout, kc, q, vis_t, rows, scale, "avx512bf16")[0, :, :n]
    err = lambda a: (a.double() - ref).abs().max().item()
    print(f"n={n} nq={nq} threads={threads}: out err vs f64: fused {err(out):.2e}, vLLM {err(vout):.2e}; "
          f"bf16 outputs differing fused vs vLLM: {(out != vout).float().mean().item():.2e} "
          f"(vLLM vs f64-rounded {(vout != ref.bfloat16()).float().mean().item():.2e}, fused vs f64-rounded {(out != ref.bfloat16()).float().mean().item():.2e}); "
          f"col rel err fused {((col.double()-refcol).abs().max()/refcol.abs().max()).item():.1e}, kernel {((ours_col_ref.double()-refcol).abs().max()/refcol.abs().max()).item():.1e}")
    t_f = med(lambda: ext.attend_sums(q[0].contiguous(), K, V, scale))
    t_v = med(f)
    t_s = med(lambda: cpu_kernel.column_sums(layout, kc, q, vis_t, rows, scale, "avx512bf16"))
    print(f"   ms: fused {t_f:.2f} | vLLM attention {t_v:.2f} + scoring kernel {t_s:.2f} = {t_v + t_s:.2f} "
          f"| fused / (vLLM attention) {t_f / t_v:.2f}, fused / (attention + scoring) {t_f / (t_v + t_s):.2f}")

for threads in [int(a) for a in sys.argv[1:]] or (1, 2):
    for n, nq in ((512, 512), (2048, 2048), (4096, 512)):
        case(n, nq, threads)
