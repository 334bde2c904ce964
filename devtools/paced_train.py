"""examples/gpt/train.py whose every rank pauses after each step, for the launcher's tests.

    python devtools/paced_train.py --pace SECONDS [train.py's arguments]

Why: the launcher's scenarios (a lost host, a morph, every fault of the chaos test) train while they wait for what
they test (a host's check, a new configuration's warm-up, missed heartbeats), and the steps trained meanwhile are
CPU spent on nothing the test looks at, twice (the test then replays every step of the run's history to compare
it). On the suite's 2 cores that CPU is taken from the other tests. A pause of ``SECONDS`` after each ``step`` (the
heartbeats go on from their own thread) trains fewer steps in the same waits; what each step computes is unchanged,
so a paced run equals, to the bit, the same layouts replayed unpaced (``devtools/same_layouts.py``).
"""

import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
sys.path.insert(0, str(EXAMPLE))

from varuna_core import Varuna  # noqa: E402

args = sys.argv[1:]
if len(args) < 2 or args[0] != "--pace":
    sys.exit("usage: devtools/paced_train.py --pace SECONDS [train.py's arguments]")
pace = float(args[1])
step = Varuna.step


def paced_step(self, *a, **k):
    out = step(self, *a, **k)
    time.sleep(pace)
    return out


Varuna.step = paced_step
sys.argv = [str(EXAMPLE / "train.py"), *args[2:]]
runpy.run_path(str(EXAMPLE / "train.py"), run_name="__main__")
