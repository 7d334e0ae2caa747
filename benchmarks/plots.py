"""How every benchmark figure ends: a legend, a light grid, and the PNG written where the table says."""

from __future__ import annotations

from pathlib import Path


def finish(fig, ax, png: Path, *, legend_size: int = 8, grid_axis: str = "both") -> None:
    """Give `ax` its legend and grid, lay `fig` out and write it to `png` (its folder made if missing)."""
    ax.legend(fontsize=legend_size)
    ax.grid(axis=grid_axis, alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
