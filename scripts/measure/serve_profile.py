"""Where a served workload's time goes in the model worker: py-spy on `vllm serve`.

Starts one server the way `benchmarks/serve_ratio.py` does (vLLM sizes the
cache, compiled mode, `--gpu-memory-utilization 0.85`, then FLAGS), sends one
untimed warm-up request, then samples the worker process (`VLLM::Worker`, where
the model and the plugin's attention run) with `py-spy record --nonblocking`
while N concurrent requests of P prompt tokens run. Prints the samples in
vLLM's attention kernel, in the plugin's CPU scoring kernel (`add_column_sums`),
in its fused attention + scores pass (`attend_add_column_sums`) and under any
other plugin frame, as shares of the worker's samples.

    python scripts/measure/serve_profile.py --workload 8x3000 -- --kv-eviction h2o --kv-budget 0.9
    python scripts/measure/serve_profile.py --workload 8x3000            # stock

Needs py-spy (`.venv/bin/pip install py-spy`); the raw samples go to --out.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import SERVE_FLAGS, make_prompts, parse_workload, run_workload, typed_server  # noqa: E402

VLLM_ATTENTION = "forward (vllm/v1/attention/backends/cpu_attn.py"


def shares(raw: Path) -> tuple[int, Counter]:
    """py-spy raw output (one `frame;frame;... count` line per stack) -> total
    samples, and samples per part: vLLM's attention, the scoring kernel, the
    rest of the plugin (by its outermost plugin frame)."""
    total, parts = 0, Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames, n = stack.split(";"), int(n)
        total += n
        ours = [f.split(" (")[0] for f in frames if "vllm_kvevict" in f]
        if any(VLLM_ATTENTION in f for f in frames):
            parts["vLLM attention (cpu_attention_with_kv_cache)"] += n
        elif ours and ours[-1] == "add_column_sums":
            parts["plugin: scoring kernel (add_column_sums)"] += n
        elif ours and ours[-1] == "attend_add_column_sums":
            parts["plugin: fused attention + scores pass (attend_add_column_sums)"] += n
        elif ours:
            parts[f"plugin: {ours[0]}"] += n
    return total, parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="8x3000", help="NxP: N requests of P prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    ap.add_argument("--out", default="serve_profile.txt", help="py-spy's raw samples")
    ap.add_argument("flags", nargs="*", help="after --: the server's flags (none: stock)")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    from vllm_kvevict.models import ensure_smollm2

    model = ensure_smollm2()
    n, length = parse_workload(args.workload)
    prompts = make_prompts(model, n, length, seed_offset=7)
    srv = typed_server(model, [*shlex.split(SERVE_FLAGS), *args.flags],
                       stock="--kv-eviction" not in args.flags)
    with srv:
        run_workload(srv, [make_prompts(model, 1, 64, seed_offset=3)[0]], 8)
        worker = next(p for p in srv.processes() if "Worker" in p.name())
        rec = subprocess.Popen([spy, "record", "--nonblocking", "-r", str(args.rate),
                                "-p", str(worker.pid), "-f", "raw", "-o", args.out],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)  # py-spy attached
        run = run_workload(srv, prompts, args.max_tokens)
        rec.send_signal(signal.SIGINT)
        rec.wait(120)
    total, parts = shares(Path(args.out))
    print(f"`vllm serve {' '.join(args.flags) or '(stock)'}`: {args.workload}, "
          f"{args.max_tokens} out, {run['wall_s']:.1f} s, {run['tok_s']:.2f} tok/s; "
          f"{total} worker samples at {args.rate}/s\n")
    print("| part | samples | share |\n|---|---:|---:|")
    for name, k in parts.most_common(8):
        print(f"| {name} | {k} | {k / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
