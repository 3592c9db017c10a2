"""The checkout's root on sys.path, for a benchmark run as a file.

`python bench/p1_noop_action.py` puts bench/ itself first on sys.path, not the
root that `bench` and `cudahook` are imported from; each runnable file imports
this module first when it has no package (`import _checkout`), and
bench/common.py reads the root from here. Run as a module (`python -m bench`,
`python -m bench.p1_noop_action`) the root is on sys.path already.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
