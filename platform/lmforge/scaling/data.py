"""The table every fit reads: one row per finished run (budget C, parameters N, tokens D, loss L)."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from lmforge.scaling.errors import ScalingError


@dataclass
class Observations:
    """Arrays of equal length. ``budget`` is the planned FLOP budget (the IsoFLOP group label)."""

    budget: np.ndarray
    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    ids: List[str] = field(default_factory=list)
    # Each run's own budget when ``budget`` holds a group label (Approach 2's log-spaced budget bins).
    true_budget: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.budget = np.asarray(self.budget, dtype=float)
        self.n = np.asarray(self.n, dtype=float)
        self.d = np.asarray(self.d, dtype=float)
        self.loss = np.asarray(self.loss, dtype=float)
        self.true_budget = self.budget.copy() if self.true_budget is None else np.asarray(self.true_budget, dtype=float)
        if not self.ids:
            self.ids = [f"row{i}" for i in range(len(self.loss))]
        sizes = {len(self.budget), len(self.n), len(self.d), len(self.loss), len(self.ids), len(self.true_budget)}
        if len(sizes) != 1:
            raise ScalingError("observations", f"columns have different lengths {sorted(sizes)}", "pass equal-length columns")

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, idx: Sequence[int]) -> "Observations":
        idx = np.asarray(idx, dtype=int)
        return Observations(self.budget[idx], self.n[idx], self.d[idx], self.loss[idx], [self.ids[i] for i in idx],
                            self.true_budget[idx])

    def budgets(self) -> List[float]:
        return sorted(set(self.budget.tolist()))

    def check(self) -> "Observations":
        """Fail fast on values no fit can use (non-positive or non-finite losses, sizes, token counts)."""
        for name, col in (("loss", self.loss), ("N (parameters)", self.n), ("D (tokens)", self.d),
                          ("budget (FLOPs)", self.budget)):
            bad = [i for i, v in enumerate(col) if not (math.isfinite(v) and v > 0)]
            if bad:
                i = bad[0]
                raise ScalingError(
                    f"run '{self.ids[i]}'", f"{name} is {col[i]!r}; every {name} must be a finite positive number "
                    f"({len(bad)} bad row(s))",
                    "drop or re-run that run (a diverged run logs nan/inf); losses are fitted in log space",
                )
        return self


def write_csv(rows: Iterable[Dict], path: Path) -> Path:
    rows = list(rows)
    keys: List[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def observations_from_rows(rows: Sequence[Dict], loss_key: str = "final_val_loss", n_key: str = "n_flops",
                           source: Optional[str] = None) -> Observations:
    """Build observations from collected rows (``sweep collect`` output); rows without the loss are refused."""
    if not rows:
        raise ScalingError(str(source or "results"), "has no rows", "run `lmforge sweep collect` after runs finished")
    missing = [k for k in (loss_key, n_key, "tokens", "budget", "id") if k not in rows[0]]
    if missing:
        raise ScalingError(str(source or "results"), f"has no column(s) {', '.join(missing)}",
                           f"columns present: {', '.join(rows[0])}")

    def num(r: Dict, k: str) -> float:
        v = r.get(k)
        try:
            return float(v) if v not in (None, "") else float("nan")
        except ValueError:
            return float("nan")

    return Observations([num(r, "budget") for r in rows], [num(r, n_key) for r in rows],
                        [num(r, "tokens") for r in rows], [num(r, loss_key) for r in rows],
                        [str(r["id"]) for r in rows])
