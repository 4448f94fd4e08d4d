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
    # Each run's cluster when runs share a trajectory (cooldown branches of one stable run: ``stable_run``), else
    # None; the bootstrap then resamples whole clusters.
    groups: Optional[List[str]] = None

    def __post_init__(self) -> None:
        self.budget = np.asarray(self.budget, dtype=float)
        self.n = np.asarray(self.n, dtype=float)
        self.d = np.asarray(self.d, dtype=float)
        self.loss = np.asarray(self.loss, dtype=float)
        self.true_budget = self.budget.copy() if self.true_budget is None else np.asarray(self.true_budget, dtype=float)
        if not self.ids:
            self.ids = [f"row{i}" for i in range(len(self.loss))]
        sizes = {len(self.budget), len(self.n), len(self.d), len(self.loss), len(self.ids), len(self.true_budget)}
        if self.groups is not None:
            self.groups = [str(g) for g in self.groups]
            sizes.add(len(self.groups))
        if len(sizes) != 1:
            raise ScalingError(
                "observations", f"columns have different lengths {sorted(sizes)}", "pass equal-length columns"
            )

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, idx: Sequence[int]) -> "Observations":
        idx = np.asarray(idx, dtype=int)
        return Observations(
            self.budget[idx],
            self.n[idx],
            self.d[idx],
            self.loss[idx],
            [self.ids[i] for i in idx],
            self.true_budget[idx],
            [self.groups[i] for i in idx] if self.groups is not None else None,
        )

    def clustered(self) -> bool:
        """True when some cluster (stable run) holds more than one run."""
        return self.groups is not None and len(set(self.groups)) < len(self.groups)

    def budgets(self) -> List[float]:
        return sorted(set(self.budget.tolist()))

    def check(self) -> "Observations":
        """Fail fast on values no fit can use (non-positive or non-finite losses, sizes, token counts)."""
        for name, col in (
            ("loss", self.loss),
            ("N (parameters)", self.n),
            ("D (tokens)", self.d),
            ("budget (FLOPs)", self.budget),
        ):
            bad = [i for i, v in enumerate(col) if not (math.isfinite(v) and v > 0)]
            if bad:
                i = bad[0]
                raise ScalingError(
                    f"run '{self.ids[i]}'",
                    f"{name} is {col[i]!r}; every {name} must be a finite positive number ({len(bad)} bad row(s))",
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


def observations_from_rows(
    rows: Sequence[Dict], loss_key: str = "final_val_loss", n_key: str = "n_flops", source: Optional[str] = None
) -> Observations:
    """Build observations from collected rows (``sweep collect`` output); rows without the loss are refused."""
    if not rows:
        raise ScalingError(str(source or "results"), "has no rows", "run `lmforge sweep collect` after runs finished")
    missing = [k for k in (loss_key, n_key, "tokens", "budget", "id") if k not in rows[0]]
    if missing:
        raise ScalingError(
            str(source or "results"), f"has no column(s) {', '.join(missing)}", f"columns present: {', '.join(rows[0])}"
        )

    def num(r: Dict, k: str) -> float:
        v = r.get(k)
        try:
            return float(v) if v not in (None, "") else float("nan")
        except ValueError:
            return float("nan")

    branched = any(r.get("stable_run") for r in rows)  # cooldown branches: clustered by their stable run
    return Observations(
        [num(r, "budget") for r in rows],
        [num(r, n_key) for r in rows],
        [num(r, "tokens") for r in rows],
        [num(r, loss_key) for r in rows],
        [str(r["id"]) for r in rows],
        groups=[str(r.get("stable_run") or r["id"]) for r in rows] if branched else None,
    )


# ---- external tables: any CSV/JSONL of runs (published tables, other frameworks) ---------------------------

TABLE_SUFFIXES = (".csv", ".jsonl")
TOKENS_PER_PARAM_RANGE = (1e-2, 1e5)  # a median outside this is a units mistake, not a training run


@dataclass
class TableColumns:
    """Which column holds what, and the factor that turns each column into its unit:
    N in parameters, D in tokens, C in training FLOPs, loss in nats per token."""

    n: str
    loss: str
    d: Optional[str] = None
    c: Optional[str] = None
    id: Optional[str] = None
    n_scale: float = 1.0
    d_scale: float = 1.0
    c_scale: float = 1.0

    def describe(self) -> Dict:
        return {
            "n": f"{self.n} x {self.n_scale:g} = parameters",
            "loss": f"{self.loss} = nats/token",
            "d": f"{self.d} x {self.d_scale:g} = tokens" if self.d else "C / (6 N)",
            "c": f"{self.c} x {self.c_scale:g} = FLOPs" if self.c else "6 N D",
            "id": self.id or "row number",
        }


def read_table(path: Path) -> List[Dict]:
    """Rows of a CSV (header line) or JSON-lines file; anything else is refused."""
    path = Path(path)
    if not path.is_file():
        raise ScalingError(str(path), "no such file", "pass a CSV or JSONL table of runs (or a sweep directory)")
    if path.suffix not in TABLE_SUFFIXES:
        raise ScalingError(
            str(path),
            f"has suffix '{path.suffix}'; tables are read from {', '.join(TABLE_SUFFIXES)}",
            "export the table as CSV (one header line) or JSON lines (one object per run)",
        )
    try:
        if path.suffix == ".csv":
            return read_csv(path)
        import json

        rows = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ScalingError(
                        f"{path}:{i}", "is not a JSON object", 'write one {"column": value} object per line'
                    )
                rows.append(row)
        return rows
    except (UnicodeDecodeError, ValueError) as e:
        raise ScalingError(
            str(path),
            f"is not a readable {path.suffix[1:].upper()} table ({type(e).__name__})",
            "check the file's format and encoding (UTF-8)",
        ) from None


def observations_from_table(rows: Sequence[Dict], cols: TableColumns, source: str) -> Observations:
    """Observations from an external table: N from ``cols.n``, D from ``cols.d`` or C / (6N), the budget from
    ``cols.c`` or 6 N D; every value must be a number, and the units must be plausible."""
    if not rows:
        raise ScalingError(source, "has no rows", "pass a table with one row per run")
    if cols.d is None and cols.c is None:
        raise ScalingError(
            "scaling fit",
            "neither --d-col nor --c-col given",
            "name the tokens column (--d-col) or the training-FLOPs column (--c-col)",
        )
    present = list(rows[0])
    for flag, name in (
        ("--n-col", cols.n),
        ("--loss-col", cols.loss),
        ("--d-col", cols.d),
        ("--c-col", cols.c),
        ("--id-col", cols.id),
    ):
        if name is not None and name not in present:
            raise ScalingError(f"{flag} {name}", f"is not a column of {source}", f"columns: {', '.join(present)}")

    def col(name: str, scale: float) -> np.ndarray:
        out = np.empty(len(rows))
        for i, r in enumerate(rows):
            try:
                out[i] = float(r.get(name)) * scale
            except (TypeError, ValueError):
                raise ScalingError(
                    f"{source} row {i + 1}",
                    f"column '{name}' holds {r.get(name)!r}, not a number",
                    "fix or remove that row",
                ) from None
        return out

    n, loss = col(cols.n, cols.n_scale), col(cols.loss, 1.0)
    d = col(cols.d, cols.d_scale) if cols.d else None
    c = col(cols.c, cols.c_scale) if cols.c else None
    if d is None:
        d = c / (6.0 * n)
    if c is None:
        c = 6.0 * n * d
    ids = [str(r.get(cols.id)) for r in rows] if cols.id else [f"row{i + 1}" for i in range(len(rows))]
    obs = Observations(c, n, d, loss, ids).check()
    if cols.d and cols.c:
        ratio = float(np.median(c / (6.0 * n * d)))
        if not 1 / 3 <= ratio <= 3:
            raise ScalingError(
                f"{source}",
                f"C / (6 N D) is {ratio:.3g} (median over rows): the FLOPs, parameter and "
                "token columns are not in consistent units",
                "state each column's unit with --n-scale/"
                "--d-scale/--c-scale (e.g. --n-scale 1e6 for millions of parameters)",
            )
    tpp = float(np.median(d / n))
    lo, hi = TOKENS_PER_PARAM_RANGE
    if not lo <= tpp <= hi:
        raise ScalingError(
            f"{source}",
            f"the median run has {tpp:.3g} tokens per parameter, outside {lo:g}..{hi:g}: a column is in the wrong unit",
            "state each column's unit with --n-scale/--d-scale/--c-scale "
            "(N in parameters, D in tokens, C in FLOPs; e.g. --n-scale 1e6 for millions)",
        )
    if float(loss.max()) > 30:
        raise ScalingError(
            f"{source} column '{cols.loss}'",
            f"holds values up to {loss.max():.3g}: that is a perplexity or a loss in bits/sequence, not nats/token",
            "give the cross-entropy in nats per token (ln of the perplexity)",
        )
    return obs


def drop_highest_losses(obs: Observations, k: int) -> tuple[Observations, List[str]]:
    """The table without its ``k`` highest-loss runs (as published replications do), and their ids."""
    if k < 0 or k >= len(obs):
        raise ScalingError(
            f"--drop-highest-loss {k}",
            f"must be in 0..{len(obs) - 1} for a table of {len(obs)} runs",
            "drop fewer runs",
        )
    order = np.argsort(obs.loss, kind="stable")
    keep = np.sort(order[: len(obs) - k])
    return obs.subset(keep), [obs.ids[i] for i in order[len(obs) - k :]]
