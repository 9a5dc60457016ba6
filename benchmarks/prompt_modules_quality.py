"""Retrieval quality of prompt modules vs plain prompts
(vllm_kvevict/eval/prompt_modules_quality.py).

    python benchmarks/prompt_modules_quality.py              # default run (~15 min, 2 cores)
    python benchmarks/prompt_modules_quality.py --quick      # a few minutes
    python benchmarks/prompt_modules_quality.py --json out.json --dense-check 0

The code lives in the package so that tests/test_prompt_modules_quality.py
imports it as any other module; this file keeps the benchmark where the README
lists it.
"""

import sys

from vllm_kvevict.eval.prompt_modules_quality import main

if __name__ == "__main__":
    sys.exit(main())
