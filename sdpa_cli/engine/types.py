"""The array types every layer names: ``F64``, a float64 array, and ``Index``, a full
index into one (``(batch, head, row, key)``, as findings and mismatches point)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
Index = tuple[int, ...]
