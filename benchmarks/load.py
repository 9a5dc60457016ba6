"""Load on the OpenAI server, stock vLLM vs the plugin (vllm_kvevict/eval/load.py).

    python benchmarks/load.py                 # ~10 min on 2 CPU cores
    python benchmarks/load.py --quick         # ~2 min
    python benchmarks/load.py --json load.json --plot load.png

The code lives in the package so that tests/test_load.py imports it as any
other module; this file keeps the benchmark where the README lists it.
"""

import sys

from vllm_kvevict.eval.load import main

if __name__ == "__main__":
    sys.exit(main())
