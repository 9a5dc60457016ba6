"""What the benchmark scripts share: workload prompts, the record of which code
ran, the child-process result marker, number formatting, and the timers that
split the plugin's per-step time into scoring, compaction and bookkeeping.

A script imports these from here (`from common import ...`: `python
benchmarks/X.py` puts this folder on sys.path), never from a sibling script.

The timers reach into the plugin's internals on purpose: the breakdown is per
function, and the functions that do the work (`WorkerEviction._compact`,
`_compaction_scores`, the backend's `score_step`) have no public seam that times
them exclusively. They are all named in `PER_STEP` below, so a rename in the
plugin fails here, at install time, naming the entry.
"""

from __future__ import annotations

import functools
import json
import subprocess
import time
from collections import defaultdict
from pathlib import Path

RESULT_MARKER = "@@KVEVICT_RESULT@@ "  # a child process's result line on stdout
KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
CATEGORIES = ("scoring", "compaction", "bookkeeping")


def fmt(v, spec=""):
    """`v` formatted, '-' for None (a missing stock run, a failed row)."""
    return "-" if v is None else format(v, spec)


# --------------------------------------------------------------------------- servers


# What serve_ratio and serve_profile give every server, stock too: vLLM's own
# startup check wants 0.92 of RAM free when the worker starts, which a 24 GiB
# machine misses by ~0.2 GiB on some starts (README).
SERVE_FLAGS = "--gpu-memory-utilization 0.85"


def typed_server(model: str, flags: list[str], *, stock: bool = False, timeout: float = 900):
    """`vllm serve MODEL FLAGS` exactly as a user types it (not yet started):
    none of the suite's defaults (eval/server.py DEFAULT_ARGS) and no
    VLLM_CPU_KVCACHE_SPACE, so vLLM sizes the KV cache itself. stock: our
    plugin not loaded at all."""
    from vllm_kvevict.eval.server import Server

    srv = Server(model, *flags, stock=stock, defaults=(), start_timeout=timeout)
    srv.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return srv


def parse_workload(text: str) -> tuple[int, int]:
    """'8x3000' -> (8 requests, 3000 prompt tokens)."""
    n, _, p = text.partition("x")
    return int(n), int(p)


def run_workload(srv, prompts: list[list[int]], max_tokens: int, timeout: float = 1800) -> dict:
    """Send every prompt (token ids) to `srv`'s /v1/completions at once, greedy,
    ignore_eos; wall time until the last completes, completion tokens, tokens/s."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    body = {"model": srv.model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    def post(prompt):
        r = requests.post(srv.url + "/v1/completions", json={**body, "prompt": prompt},
                          timeout=timeout)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(post, prompts))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}

# --------------------------------------------------------------------------- workload


def corpus_text() -> str:
    """Real English text: the GPL-3 text, then Python's pydoc topics."""
    parts = []
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        parts.append(gpl.read_text(encoding="utf-8", errors="replace"))
    from pydoc_data.topics import topics

    parts.extend(topics[k] for k in sorted(topics))
    return "\n\n".join(parts)


def make_prompts(model: str, num: int, length: int, seed_offset: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `length` token ids, sliced from the corpus at
    distinct, spread-out offsets (so no two share a first KV block)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(corpus_text(), add_special_tokens=False)["input_ids"]
    span = len(ids) - length
    if span < num:
        raise SystemExit(f"corpus has {len(ids)} tokens: too short for {num} x {length}")
    stride = span // num
    return [ids[seed_offset + i * stride: seed_offset + i * stride + length]
            for i in range(num)]


def kv_bytes_per_token(model: str, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """2 (K and V) * layers * kv heads * head dim * element bytes: the model
    dtype's, or one for an fp8 cache (vLLM's --kv-cache-dtype fp8 / fp8_e5m2)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    element = KV_DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else 1
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * element


# --------------------------------------------------------------------------- which code ran


def plugin_fingerprint() -> str:
    """Short hash of the plugin's source as this process imported it (the
    working tree may change under a long run: this makes that visible),
    the CPU kernel's C++ included."""
    import hashlib

    import vllm_kvevict

    h = hashlib.sha1()
    root = Path(vllm_kvevict.__file__).resolve().parent.parent
    for sub in ("vllm_kvevict", "patches"):
        for f in sorted(f for ext in ("py", "cpp", "h") for f in (root / sub).rglob(f"*.{ext}")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:10]


def git_head() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "vllm_kvevict", "patches"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------- timers


class Timers:
    """Wall time per category of wrapped functions, exclusive (nested calls are
    subtracted from their caller) unless `exclusive` is False, plus call
    counts per function name."""

    def __init__(self, exclusive: bool = True) -> None:
        self.exclusive = exclusive
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []  # child time of each open call

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def patch(self, owner, name: str, category: str) -> None:
        """Replace owner.name (a class method or a module global) by a timed wrapper."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                child = self._stack.pop()
                self.seconds[category] += dt - child if self.exclusive else dt
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += dt

        setattr(owner, name, timed)


# (module, attribute path, name, category): where each per-step function is
# looked up: methods on their classes, module-level functions in the module
# that calls them.
PER_STEP = (
    ("vllm_kvevict.integration.cpu_backend", "", "score_step", "scoring"),  # by the Impl's forward
    ("vllm_kvevict.core.scoring.decode_log", "DecodeQueryLog", "flush", "scoring"),
    ("vllm_kvevict.core.scoring.chunk_log", "ChunkLog", "flush", "scoring"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compaction_scores", "scoring"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "_compact", "compaction"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "begin_step", "bookkeeping"),
    ("vllm_kvevict.integration.worker", "WorkerEviction", "place_queries", "bookkeeping"),
    ("vllm_kvevict.integration.cpu_backend", "", "physical_metadata", "bookkeeping"),  # by the builder
    ("vllm_kvevict.integration.spec", "EvictableAttentionManager", "remove_skipped_blocks",
     "bookkeeping"),
)


def install_timers(entries=PER_STEP, exclusive: bool = True) -> Timers:
    """Wrap the functions named by `entries` ((module, owner, name, category)
    as in `PER_STEP`, the plugin's per-step functions by default) with one
    `Timers`."""
    import importlib

    t = Timers(exclusive)
    for module, owner, name, category in entries:
        obj = importlib.import_module(module)
        if owner:
            obj = getattr(obj, owner)
        if not hasattr(obj, name):
            raise AttributeError(f"benchmarks timers: {module}.{owner or ''}"
                                 f"{'.' if owner else ''}{name} no longer exists")
        t.patch(obj, name, category)
    return t
