"""Compile every Triton kernel configuration for sm80 (A100) and sm90 (H100) without a GPU and
print shared memory, registers and spills per kernel (ptxas -v) and PTX counts (matrix
instructions, tf32 conversions, global atomics, ex2), all features on (rotary, packed
documents, padding, the four bias kinds): the worst case for registers; ``<kernel>_fire`` rows add
FIRE's MLP (width 32) evaluated per tile.

    env -u TRITON_INTERPRET python benchmarks/triton_compile_report.py --worst-only \
        --json benchmarks/results/triton_compile_report.json > benchmarks/results/triton_compile_report.txt
"""

from __future__ import annotations

import sys

from posenc_lightning.kernels.resource_report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
