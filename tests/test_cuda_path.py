"""The CUDA path (FLASH_ATTN wrapped as AttentionBackendEnum.CUSTOM), without a GPU.

Real vLLM objects wherever they build on the CPU-only install: the FlashAttention
backend module, its metadata builder (constructed from a real VllmConfig of the
test model), FlashAttentionMetadata, the attention registry and config
validators. Stand-ins only for what needs a GPU, each marked where used: the
platform object (``vllm.platforms.cuda`` imports CUDA-only extensions), the
FlashAttention kernel and ``reshape_and_cache_flash``.

Importing this file is itself the first check: the CUDA layer must import on a
CPU-only vLLM, so a failure here is an error, not a skip.
"""
from types import SimpleNamespace

import pytest
import torch
import vllm.v1.attention.backends.flash_attn as fa
from kept_positions import KeptRecorder
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError
from vllm_kvevict.core.layouts.nhd_layout import NHDLayout
from vllm_kvevict.core.policies import POLICIES
from vllm_kvevict.integration import worker
from vllm_kvevict.integration.attention_common import (_physical_slots, _physical_slots_host,
                                                       physical_view)
from vllm_kvevict.integration.backend_select import (
    CUDA_BACKEND,
    register_cuda_backend,
    select_attention_backend,
)
from vllm_kvevict.integration.cuda_backend import (
    EvictingFlashAttentionBackend,
    EvictingFlashAttentionImpl,
    EvictingFlashAttentionMetadataBuilder,
)

BS, HQ, HKV, D = 16, 4, 2, 8
H2O = {"kv_eviction": "h2o", "kv_budget": 64}


def own_names(cls):
    return {n for n in vars(cls) if not n.startswith("__") and n != "_abc_impl"}


def test_subclasses_override_exactly_the_eviction_hooks():
    B = EvictingFlashAttentionBackend
    assert issubclass(B, fa.FlashAttentionBackend)
    assert own_names(B) == {"forward_includes_kv_cache_update", "get_name", "get_impl_cls",
                            "get_builder_cls", "customize_spec"}
    assert B.forward_includes_kv_cache_update
    assert not fa.FlashAttentionBackend.forward_includes_kv_cache_update
    assert B.get_impl_cls() is EvictingFlashAttentionImpl
    assert B.get_builder_cls() is EvictingFlashAttentionMetadataBuilder
    assert issubclass(EvictingFlashAttentionImpl, fa.FlashAttentionImpl)
    assert own_names(EvictingFlashAttentionImpl) == {"_layout", "forward"}
    assert "__init__" in vars(EvictingFlashAttentionImpl)  # creates the worker state
    assert issubclass(EvictingFlashAttentionMetadataBuilder, fa.FlashAttentionMetadataBuilder)
    assert own_names(EvictingFlashAttentionMetadataBuilder) == {"get_cudagraph_support", "build"}
    # Attention.__init__ runs AttentionBackendEnum[get_name()]: it must name the
    # member that resolves back to this class.
    assert AttentionBackendEnum[B.get_name()] is AttentionBackendEnum.CUSTOM


@pytest.fixture
def custom_registered():
    enum = AttentionBackendEnum.CUSTOM
    was = enum.get_path() if enum.is_overridden() else None
    register_cuda_backend()
    yield
    enum.clear_override()
    if was is not None:
        from vllm.v1.attention.backends.registry import register_backend
        register_backend(enum, was)


def engine_args(**kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model="unused-not-loaded", **kw)


CUDA_LIKE = SimpleNamespace(is_cuda=lambda: True)  # stand-in: cuda.py needs CUDA extensions
CPU_LIKE = SimpleNamespace(is_cuda=lambda: False)


def test_selection_picks_custom_on_cuda(custom_registered):
    from vllm.config import AttentionConfig
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    args = engine_args(additional_config=H2O)
    select_attention_backend(args, EvictionConfig.from_dict(H2O), CUDA_LIKE)
    # What create_engine_config does with --attention-backend ...
    chosen = AttentionConfig.validate_backend_before(args.attention_backend)
    assert chosen is AttentionBackendEnum.CUSTOM
    # ... and what CudaPlatformBase.get_attn_backend_cls does with a selected
    # backend: resolve the class, validate it for the device and layer.
    cls = chosen.get_class()
    assert cls is EvictingFlashAttentionBackend and chosen.get_path() == CUDA_BACKEND
    layer = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16,
                                    kv_cache_dtype="auto", block_size=None)
    assert cls.validate_configuration(device_capability=DeviceCapability(9, 0),
                                      **layer._asdict()) == []


@pytest.mark.parametrize("kw,platform,expect", [
    ({}, CPU_LIKE, None),                                        # CPU: stock selection
    ({"attention_backend": "auto"}, CUDA_LIKE, AttentionBackendEnum.CUSTOM),
    ({"attention_backend": "CUSTOM"}, CUDA_LIKE, "CUSTOM"),      # already ours
    ({"attention_config": {"backend": "CUSTOM"}}, CUDA_LIKE, None),
])
def test_selection_cases(kw, platform, expect):
    args = engine_args(additional_config=H2O, **kw)
    select_attention_backend(args, EvictionConfig.from_dict(H2O), platform)
    assert args.attention_backend == expect


def test_selection_keeps_async_scheduling_off():
    args = engine_args(additional_config=H2O)
    assert args.async_scheduling is None  # vLLM would turn it on for CUDA
    select_attention_backend(args, EvictionConfig.from_dict(H2O), CUDA_LIKE)
    assert args.async_scheduling is False
    with pytest.raises(EvictionConfigError, match="--async-scheduling"):
        select_attention_backend(engine_args(additional_config=H2O, async_scheduling=True),
                                 EvictionConfig.from_dict(H2O), CUDA_LIKE)


def test_selection_off_and_conflicts():
    args = engine_args()
    select_attention_backend(args, EvictionConfig.from_dict({}), CUDA_LIKE)
    assert args.attention_backend is None  # eviction off: nothing changes
    assert args.async_scheduling is None
    args = engine_args(additional_config=H2O)
    select_attention_backend(args, EvictionConfig.from_dict(H2O))  # real platform: CPU
    assert args.attention_backend is None
    for kw in ({"attention_backend": "FLASH_ATTN"},
               {"attention_config": {"backend": "TRITON_ATTN"}}):
        with pytest.raises(EvictionConfigError, match="--attention-backend"):
            select_attention_backend(engine_args(**kw), EvictionConfig.from_dict(H2O), CUDA_LIKE)


# --- metadata: three rows as FlashAttention sees them --------------------------
# row 0: decode, logical seq 40, evicted 8  -> physical 32, new token at pos 31
# row 1: prefill chunk of 5, seq 21, evicted 0 -> positions 16..20
# row 2: decode, logical seq 70, evicted 30 -> physical 40, new token at pos 39
BLOCKS = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 0, 0, 0], [9, 4, 6, 8, 11]], dtype=torch.int32)
EVICTED = {"a": 8, "c": 30}
PHYS_SEQ = [32, 21, 40]
# pos 31 -> block 7 off 15; 16..20 -> block 2 off 0..4; 39 -> block 6 off 7
PHYS_SLOTS = [7 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1, 2 * 16 + 2, 2 * 16 + 3, 2 * 16 + 4,
              6 * 16 + 7]
LOGICAL_SLOTS = [1 * 16 + 7, 32, 33, 34, 35, 36, 8 * 16 + 5]  # where stock vLLM writes


def common_metadata(pad=2):
    qsl = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    slots = torch.tensor(LOGICAL_SLOTS + [-1] * pad, dtype=torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([40, 21, 70], dtype=torch.int32), num_reqs=3,
        num_actual_tokens=7, max_query_len=5, max_seq_len=70,
        block_table_tensor=BLOCKS.clone(), slot_mapping=slots)


def test_physical_view_by_hand():
    cm = common_metadata()
    pv = physical_view(cm, torch.tensor([8, 0, 30], dtype=torch.int32), BS)
    assert pv.seq_lens.tolist() == PHYS_SEQ and pv.max_seq_len == 40
    assert pv.slot_mapping.tolist() == PHYS_SLOTS + [-1, -1]  # padding kept
    assert torch.equal(pv.block_table_tensor, BLOCKS)
    assert torch.equal(pv.query_start_loc, cm.query_start_loc)
    assert cm.seq_lens.tolist() == [40, 21, 70] and cm.slot_mapping.tolist()[:7] == LOGICAL_SLOTS


@pytest.mark.parametrize("seed", range(5))
def test_physical_slots_host_path_matches_the_device_formula(seed):
    """The CPU backend's numpy path (`_physical_slots_host`) and the torch
    formula CUDA runs (`_physical_slots`, here on host tensors) give the same
    lengths and slots on mixed batches: prompt chunks, decode rows, rows with
    nothing evicted."""
    g = torch.Generator().manual_seed(seed)
    num_reqs, bs, nblk = 9, 16, 12
    q_lens = torch.randint(1, 6, (num_reqs,), generator=g)
    q_lens[torch.randint(0, num_reqs, (4,), generator=g)] = 1  # decode rows
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    seq = (q_lens + torch.randint(0, 100, (num_reqs,), generator=g)).to(torch.int32)
    evicted = (torch.rand(num_reqs, generator=g) * (seq - q_lens)).to(torch.int32)
    evicted[0] = 0
    n = int(qsl[-1])
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=num_reqs,
        num_actual_tokens=n, max_query_len=int(q_lens.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.randperm(num_reqs * nblk, generator=g).view(num_reqs, nblk)
        .to(torch.int32), slot_mapping=torch.full((n,), -1, dtype=torch.int64))
    seq_host, slots_host = _physical_slots_host(cm, evicted, bs)
    seq_ref, slots_ref = _physical_slots(cm, evicted, bs)
    assert seq_host.tolist() == seq_ref.tolist() == (seq - evicted).tolist()
    assert slots_host.tolist() == slots_ref.tolist()
    assert len(set(slots_host.tolist())) == n and min(slots_host.tolist()) >= 0


@pytest.fixture
def vllm_cfg(model_path, monkeypatch):
    """Real VllmConfig of the test model; the worker's process-global eviction
    state is restored afterwards."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    monkeypatch.setattr(worker, "_STATE", None)
    monkeypatch.setattr(worker, "_OWNER", None)

    def make(extra):
        mc = ModelConfig(model=model_path, dtype="bfloat16", max_model_len=512)
        return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS),
                          additional_config=extra)
    return make


def make_impl(vc, **kw):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        return EvictingFlashAttentionImpl(num_heads=HQ, head_size=D, scale=0.3,
                                          num_kv_heads=HKV, alibi_slopes=None,
                                          kv_cache_dtype="auto", **kw)


def make_builder(vc):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
    with set_current_vllm_config(vc):
        return EvictingFlashAttentionMetadataBuilder(spec, ["l0"], vc, torch.device("cpu")), spec


def with_evictions(state):
    # Stand-in for the model runner: only the batch order of request ids is read.
    state.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c"]))
    state.evicted = dict(EVICTED)


def test_builder_builds_physical_flash_metadata(vllm_cfg):
    vc = vllm_cfg(H2O)
    make_impl(vc, sliding_window=None)  # model init: creates the worker state
    builder, spec = make_builder(vc)
    assert builder.state is worker.worker_state() is not None
    with_evictions(builder.state)
    md = builder.build(0, common_metadata())
    assert isinstance(md, fa.FlashAttentionMetadata)
    assert md.seq_lens.tolist() == PHYS_SEQ and md.max_seq_len == 40
    assert md.slot_mapping[:7].tolist() == PHYS_SLOTS and md.num_actual_tokens == 7
    assert torch.equal(md.block_table, BLOCKS)
    assert not builder.supports_update_block_table
    cls = EvictingFlashAttentionMetadataBuilder
    assert cls.get_cudagraph_support(vc, spec) is AttentionCGSupport.NEVER
    off = vllm_cfg({})
    assert (cls.get_cudagraph_support(off, spec)
            is fa.FlashAttentionMetadataBuilder.get_cudagraph_support(off, spec))


def test_builder_without_eviction_is_stock(vllm_cfg):
    vc = vllm_cfg({})
    make_impl(vc, sliding_window=None)
    builder, _ = make_builder(vc)
    assert builder.state is None and builder.supports_update_block_table
    md = builder.build(0, common_metadata())
    assert md.seq_lens.tolist() == [40, 21, 70] and md.slot_mapping[:7].tolist() == LOGICAL_SLOTS


def test_impl_rejects_what_eviction_cannot_serve(vllm_cfg):
    with pytest.raises(ValueError, match="sliding window"):
        make_impl(vllm_cfg(H2O), sliding_window=64)
    make_impl(vllm_cfg({}), sliding_window=64)  # eviction off: stock behaviour


# --- forward: KV write at physical slots, then H2O scores ----------------------

def flash_cache(bs=BS, nb=12, dtype=torch.bfloat16):
    """A layer cache as vLLM 0.32 views it for FlashAttention: logical
    [NB, H, BS, 2D] over a [NB, BS, H, 2D] (LBNHC) buffer."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(nb, bs, HKV, 2 * D, generator=g).to(dtype)
    return raw.permute(0, 2, 1, 3)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *_):
    """Stand-in for vLLM's CUDA op: token i goes to [slot // BS, slot % BS]."""
    for i, s in enumerate(slot_mapping.tolist()):
        key_cache[s // key_cache.shape[1], s % key_cache.shape[1]] = key[i]
        value_cache[s // key_cache.shape[1], s % key_cache.shape[1]] = value[i]


def reference_scores(before, kv, query, seqs, qsl, scale):
    """Dense H2O update over physical positions, one query at a time."""
    out = before.clone()
    out[:, PHYS_SLOTS] = 0.0
    g = HQ // HKV
    for r, (s, a, b) in enumerate(zip(seqs, qsl, qsl[1:])):
        for t in range(b - a):
            visible = s - (b - a) + t + 1
            slots = [int(BLOCKS[r, p // BS]) * BS + p % BS for p in range(visible)]
            for hq in range(HQ):
                h = hq // g
                k = torch.stack([kv[sl // BS, h, sl % BS, :D] for sl in slots]).float()
                p = (k @ query[a + t, hq].float() * scale).softmax(0)
                out[h, slots] += p
    return out


def kernels(monkeypatch, which):
    """Select the torch or the Triton path (`vllm_kvevict.core.eviction.kernel_dispatch`); Triton runs
    in its interpreter here (conftest), which has no bf16: the cache dtype for the path."""
    monkeypatch.setenv("VLLM_KVEVICT_KERNELS", which)
    return torch.float32 if which == "triton" else torch.bfloat16


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_forward_writes_physical_slots_and_scores(vllm_cfg, monkeypatch, path):
    dtype = kernels(monkeypatch, path)
    vc = vllm_cfg(H2O)
    impl = make_impl(vc, sliding_window=None)
    builder, _ = make_builder(vc)
    state = worker.worker_state()
    with_evictions(state)
    md = builder.build(0, common_metadata())
    # Stand-ins for the GPU kernels; everything around them is the real code.
    monkeypatch.setattr(fa, "reshape_and_cache_flash", reshape_and_cache_flash, raising=False)
    seen = {}

    def kernel(self, layer, query, key, value, kv_cache, metadata, output, *rest):
        seen["md"] = metadata
        return output
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", kernel)
    kv = flash_cache(dtype=dtype)
    layer = SimpleNamespace(layer_name="l0", _k_scale=torch.ones(()), _v_scale=torch.ones(()))
    lc = state.layer("l0", kv, impl._layout)
    assert isinstance(lc.layout, NHDLayout) and lc.scores.shape == (HKV, 12 * BS)
    lc.scores.fill_(1.0)  # old importance: new slots must restart from zero
    before, kv_before = lc.scores.clone(), kv.clone()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, n, D, generator=g).to(dtype) for n in (HQ, HKV, HKV))
    out = torch.zeros(9, HQ, D, dtype=dtype)
    assert impl.forward(layer, q, k, v, kv, md, out) is out and seen["md"] is md
    for i, s in enumerate(PHYS_SLOTS):
        token = kv[s // BS, :, s % BS]  # [H, 2D]
        assert torch.equal(token[:, :D], k[i]) and torch.equal(token[:, D:], v[i])
    for s in (1 * 16 + 7, 8 * 16 + 5):  # logical slots of the decode rows: untouched
        assert torch.equal(kv[s // BS, :, s % BS], kv_before[s // BS, :, s % BS])
    want = reference_scores(before, kv, q, PHYS_SEQ, [0, 1, 6, 7], 0.3)
    torch.testing.assert_close(lc.scores, want, rtol=1e-4, atol=1e-5)


def test_fused_decode_step_on_the_triton_path(vllm_cfg, monkeypatch):
    """An all-decode H2O step: one Triton kernel gives the attention output and
    the scores; the stock kernel is not called."""
    from vllm_kvevict.triton_kernels.reference import paged_attention_scores_ref

    dtype = kernels(monkeypatch, "triton")
    vc = vllm_cfg(H2O)
    impl = make_impl(vc, sliding_window=None)
    builder, _ = make_builder(vc)
    state = worker.worker_state()
    state.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "c"]))
    state.evicted = dict(EVICTED)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)  # rows a and c of the mixed batch
    md = builder.build(0, CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([40, 70], dtype=torch.int32), num_reqs=2, num_actual_tokens=2,
        max_query_len=1, max_seq_len=70, block_table_tensor=BLOCKS[[0, 2]].clone(),
        slot_mapping=torch.tensor([LOGICAL_SLOTS[0], LOGICAL_SLOTS[-1]])))
    monkeypatch.setattr(fa, "reshape_and_cache_flash", reshape_and_cache_flash, raising=False)

    def stock_kernel(*args):
        raise AssertionError("the fused path must not call the stock kernel")
    monkeypatch.setattr(fa.FlashAttentionImpl, "forward", stock_kernel)
    kv = flash_cache(dtype=dtype)
    layer = SimpleNamespace(layer_name="l0", _k_scale=torch.ones(()), _v_scale=torch.ones(()))
    lc = state.layer("l0", kv, impl._layout)
    lc.scores.fill_(1.0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, D, generator=g) for n in (HQ, HKV, HKV))
    out = torch.zeros(2, HQ, D)
    before = lc.scores.clone()
    assert impl.forward(layer, q, k, v, kv, md, out) is out
    kc, vcache = lc.layout.split(kv)
    new = [PHYS_SLOTS[0], PHYS_SLOTS[-1]]
    assert torch.equal(kc[new[0] // BS, new[0] % BS], k[0])  # written at the physical slot
    want_out, delta = paged_attention_scores_ref(q, kc, vcache, BLOCKS[[0, 2]], torch.arange(2),
                                                 torch.tensor([32, 40]), 0.3)
    before[:, new] = 0.0  # the new tokens' slots restart from zero
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lc.scores, before + delta, rtol=1e-5, atol=1e-5)


def test_layout_requires_one_block_size(vllm_cfg):
    impl = make_impl(vllm_cfg(H2O), sliding_window=None)
    assert impl._layout(flash_cache()).block_size == BS
    with pytest.raises(ValueError, match="one block size"):
        impl._layout(flash_cache(bs=32))


# --- compaction on the Triton path: the same cache as the torch path ------------

def compact_once(path, policy, dst_blocks, monkeypatch):
    """Two layers of one buffer (as vLLM allocates them), request "a" compacted
    from 40 resident tokens in blocks [3, 7, 1] to 20; returns the resident K||V
    and scores oldest first (read through the worker's slot order: the torch
    path fills holes, the kernel compacts in order), the buffer's blocks that
    are not destinations, and the kept positions."""
    from vllm_kvevict.core.eviction.plans import CompactionPlan

    kernels(monkeypatch, path)
    dtype = torch.float32  # both paths on the same data (the interpreter has no bf16)
    nb = 12
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(2 * nb, BS, HKV, 2 * D, generator=g).to(dtype)  # LBNHC, 2 layers
    state = worker.WorkerEviction(EvictionConfig.from_dict({"kv_eviction": policy,
                                                            "kv_budget": 32}), BS)
    make_layout = NHDLayout.for_cache
    for i in range(2):
        lc = state.layer(f"l{i}", raw[i * nb:(i + 1) * nb].permute(0, 2, 1, 3), make_layout)
        per_slot = POLICIES[policy].records.per_slot  # a score buffer: h2o's only
        assert lc.scores.numel() == (HKV * nb * BS if per_slot else 0)
        lc.scores.copy_(torch.rand(lc.scores.shape, generator=g))
    state.runner = SimpleNamespace(requests={"a": SimpleNamespace(block_ids=[[3, 7, 1]])},
                                   input_batch=SimpleNamespace(req_id_to_index={}))
    assert len(state._stacks()) == 1  # one gather/kernel for both layers
    recorder = KeptRecorder(state)
    state._compact([CompactionPlan("a", 0, (3, 7, 1), dst_blocks, old_len=40, new_len=20,
                                   logical_len=40, recent=10)])
    order = state.order["a"].long()  # (layers, H, 20) slot of each token, oldest first
    dst = torch.tensor(dst_blocks)
    kv, scores = [], []
    for i in range(2):
        slots = (dst[:, None] * BS + torch.arange(BS)).flatten()[order[i]]  # (H, 20)
        heads = torch.arange(HKV)[:, None]
        kv.append(raw[i * nb:(i + 1) * nb].flatten(0, 1)[slots, heads])  # (H, 20, 2D)
        if POLICIES[policy].records.per_slot:
            scores.append(state.layers[f"l{i}"].scores.gather(1, slots))
    others = [b for b in range(nb) if b not in dst_blocks]
    rest = torch.cat([raw[i * nb:(i + 1) * nb][others] for i in range(2)])
    return (torch.stack(kv).float(), scores and torch.stack(scores), rest.float(),
            recorder.kept["a"].positions)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("dst_blocks", [(3, 7), (3, 10)])  # in place; private copy of block 7
def test_worker_compaction_triton_equals_torch(policy, dst_blocks, monkeypatch):
    kv_t, scores_t, rest_t, kept_t = compact_once("torch", policy, dst_blocks, monkeypatch)
    kv_k, scores_k, rest_k, kept_k = compact_once("triton", policy, dst_blocks, monkeypatch)
    assert torch.equal(kept_t, kept_k)
    assert torch.equal(kv_t, kv_k)  # the same tokens, oldest first
    assert torch.equal(rest_t, rest_k)  # blocks that are no destination: untouched by both
    if POLICIES[policy].records.per_slot:  # scores moved with their tokens
        assert torch.equal(scores_t, scores_k)
