"""`dsv4 eval-indexer CKPT`: how good is the indexer (KL, kl_captured, recall@k, gain@k, overlap@k, baselines)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dsv4cli import options as opt
from dsv4cli.errors import handle_errors

HELP = ("Measure the indexer against the dense teacher: KL, KL captured (1 - KL / KL of a uniform student), "
        "recall@k, gain@k ((recall - random) / (oracle - random)), overlap@k, recency/random baselines, "
        "the share of rows where top-k binds, LM-loss gap.")
EPILOG = "Example: dsv4 eval-indexer runs/warmup --rows 16 --length 256 --topk 4,8,16 --plot recall.png"

Rows = Annotated[int, typer.Option("--rows", help="Held-out rows to score: the first N of the data source, whatever the run's batch.")]
Length = Annotated[Optional[int], typer.Option("--length", help="Tokens per row (default: the run's max_target_length).")]
TopK = Annotated[Optional[str], typer.Option("--topk", help="k values to sweep, e.g. 4,8,16 (default: the run's indexer_topk).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random-blocks baseline and of synthetic rows.")]
Data = Annotated[Optional[str], typer.Option("--data", help="Evaluate on this dataset instead of the run's (sets hf_path).")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="Write recall@k against k (indexer vs baselines) to this PNG; needs matplotlib (the optional 'plot' extra).")]
COLUMNS = (("recall", "recall@k"), ("recall_oracle", "oracle"), ("recall_recent", "recent"),
           ("recall_random", "random"), ("gain", "gain@k"), ("overlap", "overlap@k"))


@handle_errors
def command(
    ckpt: opt.CkptPath,
    overrides: opt.Overrides = None,
    step: opt.StepOpt = None,
    rows: Rows = 16,
    length: Length = None,
    batch_rows: opt.BatchRows = None,
    topk: TopK = None,
    seed: Seed = 0,
    data: Data = None,
    plot: Plot = None,
    json_out: opt.Json = False,
) -> None:
    from rich.console import Console

    from core.eval.evaluate import prepare
    from core.eval.rows import EvalSet
    from dsv4cli.display import ProgressBar

    if plot is not None:
        _require_matplotlib()
    overrides = list(overrides or []) + ([f"hf_path={data}"] if data else [])
    evaluation = prepare(ckpt, step=step, overrides=overrides, ks=topk,
                         eval_set=EvalSet(rows=rows, length=length, seed=seed, batch_rows=batch_rows))
    layers = len(evaluation.cfg.csa_layers)
    with ProgressBar(evaluation.units, "CSA layers x batches", quiet=json_out) as bar:
        # plain (non-terminal) output: one line per batch, not per layer
        result = evaluation.run(on_progress=lambda n: bar.update(n, print_plain=n % layers == 0))
    report = result.to_dict()
    if plot is not None:
        _plot(report, plot)
    if json_out:
        typer.echo(json.dumps(report, indent=2))
        return
    console = Console(highlight=False)
    _render(console if console.is_terminal else Console(width=1000, soft_wrap=True, highlight=False), report, plot)


def _fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _render(console, r: dict[str, Any], plot: Optional[Path]) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    c = r["checkpoint"]
    console.print(f"[bold]{escape(c['checkpoint'])}[/bold]  ·  {c['model_name']}  ·  stage {c['stage']}  ·  step {c['step']}  ·  "
                  f"{c['eval_rows']} rows x {c['max_target_length']} tokens ({r['batches']} batches of {c['batch_size']})  ·  "
                  f"seed {r['seed']}  ·  data: {escape(c['data'])}")
    for j, k in enumerate(r["ks"]):
        table = Table(title=f"k = {k}: recall and overlap on rows with more than {k} visible blocks",
                      box=box.SIMPLE_HEAD if console.is_terminal else None, title_justify="left")
        for name in ("layer", "KL", "KL captured", "top-k binds", *(label for _, label in COLUMNS)):
            table.add_column(name, justify="left" if name == "layer" else "right")
        rows = [(str(layer["layer"]), layer) for layer in r["layers"]] + [("overall", r["overall"])]
        for i, (name, row) in enumerate(rows):
            e = row["by_k"][j]
            table.add_row(name, _fmt(e["all"]["kl"]), _fmt(e["all"]["kl_captured"]), _pct(e["informative_share"]),
                          *(_fmt(e["informative"][m]) for m, _ in COLUMNS),
                          style="bold" if name == "overall" else None, end_section=i == len(rows) - 2)
        console.print(table)
    lm = r["lm_loss"]
    gap = "-" if lm["gap"] is None else f"{lm['gap']:+.4f}"
    console.print(f"lm_loss  dense {_fmt(lm['dense'])}  ·  top-k (k={r['indexer_topk']}) {_fmt(lm['topk'])}  ·  gap {gap}")
    for warning in r["warnings"]:
        console.print(f"[yellow]warning: {escape(warning)}[/yellow]")
    console.print("KL = KL(dense teacher || indexer) over every row with a visible block, unscaled; KL captured = "
                  "1 - KL / KL of a uniform student; top-k binds = share of rows with more than k visible blocks "
                  "(the others are trivial and left out of the recall columns); oracle = the teacher's own top-k; "
                  "recent / random = the k most recent / k random visible blocks; gain@k = (recall - random) / "
                  "(oracle - random).", style="dim")
    if plot is not None:
        console.print(f"plot written to {escape(str(plot))}")


def _require_matplotlib() -> None:
    from core.errors import DsvError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DsvError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                       "(dsv4's optional 'plot' extra), or drop --plot.") from None


def _plot(r: dict[str, Any], path: Path) -> None:
    """recall@k against k, indexer vs oracle and baselines: all valid rows | informative rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.errors import DsvError

    ks = r["ks"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[1].sharey(axes[0])
    for ax, subset, title in zip(axes, ("all", "informative"), ("every row", "rows with more than k visible blocks")):
        for metric, label, style in (("recall", "indexer", "o-"), ("recall_oracle", "oracle (teacher top-k)", "k--"),
                                     ("recall_recent", "k most recent", "s-"), ("recall_random", "k random", "^-")):
            ys = [e[subset][metric] for e in r["overall"]["by_k"]]
            ax.plot(ks, [float("nan") if y is None else y for y in ys], style, label=label)
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set(title=title, xlabel="k (blocks)", xticks=ks, xticklabels=[str(k) for k in ks])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("recall@k (share of dense teacher mass)")
    axes[0].legend(loc="upper left")
    _plot_gain(axes[2], r)
    c = r["checkpoint"]
    captured = r["overall"]["by_k"][0]["all"]["kl_captured"]
    fig.suptitle(f"{c.get('model_name')} step {c.get('step')} ({c.get('stage')}): indexer recall@k, all CSA layers"
                 f"  ·  KL captured {'-' if captured is None else f'{captured:.3f}'}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise DsvError(f"cannot write the plot to {str(path)!r} ({e.strerror}): give a writable path.") from None
    finally:
        plt.close(fig)


def _plot_gain(ax, r: dict[str, Any]) -> None:
    """gain@k against k (rows where top-k binds), overall and per CSA layer; 1 = oracle, 0 = random."""
    ks = r["ks"]

    def ys(row):
        return [float("nan") if e["informative"]["gain"] is None else e["informative"]["gain"] for e in row["by_k"]]

    for layer in r["layers"]:
        ax.plot(ks, ys(layer), "-", color="0.75", linewidth=0.8)
    ax.plot(ks, ys(r["overall"]), "o-", color="C0", label="overall (grey: each CSA layer)")
    ax.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="k", linestyle=":", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set(title="gain@k = (recall - random) / (oracle - random)", xlabel="k (blocks)", xticks=ks,
           xticklabels=[str(k) for k in ks], ylabel="gain@k")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
