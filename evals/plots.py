"""Matplotlib for the evals' figures: loaded on the Agg backend only when a
figure is drawn, and optional (no figure where it is not installed)."""

from __future__ import annotations

import sys


def load_pyplot():
    """(matplotlib, pyplot) on the Agg backend; (None, None) where it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None, None
    return matplotlib, plt


def save_figure(plt, fig, path: str) -> bool:
    """Lay out, write and close ``fig``; True (for the callers' return)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
