"""Shared fixtures: the real converted SmolLM2 model, in-process engines shared
across tests, stock vLLM's greedy tokens, one transformers model.

Engines are the suite's cost (an engine start is seconds; a `vllm serve` is
three Python processes importing vLLM): `engines.get(**settings)` hands out
one in-process engine per distinct configuration and reuses it for every test
that asks for the same settings. Only one is alive at a time (the worker's
eviction state and vLLM's parallel groups are per process), so tests that
share a configuration sit next to each other in a file.
"""

import gc
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

from vllm_kvevict.eval.server import kv_pool_bytes, native_dtype

# Threads of this process (in-process engines and references). vLLM binds
# OpenMP threads only in the worker processes its `mp` executor spawns
# (servers, TP runs: VLLM_CPU_OMP_THREADS_BIND); in-process engines use torch's
# default, one thread per core. Measured on 2 idle cores (SmolLM2, H2O, one
# engine: 4 x 160 decode tokens / 2 x 1,500-token prefill;
# scripts/measure/engine_threads.py): 2 threads 8.1 s / 14.8 s, 1 thread
# 8.7 s / 19.5 s (fp32; the same ranking in bf16 and under AVX2 emulation). So: every core, and nothing
# else running beside an in-process engine (see pytest_collection_modifyitems).
torch.set_num_threads(os.cpu_count() or 1)

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
    prefill chunks (long prompts are compacted between chunks), prefix caching off
    for h2o (its chunked-prefill and abort tests count every block)."""
    kw = dict(max_num_batched_tokens=256,
              additional_config={"kv_eviction": policy, "kv_budget": SERVER_BUDGET, **extra})
    if policy == "h2o":
        kw["enable_prefix_caching"] = False
    return kw


kv_bytes = kv_pool_bytes  # the suite's KV pool in a dtype: the same blocks as 96 MiB of bf16


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


def close(llm):
    """Shut the engine down now. Leaving it to the garbage collector would tear
    down vLLM's process-global parallel groups under the next engine."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


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


_STOCK: dict = {}


def stock_ids(model_path: str, dtype: str) -> list[list[int]]:
    """Stock vLLM's greedy tokens for PROMPTS (STOCK_TOKENS each, ignore_eos), in
    a subprocess with the plugin not loaded at all (VLLM_PLUGINS=""); once per
    dtype per session."""
    if dtype not in _STOCK:
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "stock_generate.py"), model_path,
             str(STOCK_TOKENS), "32", dtype, str(kv_bytes(dtype))],
            input=json.dumps(PROMPTS), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ids = json.loads(proc.stdout.split("IDS=")[-1])
        assert [len(x) for x in ids] == [STOCK_TOKENS] * len(PROMPTS)
        _STOCK[dtype] = ids
    return _STOCK[dtype]


# The suite's plugin server: test_server.py, test_load.py, test_soak.py and the plugin's first
# server of test_worker_fault.py (which kills it: the next user gets a new one).
H2O_SERVER_ARGS = ("--kv-eviction", "h2o", "--kv-budget", "64", "--max-num-seqs", "64")
H2O_SERVER_FILES = ("test_load.py", "test_soak.py", "test_server.py", "test_worker_fault.py")


def pytest_collection_modifyitems(session, config, items):
    """The files that use the shared h2o server run last, one after the other, so
    the server is not running beside the in-process engines of other files
    (two busy processes on two cores slow OpenMP regions many times over)."""
    last = [it for it in items if it.path.name in H2O_SERVER_FILES]
    if last:
        order = {name: i for i, name in enumerate(H2O_SERVER_FILES)}
        last.sort(key=lambda it: order[it.path.name])  # stable: file order kept within
        items[:] = [it for it in items if it.path.name not in H2O_SERVER_FILES] + last


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
