"""The layer mode's ``--plot``: step time against (r, d) per case."""

from __future__ import annotations


def write_plot(path: str, rows: list[dict], summaries: list[dict]) -> None:
    """Step time against (r, d) per case, one line per algorithm; the
    adaptive, expert and GShard times as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(summaries)
    columns = min(count, 3)
    lines = -(-count // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 3.8 * lines), squeeze=False)
    for index, s in enumerate(summaries):
        ax = axes[index // columns][index % columns]
        mine = [row for row in rows if row["tokens"] == s["tokens"] and row["factor"] == s["factor"]]
        static = [row for row in mine if row["kind"] == "static"]
        title = f"T={s['tokens']}, f={s['factor']:g} (capacity {s['capacity']})"
        if not static:  # a comparison case: the layer, its experts and the peer side by side
            bars = [(f"adaptive\n{s['adaptive']['config']}", s["adaptive"]["time_ms"]),
                    ("expert\ncompute", s["expert"]["time_ms"])]
            if s["gshard_ms"] is not None:
                bars.append(("GShard-style", s["gshard_ms"]))
            ax.bar(range(len(bars)), [ms for _, ms in bars], color=["tab:green", "tab:gray", "tab:red"][: len(bars)])
            ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
            ax.set_ylabel("step time (ms)")
            ax.set_title(title, fontsize=10)
            continue
        labels: list[str] = []
        for row in static:
            label = "r0" if row["r"] == 0 else f"r{row['r']} d{row['d']}"
            if label not in labels:
                labels.append(label)
        position = {label: i for i, label in enumerate(labels)}
        for algo in dict.fromkeys(row["algo"] for row in static if row["r"] != 0):
            points = [(position[f"r{row['r']} d{row['d']}"], row["time_ms"]) for row in static
                      if row["r"] != 0 and row["algo"] == algo]
            ax.plot(*zip(*points), marker="o", label=algo)
        for row in static:
            if row["r"] == 0:
                ax.plot([position["r0"]], [row["time_ms"]], marker="s", color="black", linestyle="none",
                        label="r0 (data parallel)")
        ax.axhline(s["adaptive"]["time_ms"], color="tab:green", linestyle="--",
                   label=f"adaptive ({s['adaptive']['config']})")
        ax.axhline(s["expert"]["time_ms"], color="tab:gray", linestyle=":", label="expert compute")
        if s["gshard_ms"] is not None:
            ax.axhline(s["gshard_ms"], color="tab:red", linestyle="-.", label="GShard-style")
        ax.set_xticks(range(len(labels)), labels, rotation=45, fontsize=8)
        ax.set_ylabel("step time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    for index in range(count, lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle("moe_runtime.MoELayer: step time (forward + backward) against (r, d)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)

