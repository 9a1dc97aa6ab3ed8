"""The study's PNG plots (matplotlib, Agg: no display needed), drawn from `summary.json`'s cells
alone, so they can be redrawn without the run directories.

One colour per variant, one column per learning-rate setting; a group's line is the mean over its
measured seeds and its shaded band the range of the seeds (drilled cells are drawn only in the
loss curves, dotted). Log axes label only their major ticks (a few per decade at most, plain
numbers), so labels never overlap. Every plot is written
even without data (a panel then says what is missing), so the report's links always resolve.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from trinity_train.model.blocks import BLOCK_VARIANTS  # noqa: E402
from trinity_train.files import atomic_open  # noqa: E402

COLORS = dict(zip(BLOCK_VARIANTS, plt.get_cmap("tab10").colors))
NO_LAYERS = "no layer statistics\n(metrics.layer_stats_every = 0?)"


def _save(fig, path: Path) -> None:
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _grid(rows: int, cols: int, width: float = 4.2, height: float = 3.2):
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout="constrained")
    return fig, axes


_PLAIN = FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1000 else f"{value:.3g}")  # 0.25, 1,000: no 1e+03


def _log_axis(ax) -> None:
    """A log y axis whose labels cannot overlap: within about a decade, 1-2-5 steps; wider, only the
    decades (1, 10, 100, ...); minor ticks unlabelled."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    decades = math.log10(high / low) if low > 0 and high > low else 1.0
    subs = (1.0, 2.0, 5.0) if decades <= 1.2 else (1.0, 3.0) if decades <= 2.5 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    ax.yaxis.set_major_formatter(_PLAIN)
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10)), numticks=12))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _per_layer(lists: list[list | None], reduce) -> list[float | None]:
    """`reduce` of each layer's values over the cells' per-layer lists, ignoring missing values."""
    lists = [values for values in lists if values]
    if not lists:
        return []
    out = []
    for i in range(max(len(values) for values in lists)):
        kept = [values[i] for values in lists if i < len(values) and _finite(values[i])]
        out.append(reduce(kept) if kept else None)
    return out


def _mean_profile(lists: list[list | None]) -> list[float | None]:
    return _per_layer(lists, lambda kept: sum(kept) / len(kept))


def _profile_lists(cells: list[dict], point: str, *path: str) -> list[list | None]:
    """Each cell's per-layer list at `measures.layers[point][path...]`."""
    lists = []
    for cell in cells:
        value = ((cell.get("measures") or {}).get("layers") or {}).get(point)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        lists.append(value if isinstance(value, list) else None)
    return lists


def _profile(cells: list[dict], point: str, *path: str) -> list[float | None]:
    """The mean over `cells` of the per-layer list at `measures.layers[point][path...]`."""
    return _mean_profile(_profile_lists(cells, point, *path))


def _plot_group(ax, cells: list[dict], point: str, path: tuple[str, ...], label: str, color, style: str = "-") -> bool:
    """A group's mean per-layer line and, with more than one seed, the band of its seeds' range."""
    lists = _profile_lists(cells, point, *path)
    drew = _plot_layers(ax, _mean_profile(lists), label, color, style)
    low, high = _per_layer(lists, min), _per_layer(lists, max)
    band = [(i, a, b) for i, (a, b) in enumerate(zip(low, high)) if _finite(a) and _finite(b)]
    if drew and band and sum(1 for values in lists if values) > 1:
        ax.fill_between([i for i, _, _ in band], [a for _, a, _ in band], [b for _, _, b in band],
                        color=color, alpha=0.15, linewidth=0)
    return drew


def _by_group(cells: list[dict], lr: str) -> dict[str, list[dict]]:
    """The measured (not drilled) cells of LR setting `lr`, by variant, in the cells' order."""
    out: dict[str, list[dict]] = {}
    for cell in cells:
        if cell["lr"] == lr and not cell["drilled"]:
            out.setdefault(cell["variant"], []).append(cell)
    return out


def _plot_layers(ax, values: list, label: str, color, style: str = "-") -> bool:
    points = [(i, v) for i, v in enumerate(values) if _finite(v)]
    if not points:
        return False
    ax.plot([i for i, _ in points], [v for _, v in points], style, color=color, label=label, marker=".")
    return True


def _finish(ax, drew: bool, xlabel: str, ylabel: str, title: str, log: bool = False, empty: str = NO_LAYERS) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not drew:
        _empty(ax, empty)
        return
    if log:
        _log_axis(ax)
    if xlabel == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, not 200000
    elif xlabel == "layer":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def loss_curves(cells: list[dict], lrs: list[str], path: Path) -> None:
    fig, axes = _grid(2, len(lrs))
    for col, lr in enumerate(lrs):
        top, bottom = axes[0][col], axes[1][col]
        drew_train = drew_val = False
        labelled = set()
        for cell in (c for c in cells if c["lr"] == lr):
            m = cell.get("measures") or {}
            style = ":" if cell["drilled"] else "-"
            # one legend entry per variant (its seeds share the colour), and one per drilled cell
            key = (cell["variant"], cell["drilled"])
            label = "_nolegend_" if key in labelled else cell["variant"] + (" (drill)" if cell["drilled"] else "")
            labelled.add(key)
            curve = m.get("train_curve") or {}
            if curve.get("tokens"):
                top.plot(curve["tokens"], curve["loss"], style, color=COLORS[cell["variant"]], lw=1, alpha=0.8, label=label)
                drew_train = True
            val = [(p["tokens"], p["val_loss"]) for p in m.get("val") or [] if _finite(p.get("tokens"))]
            if val:
                bottom.plot(*zip(*val), style, color=COLORS[cell["variant"]], marker=".", lw=1, alpha=0.8, label=label)
                drew_val = True
        _finish(top, drew_train, "tokens", "train loss (EMA)", f"LR {lr}: train loss", empty="no train records")
        _finish(bottom, drew_val, "tokens", "validation loss", f"LR {lr}: validation loss", empty="no validation")
    _save(fig, path)


def grad_norm_by_layer(cells: list[dict], lrs: list[str], path: Path) -> None:
    points = ("10%", "50%", "100%")
    fig, axes = _grid(len(lrs), len(points))
    for row, lr in enumerate(lrs):
        for col, point in enumerate(points):
            ax, drew = axes[row][col], False
            for variant, members in _by_group(cells, lr).items():
                drew |= _plot_group(ax, members, point, ("grad_norm",), variant, COLORS[variant])
            _finish(ax, drew, "layer", "grad norm (attn + FFN)", f"LR {lr}, {point} of training", log=True)
    _save(fig, path)


def _end_profiles(cells: list[dict], lrs: list[str], path: Path, panels: list[tuple[tuple[str, ...], str, bool]]) -> None:
    """One row per panel (a per-layer list at 100 %, its y label, log scale), one column per LR."""
    fig, axes = _grid(len(panels), len(lrs))
    for row, (key, ylabel, log) in enumerate(panels):
        for col, lr in enumerate(lrs):
            ax, drew = axes[row][col], False
            for variant, members in _by_group(cells, lr).items():
                drew |= _plot_group(ax, members, "100%", key, variant, COLORS[variant])
            _finish(ax, drew, "layer", ylabel, f"LR {lr}, end of training", log=log)
    _save(fig, path)


def residual_rms_by_layer(cells: list[dict], lrs: list[str], path: Path) -> None:
    _end_profiles(cells, lrs, path, [(("residual_rms",), "residual RMS after the block", True)])


def activations_by_layer(cells: list[dict], lrs: list[str], path: Path) -> None:
    _end_profiles(cells, lrs, path, [(("act_kurtosis",), "excess kurtosis of block output", False),
                                     (("act_max_over_median",), "max|a| / median|a|", True)])


def post_norm_gains(cells: list[dict], lrs: list[str], path: Path) -> None:
    fig, axes = _grid(1, len(lrs))
    for col, lr in enumerate(lrs):
        ax, drew = axes[0][col], False
        for variant, members in _by_group(cells, lr).items():
            for sublayer, style in (("attn", "-"), ("ffn", "--")):
                drew |= _plot_layers(ax, _profile(members, "100%", "post_norm_gain", sublayer),
                                     f"{variant} {sublayer}", COLORS[variant], style)
        _finish(ax, drew, "layer", "mean post-norm gain", f"LR {lr}, end of training",
                empty="no post-norm gains\n(no layer statistics, or only prenorm)")
    _save(fig, path)


def lr_sensitivity(cells: list[dict], lrs: list[str], variants: list[str], path: Path) -> None:
    """The final validation loss against the learning-rate setting, per variant: the mean over the
    seeds (line), each seed (dots) and the seeds' range (band)."""
    fig, axes = _grid(1, 1, width=6.0, height=4.0)
    ax, drew = axes[0][0], False
    for v, variant in enumerate(variants):
        xs, means, lows, highs = [], [], [], []
        for x, lr in enumerate(lrs):
            values = [c["headline"]["val_loss_100"] for c in _by_group(cells, lr).get(variant, [])
                      if _finite(c["headline"].get("val_loss_100"))]
            if not values:
                continue
            offset = x + 0.06 * (v - (len(variants) - 1) / 2)  # the seeds' dots of each variant side by side
            ax.scatter([offset] * len(values), values, color=COLORS[variant], s=8, zorder=3)
            xs.append(offset)
            means.append(sum(values) / len(values))
            lows.append(min(values))
            highs.append(max(values))
        if xs:
            ax.plot(xs, means, "-", color=COLORS[variant], marker=".", label=variant)
            ax.fill_between(xs, lows, highs, color=COLORS[variant], alpha=0.12, linewidth=0)
            drew = True
    ax.set_xticks(range(len(lrs)), lrs)
    ax.set_xlabel("learning-rate setting")
    ax.set_ylabel("validation loss at the end")
    ax.set_title("Learning-rate sensitivity (line: mean; dots: seeds; band: their range)", fontsize=10)
    if drew:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no final validation loss yet")
    _save(fig, path)


def spikes_by_lr(cells: list[dict], lrs: list[str], variants: list[str], path: Path) -> None:
    """The guard's counts per cell: what it would have done in observe mode, else what it did."""
    fig, axes = _grid(1, 2, width=5.5)
    width = 0.8 / max(1, len(variants))
    observed = any(_finite(c["headline"].get("observed_spikes")) for c in cells)
    panels = ((axes[0][0], "observed_spikes", "spikes (observed)"), (axes[0][1], "observed_rollbacks",
              "would-be rollbacks")) if observed else ((axes[0][0], "skipped_steps", "skipped steps"),
                                                        (axes[0][1], "rollbacks", "rollbacks"))
    for ax, key, ylabel in panels:
        for v, variant in enumerate(variants):
            labelled = False  # one legend entry per variant, at its first bar (not every LR has every variant)
            for x, lr in enumerate(lrs):
                members = _by_group(cells, lr).get(variant, [])
                values = [c["headline"][key] for c in members if c["headline"][key] is not None]
                if not values:
                    continue
                mean = sum(values) / len(values)
                bar = x - 0.4 + width * (v + 0.5)
                ax.bar(bar, mean, width, color=COLORS[variant], label=None if labelled else variant)
                labelled = True
                ax.scatter([bar] * len(values), values, color="black", s=6, zorder=3)
                diverged = sum(1 for c in members if c["status"] == "diverged")
                if diverged:
                    ax.annotate(f"{diverged} div.", (bar, mean), ha="center", va="bottom", fontsize=7, color="red")
        ax.set_xticks(range(len(lrs)), lrs)
        ax.set_xlabel("learning-rate setting")
        ax.set_ylabel(f"{ylabel} per cell (bar: mean; dots: seeds)")
        ax.grid(alpha=0.3, axis="y")
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7)
        else:
            _empty(ax, "no cell measured yet")
    _save(fig, path)


def write_plots(cells: list[dict], lrs: list[str], variants: list[str], plot_path) -> list[Path]:
    """Every plot of the report; `plot_path(name)` says where each goes."""
    written = []
    for name, draw in (("loss_curves", loss_curves), ("grad_norm_by_layer", grad_norm_by_layer),
                       ("residual_rms_by_layer", residual_rms_by_layer), ("activations_by_layer", activations_by_layer),
                       ("post_norm_gains", post_norm_gains)):
        draw(cells, lrs, plot_path(name))
        written.append(plot_path(name))
    for name, draw in (("lr_sensitivity", lr_sensitivity), ("spikes_by_lr", spikes_by_lr)):
        draw(cells, lrs, variants, plot_path(name))
        written.append(plot_path(name))
    return written
