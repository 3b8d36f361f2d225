"""The evaluation's report: the metric sums pooled over batches, the derived ratios and `IndexerEval`.

Part of `dsv4 eval-indexer` (core/eval/evaluate.py runs the step; core/eval/metrics.py defines the
per-row figures). Derived from the pooled means (so each is a ratio of sums over the same rows,
never a mean of per-row ratios):
  kl_captured        1 - kl / kl_uniform: the share of the uniform student's KL the indexer
                     removes (1 = the teacher exactly, 0 = no better than uniform, < 0 = worse).
  gain@k             (recall - recall_random) / (recall_oracle - recall_random): the share of the
                     achievable recall over random that the indexer realises (1 = oracle, 0 =
                     random); None when the oracle is no better than random.
Top-k binds on a row when it is informative. When no row is (every k >= the visible blocks),
recall = oracle = 1 trivially: `IndexerEval.warnings` says so (`topk_warnings`).
Aggregates are means over rows pooled across batches (not means of batch means); `overall`
pools the rows of every CSA layer (every layer sees the same rows, so it is the layer mean).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from core.eval.metrics import METRICS
from core.train.handoff import CSA_RATIO, topk_never_binds

DERIVED = ("kl_captured", "gain")
SUBSETS = ("all", "informative")


class MetricSums:
    """Float64 host-side running sums of the eval step's per-layer sums, pooled over batches.

    Args:
      layers: the CSA layer ids, in the aux's layer order.
      ks: the k values, in `layer_sums`' order.
    """

    def __init__(self, layers: Sequence[int], ks: Sequence[int]):
        self.layers, self.ks = tuple(layers), tuple(ks)
        shape = (len(self.layers), len(self.ks))
        self.valid = np.zeros(len(self.layers), np.int64)
        self.informative = np.zeros(shape, np.int64)
        self.sums = {s: {m: np.zeros(shape, np.float64) for m in METRICS} for s in SUBSETS}

    def add(self, sums: dict[str, Any]) -> None:
        """Add one batch's sums (`core.eval.metrics.layer_sums`' dict, arrays with a leading L axis)."""
        self.valid += np.asarray(sums["valid"], np.int64)
        self.informative += np.asarray(sums["informative"], np.int64)
        for subset in SUBSETS:
            for m in METRICS:
                self.sums[subset][m] += np.asarray(sums["sums"][subset][m], np.float64)

    def _row(self, valid: int, informative: np.ndarray, sums: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
        by_k = []
        for j, k in enumerate(self.ks):
            n_inf = int(informative[j])
            by_k.append({
                "k": k,
                "informative_rows": n_inf,
                "informative_share": ratio(n_inf, valid),
                "all": derived({m: ratio(sums["all"][m][j], valid) for m in METRICS}),
                "informative": derived({m: ratio(sums["informative"][m][j], n_inf) for m in METRICS}),
            })
        return {"valid_rows": int(valid), "by_k": by_k}

    def layer_reports(self) -> list[dict[str, Any]]:
        """One dict per CSA layer: {"layer", "valid_rows", "by_k": [...]}, means over rows."""
        out = []
        for i, layer in enumerate(self.layers):
            sums = {s: {m: self.sums[s][m][i] for m in METRICS} for s in SUBSETS}
            out.append({"layer": layer, **self._row(int(self.valid[i]), self.informative[i], sums)})
        return out

    def overall(self) -> dict[str, Any]:
        """The same as a layer report with the rows of every layer pooled (no "layer" key)."""
        sums = {s: {m: self.sums[s][m].sum(axis=0) for m in METRICS} for s in SUBSETS}
        return self._row(int(self.valid.sum()), self.informative.sum(axis=0), sums)


def derived(means: dict[str, float | None]) -> dict[str, float | None]:
    """`means` (METRICS over one set of rows) plus kl_captured and gain (module docstring)."""
    out = dict(means)
    kl, kl_u = means["kl"], means["kl_uniform"]
    out["kl_captured"] = None if kl is None or not kl_u else 1.0 - kl / kl_u
    rec, orc, rnd = means["recall"], means["recall_oracle"], means["recall_random"]
    out["gain"] = None if rec is None or orc - rnd <= 0 else (rec - rnd) / (orc - rnd)
    return out


def ratio(num: float, den: float) -> float | None:
    """num / den as a float, None (JSON null) when there is no row to average over."""
    return float(num) / float(den) if den else None


@dataclasses.dataclass(frozen=True)
class IndexerEval:
    """What `evaluate_indexer` measured. `to_dict()` is the `--json` schema.

    Fields:
      ks: the k values swept. indexer_topk: the config's k (the model's own selection).
      batches, rows, tokens: eval batches run, query rows (real rows x T) per layer, real target tokens.
      lm_loss_dense / lm_loss_topk: mean next-token loss with every visible block / top-k blocks;
        lm_loss_gap = topk - dense.
      layers: per CSA layer {"layer", "valid_rows", "by_k": [{"k", "informative_rows",
        "informative_share", "all": {METRICS}, "informative": {METRICS}}]}; overall: the same,
        rows of every layer pooled, without "layer".
      seed: the random baseline's seed.
      warnings: lines from `topk_warnings` (top-k that cannot bind), [] when it binds.
      context: where the numbers come from ({"checkpoint", "step", "stage", "model_name",
        "batch_size" (rows per step), "max_target_length" (the rows' length), "data", "eval_rows"
        (sequences scored), "frozen_weights"} from `evaluate_checkpoint`; {} otherwise).
    """

    ks: tuple[int, ...]
    indexer_topk: int
    batches: int
    rows: int
    tokens: int
    lm_loss_dense: float | None
    lm_loss_topk: float | None
    layers: list[dict[str, Any]]
    overall: dict[str, Any]
    seed: int
    context: dict[str, Any] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def topk_binds_share(self) -> float | None:
        """Share of valid rows (all layers) where the model's own top-k binds; None unless
        indexer_topk is among the swept ks."""
        if self.indexer_topk not in self.ks:
            return None
        return self.overall["by_k"][self.ks.index(self.indexer_topk)]["informative_share"]

    @property
    def lm_loss_gap(self) -> float | None:
        both = self.lm_loss_dense is not None and self.lm_loss_topk is not None
        return self.lm_loss_topk - self.lm_loss_dense if both else None

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": dict(self.context), "ks": list(self.ks), "indexer_topk": self.indexer_topk,
                "batches": self.batches, "rows": self.rows, "tokens": self.tokens, "seed": self.seed,
                "lm_loss": {"dense": self.lm_loss_dense, "topk": self.lm_loss_topk, "gap": self.lm_loss_gap},
                "layers": self.layers, "overall": self.overall,
                "topk_binds_share": self.topk_binds_share, "warnings": list(self.warnings)}


def topk_warnings(ks: Sequence[int], informative_rows: Sequence[int], indexer_topk: int,
                  max_target_length: int) -> list[str]:
    """Warning lines when top-k cannot bind: the model's own k on any row of its length, or a
    swept k on every evaluated row (`informative_rows[j]` = rows with more than ks[j] visible)."""
    out = []
    if topk_never_binds(indexer_topk, max_target_length):
        out.append(f"top-k never binds for this model: indexer_topk={indexer_topk} >= max_target_length // "
                   f"{CSA_RATIO} = {max_target_length // CSA_RATIO} blocks, so its sparse attention equals dense.")
    for k, n in zip(ks, informative_rows):
        if n == 0:
            out.append(f"top-k never binds at k={k} on these rows (none sees more than {k} blocks): "
                       f"recall@{k} = oracle = 1 trivially; use a smaller k or longer rows.")
    return out
