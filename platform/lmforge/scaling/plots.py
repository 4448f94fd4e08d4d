"""PNG plots of a fit (matplotlib, Agg backend: no display needed).

- ``isoflop.png``: loss vs N per budget (points), each budget's parabola (Approach 2) and its minimum (star),
  and the Approach 3 law along the same IsoFLOP line (dashed).
- ``frontier.png``: compute-optimal N*(C) and D*(C): Approach 2 minima and power laws, Approach 3 closed form,
  target budgets marked.
- ``residuals.png``: Approach 3 residuals ln L_obs - ln L_fit against N, coloured by budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np

from lmforge.scaling.approach2 import Approach2Fit
from lmforge.scaling.approach3 import Approach3Fit
from lmforge.scaling.data import Observations


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(n: int):
    plt = _plt()
    cmap = plt.get_cmap("viridis")
    return [cmap(i / max(1, n - 1)) for i in range(n)]


def plot_isoflop(
    obs: Observations,
    fit2: Optional[Approach2Fit],
    fit3: Optional[Approach3Fit],
    path: Path,
    tokens_per_flop_param: float = 6.0,
) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    budgets = obs.budgets()
    minima = {m.budget: m for m in fit2.minima} if fit2 else {}
    for color, c in zip(_colors(len(budgets)), budgets):
        sel = obs.budget == c
        n, loss = obs.n[sel], obs.loss[sel]
        ax.scatter(n, loss, color=color, s=22, label=f"C={c:.2g}")
        grid = np.geomspace(n.min(), n.max(), 100)
        if c in minima:
            m = minima[c]
            ax.plot(grid, np.polyval(m.n_coef, np.log(grid)), color=color, lw=1)
            ax.scatter([m.n_opt], [m.loss_opt], marker="*", s=140, color=color, edgecolor="k", zorder=5)
        if fit3 is not None:
            ax.plot(grid, fit3.law.loss(grid, c / (tokens_per_flop_param * grid)), color=color, lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N (FLOP-equivalent: FLOPs per token / 6)")
    ax.set_ylabel("loss")
    ax.set_title("IsoFLOP profiles (solid: Approach 2 parabola, star: minimum; dashed: Approach 3)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_frontier(
    fit2: Optional[Approach2Fit],
    fit3: Optional[Approach3Fit],
    budgets: Sequence[float],
    targets: Sequence[float],
    path: Path,
) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    lo = min(list(budgets) + list(targets)) / 2
    hi = max(list(budgets) + list(targets)) * 2
    cs = np.geomspace(lo, hi, 100)
    for ax, what in zip(axes, ("N", "D")):
        if fit2 is not None:
            law = fit2.n_law if what == "N" else fit2.d_law
            ax.scatter(
                [m.budget for m in fit2.minima],
                [m.n_opt if what == "N" else m.d_opt for m in fit2.minima],
                color="C0",
                zorder=5,
                label="Approach 2 minima",
            )
            ax.plot(cs, law(cs), color="C0", label=f"Approach 2: {what}* ∝ C^{law.exponent:.3f}")
        if fit3 is not None:
            n, d, _ = fit3.law.optimal(cs)
            exp = fit3.law.a if what == "N" else fit3.law.b
            ax.plot(cs, n if what == "N" else d, color="C1", ls="--", label=f"Approach 3: {what}* ∝ C^{exp:.3f}")
        for t in targets:
            ax.axvline(t, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training FLOPs C")
        ax.set_ylabel("compute-optimal parameters N*" if what == "N" else "compute-optimal tokens D*")
        ax.legend(fontsize=8)
    fig.suptitle("Compute-optimal frontier (dotted lines: target budgets)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_residuals(obs: Observations, fit3: Approach3Fit, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    res = fit3.residuals(obs)
    budgets = obs.budgets()
    for color, c in zip(_colors(len(budgets)), budgets):
        sel = obs.budget == c
        ax.scatter(obs.n[sel], res[sel], color=color, s=22, label=f"C={c:.2g}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("ln L_obs - ln L_fit")
    ax.set_title(f"Approach 3 residuals (rms {np.sqrt(np.mean(res**2)):.4f})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(
    obs: Observations,
    fit2: Optional[Approach2Fit],
    fit3: Optional[Approach3Fit],
    targets: Sequence[float],
    out_dir: Path,
) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"isoflop": plot_isoflop(obs, fit2, fit3, out_dir / "isoflop.png")}
    if fit2 is not None or fit3 is not None:
        paths["frontier"] = plot_frontier(fit2, fit3, obs.budgets(), targets, out_dir / "frontier.png")
    if fit3 is not None:
        paths["residuals"] = plot_residuals(obs, fit3, out_dir / "residuals.png")
    return paths
