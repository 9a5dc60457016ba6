"""CPU seconds by kind of process, from a KVEVICT_CPU_LOG (see sitecustomize.py).

    python scripts/measure/cpu_summary.py /tmp/cpu.log
"""

import collections
import json
import sys


def kind(row: dict) -> str:
    argv = " ".join(row["argv"])
    if row.get("pytest"):  # the pytest process or an xdist worker (argv `-c`)
        return "pytest / xdist workers (in-process engines, references)"
    if "cli/main.py serve" in argv or "vllm serve" in argv:
        return "vllm serve (API server)"
    if argv.startswith("-c"):  # multiprocessing's spawn: engine cores, workers, Ray
        return f"spawned child ({row['test'].split('::')[0] or 'of a server or engine'})"
    return argv.split()[0].rsplit("/", 1)[-1]


if __name__ == "__main__":
    rows = [json.loads(line) for line in open(sys.argv[1])]
    cpu, n = collections.Counter(), collections.Counter()
    for r in rows:
        cpu[kind(r)] += r["cpu"]
        n[kind(r)] += 1
    for k, s in cpu.most_common():
        print(f"{s:8.1f} s  {n[k]:4d}  {k}")
    print(f"{sum(cpu.values()):8.1f} s  {len(rows):4d}  in all (processes that exited)")
