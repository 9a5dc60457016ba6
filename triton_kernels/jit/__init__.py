"""Pure ``@triton.jit`` kernels; their launchers (shape, dtype and stride checks)
are the modules one level up. Nothing here allocates or checks anything."""
