"""Engines started per test file, from a KVEVICT_ENGINE_LOG (see sitecustomize.py).

    python scripts/measure/engine_summary.py /tmp/engines.log
"""

import collections
import json
import sys

if __name__ == "__main__":
    rows = [json.loads(line) for line in open(sys.argv[1])]
    per_file = collections.Counter(r["test"].split("::")[0] or "(no test)" for r in rows)
    for name, n in sorted(per_file.items()):
        print(f"{n:4d}  {name}")
    print(f"{len(rows):4d}  engines started in all")
