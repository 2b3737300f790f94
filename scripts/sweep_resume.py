"""The whole sweep of drawn programs: each resumed from every checkpoint, to the bit.

The suite draws one program per lowering and one sharded program per commit
(``tests/compiled/test_drawn_programs.py``); this draws many, with the same check
(``tests/compiled/drawn.py``), each under the machine profile it draws
(``tests/profiles.py``) unless ``--profile`` names one:

    python scripts/sweep_resume.py                       # 24 seeds from 0, both lowerings
    python scripts/sweep_resume.py --count 100 --first 1000 --lowering compiled
    python scripts/sweep_resume.py --sharded --count 12  # 2 or 3 ranks, full or optimizer
    python scripts/sweep_resume.py --profile default-threads

It prints one line per program and exits 1 when any resume differs; a failing
program is made again with ``SEXPGPU_DRAWN_SEED=SEED`` in the test, or ``--first
SEED --count 1`` here. The compiled programs share one torch compile cache (a fresh
folder unless ``TORCHINDUCTOR_CACHE_DIR`` is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.compiled.drawn import check_resumes, draw, draw_sharded, sexpgpu_runner  # noqa: E402
from tests.profiles import PROFILES, profile_env  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--count", type=int, default=24, help="programs per lowering")
    parser.add_argument("--lowering", choices=["torch", "compiled", "both"], default="both")
    parser.add_argument("--sharded", action="store_true", help="programs on 2 or 3 ranks")
    parser.add_argument("--profile", choices=sorted(PROFILES), help="instead of the drawn one")
    options = parser.parse_args()
    lowerings = ["torch", "compiled"] if options.lowering == "both" else [options.lowering]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="sexpgpu-sweep-") as scratch:
        env = {**os.environ, "SEXPGPU_LOG_FORMAT": "json"}
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(scratch) / "compile-cache"))
        for lowering in lowerings:
            for seed in range(options.first, options.first + options.count):
                drawn = draw_sharded(seed) if options.sharded else draw(seed, lowering=lowering)
                run = sexpgpu_runner(profile_env(options.profile or drawn.profile, env))
                started = time.perf_counter()
                folder = Path(scratch) / f"{lowering}-{seed}"
                differences = check_resumes(drawn, folder, lowering=lowering, run=run)
                seconds = time.perf_counter() - started
                verdict = "same" if not differences else "DIFFERS"
                print(f"{lowering:8} {drawn.name()}  {verdict}  ({seconds:.0f} s)", flush=True)
                for line in differences:
                    print(f"    {line.splitlines()[0] if line else line}", flush=True)
                failed += bool(differences)
    total = options.count * len(lowerings)
    print(f"{total - failed} of {total} programs resumed to the bit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
