"""Search tiles for the stick-breaking kernels' pinned table (`tile_table.SB_CONFIGS`): compile each
candidate ``(BM, BN, num_warps, num_stages)`` for sm80 and sm90 with every feature on and print
registers and spills (ptxas -v), largest tiles first. Needs ``TRITON_INTERPRET`` unset:

    env -u TRITON_INTERPRET python -m benchmarks.sb_tile_search --kinds sb_fwd --head-dims 64
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

from posenc_lightning.kernels.resource_report import compile_one, format_table

#: candidates, largest first: (BM, BN, num_warps, num_stages)
CANDIDATES = ((64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (32, 32, 4, 1), (32, 16, 4, 1),
              (16, 32, 4, 1), (16, 16, 4, 1), (64, 32, 8, 2), (32, 32, 8, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="*", default=["sb_fwd", "sb_bwd"])
    p.add_argument("--head-dims", nargs="*", type=int, default=[64, 128])
    p.add_argument("--dtypes", nargs="*", default=["float16", "float32"])
    p.add_argument("--targets", nargs="*", type=int, default=[80, 90])
    p.add_argument("--tiles", nargs="*", default=None, help="BMxBNxWARPSxSTAGES, default `CANDIDATES`")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles] if a.tiles else list(CANDIDATES)
    todo = [(k, d, dt, cc, True, (), t) for k in a.kinds for d in a.head_dims for dt in a.dtypes for t in tiles
            for cc in a.targets]
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for row in ex.map(compile_one, *zip(*todo)):  # in order, each as soon as it is there
            rows.append(row)
            print(format_table([row]).splitlines()[2], flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
