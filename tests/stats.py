"""Chi-square goodness of fit without scipy: torch's regularised upper incomplete gamma."""
from __future__ import annotations

import numpy as np
import torch


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """P-value that ``observed`` counts follow ``expected_probs``; cells with tiny expectations are pooled."""
    observed = np.asarray(observed, dtype=np.float64)
    exp = np.asarray(expected_probs, dtype=np.float64) * observed.sum()
    if np.any((exp == 0) & (observed > 0)):
        return 0.0  # a draw the target can never make
    big = exp >= min_expected
    obs_c = np.append(observed[big], observed[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    dof = len(obs_c) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))
