"""The parametric law and its compute-optimal allocation.

    L(N, D) = E + A / N^alpha + B / D^beta                       (Hoffmann et al. 2022, eq. 2)

Under the constraint C = 6 N D the loss-minimising allocation is (their eq. 4)

    N_opt(C) = G (C/6)^a,   D_opt(C) = G^-1 (C/6)^b,
    a = beta / (alpha + beta),  b = alpha / (alpha + beta),  G = (alpha A / (beta B))^(1 / (alpha + beta)).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from lmforge.scaling.errors import ScalingError

# The fitted law reported by Hoffmann et al. (2022), used to generate synthetic test data.
CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


@dataclass(frozen=True)
class Law:
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        n = np.asarray(n, dtype=float)
        d = np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    @property
    def has_optimum(self) -> bool:
        """True when the law decreases in both N and D with finite coefficients, so it has a compute-optimal
        allocation (a coefficient that under- or overflowed to 0 or inf gives none)."""
        return bool(self.alpha > 0 and self.beta > 0 and 0 < self.A < np.inf and 0 < self.B < np.inf)

    def optimal(self, c):
        """(N_opt, D_opt, L_opt) for budgets ``c`` under C = 6 N D."""
        if not self.has_optimum:
            raise ScalingError(
                "Approach 3",
                f"the fitted law (alpha={self.alpha:.3g}, beta={self.beta:.3g}) does not decrease in both "
                "N and D, so it has no compute-optimal allocation",
                "the runs do not constrain the law: add budgets/sizes, or check the residual plot for bad runs",
            )
        c = np.asarray(c, dtype=float)
        n = self.G * (c / 6.0) ** self.a
        d = (c / 6.0) ** self.b / self.G
        return n, d, self.loss(n, d)

    def as_dict(self) -> dict:
        return {**asdict(self), "a": self.a, "b": self.b, "G": self.G}


CHINCHILLA_LAW = Law(**CHINCHILLA)
