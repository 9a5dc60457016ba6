"""`python -m vllm_kvevict.gpu_check --out DIR [--dry-run]`: see the package docstring."""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_kvevict.gpu_check",
                                 description="Check and time the CUDA path (Triton kernels and "
                                             "the vLLM-free core) on a GPU; no vLLM needed.")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU: Triton's interpreter, tiny shapes, minutes")
    ap.add_argument("--sections", default="correctness,core,syncs,timing",
                    help="comma-separated subset of: correctness, core, syncs, timing")
    args = ap.parse_args(argv)
    if args.dry_run:
        # Before any Triton kernel module is imported: the interpreter decides at import.
        os.environ["TRITON_INTERPRET"] = "1"
    from vllm_kvevict.gpu_check import cases, core_on_device, correctness, report, syncs, timing

    t = cases.target(args.dry_run)
    sections = {"correctness": correctness.run, "core": core_on_device.run,
                "syncs": syncs.run, "timing": timing.run}
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(sections))
    if unknown:
        ap.error(f"unknown section(s) {unknown}; known: {sorted(sections)}")
    results, seconds = {}, {}
    start = time.perf_counter()
    for name in wanted:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        results[name] = sections[name](t)
        seconds[name] = time.perf_counter() - t0
    total = time.perf_counter() - start
    doc = report.write(args.out, t, results, seconds, total, argv if argv is not None
                       else sys.argv[1:])
    print(doc)
    failed = report.failures(results)
    print(f"[gpu_check] {len(failed)} failed check(s); wrote {args.out}/gpu_check.md and "
          f"gpu_check.json in {total:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
