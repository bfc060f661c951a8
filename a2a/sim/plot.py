"""``python -m a2a.sim predict --plot FILE.png``: predicted time (or busbw)
against GPU count (one panel per size, as Tutel's Figure 18) or against size
(one panel per GPU count), one line per preset and algorithm. Needs
matplotlib, which is optional: without it, :func:`write_plot` raises
RuntimeError saying so."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["write_plot"]


def write_plot(path: str, records: Sequence[dict], *, x: str = "ranks", y: str = "time", title: str = "") -> None:
    """Draw `records` (``predict --json``'s: preset, ranks, size, algo, time_s,
    busbw) to `path`. `x`: "ranks" (a panel per size) or "size" (a panel per
    ranks); `y`: "time" (ms) or "busbw" (GB/s)."""
    if x not in ("ranks", "size") or y not in ("time", "busbw"):
        raise ValueError(f"x must be ranks or size and y time or busbw, got x={x!r}, y={y!r}")
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed (pip install 'a2a[plots]' or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panel_key = "size" if x == "ranks" else "ranks"
    panels = sorted({r[panel_key] for r in records})
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.9), squeeze=False)
    styles = {"linear": ("tab:blue", "o"), "2dh": ("tab:orange", "s")}
    dashes = ["-", "--", ":", "-."]
    presets = list(dict.fromkeys(r["preset"] for r in records))
    for ax, value in zip(axes[0], panels):
        mine = [r for r in records if r[panel_key] == value]
        for p_index, name in enumerate(presets):
            for algo in dict.fromkeys(r["algo"] for r in mine):
                points = sorted((r[x], r["time_s"] * 1e3 if y == "time" else r["busbw"] / 1e9)
                                for r in mine if r["algo"] == algo and r["preset"] == name)
                if not points:
                    continue
                color, marker = styles.get(algo, ("tab:gray", "^"))
                label = algo if len(presets) == 1 else f"{name} {algo}"
                ax.plot(*zip(*points), marker=marker, color=color, linestyle=dashes[p_index % len(dashes)],
                        label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (ranks)" if x == "ranks" else "bytes per rank")
        ax.set_ylabel("predicted time (ms)" if y == "time" else "predicted busbw (GB/s)")
        ax.set_title(_size_text(value) if panel_key == "size" else f"{value} ranks", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(title or "a2a.sim: predicted all-to-all, linear vs 2DH", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"
