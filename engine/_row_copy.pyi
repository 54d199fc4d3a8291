"""Types of the compiled row copies (``_row_copy.c``, which documents them)."""

from collections.abc import Sequence

import numpy as np

def copy_rows(
    targets: Sequence[np.ndarray], sources: Sequence[np.ndarray], target_rows: list[int], source_rows: list[int], /
) -> None: ...
