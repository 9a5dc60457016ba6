"""python -m vllm_kvevict.cpu_kernel build | info"""
import sys
import time

import torch

from vllm_kvevict import cpu_kernel
from vllm_kvevict.core.eviction.kernel_dispatch import cpu_path
from vllm_kvevict.integration import fused_attention


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "info"
    if cmd == "build":
        t0 = time.monotonic()
        had = cpu_kernel.module() is not None
        cpu_kernel.build(verbose="-v" in argv)
        what = "already built" if had else f"built in {time.monotonic() - t0:.0f} s"
        print(f"CPU scoring kernel {what} ({cpu_kernel.build_dir()}); path: {cpu_path()}")
        return 0
    if cmd == "info":
        print(cpu_path())
        # The fused attention + H2O pass per model dtype, as the engine decides
        # it (none: vLLM's attention and the scoring kernel run apart).
        on = fused_attention.enabled()
        paths = {name: cpu_kernel.fused_isa(dtype) if on else None
                 for name, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32))}
        print("fused attention + H2O: " + ", ".join(f"{n} {p or 'none'}" for n, p in paths.items()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
