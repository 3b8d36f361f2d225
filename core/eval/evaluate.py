"""Indexer quality against the dense teacher: KL, recall@k, overlap@k, baselines, kl_captured,
gain@k, LM-loss gap.

Implements `dsv4 eval-indexer` on top of DESIGN.md, "The indexer loss". The per-row
metrics of one CSA layer and their definitions (dense teacher, valid and informative rows, kl,
recall@k, overlap@k, the oracle, recent and random baselines, kl_uniform) are the pure maths of
core/eval/metrics.py; this module pools them over batches and layers and runs
the model.

Derived from the pooled means (so each is a ratio of sums over the same rows, never a mean of
per-row ratios):
  kl_captured        1 - kl / kl_uniform: the share of the uniform student's KL the indexer
                     removes (1 = the teacher exactly, 0 = no better than uniform, < 0 = worse).
  gain@k             (recall - recall_random) / (recall_oracle - recall_random): the share of the
                     achievable recall over random that the indexer realises (1 = oracle, 0 =
                     random); None when the oracle is no better than random.
Top-k binds on a row when it is informative. When no row is (every k >= the visible blocks),
recall = oracle = 1 trivially: `IndexerEval.warnings` says so (`topk_warnings`).
Aggregates are means over rows pooled across batches (not means of batch means); `overall`
pools the rows of every CSA layer (every layer sees the same rows, so it is the layer mean).

Choices: the metrics use the aux of a dense forward (mode "eval_dense"), so every layer's
teacher and indexer see the hidden states the warm-up distils on; the LM loss is reported for
both that forward and the top-k forward (mode "eval") that inference runs. The teacher is the
"compressed" one even for runs trained with indexer_teacher=joint (it is what attention over the
blocks alone would do, and the selection only decides among blocks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from core.eval.metrics import METRICS, batch_sums, token_nll
from core.train.handoff import CSA_RATIO, topk_never_binds

DERIVED = ("kl_captured", "gain")
SUBSETS = ("all", "informative")


# ----------------------------------------------------------------------------- aggregation


class MetricSums:
    """Float64 host-side running sums of `batch_sums` outputs, pooled over batches.

    Args:
      layers: the CSA layer ids, in the aux's layer order.
      ks: the k values, in `batch_sums`' order.
    """

    def __init__(self, layers: Sequence[int], ks: Sequence[int]):
        self.layers, self.ks = tuple(layers), tuple(ks)
        shape = (len(self.layers), len(self.ks))
        self.valid = np.zeros(len(self.layers), np.int64)
        self.informative = np.zeros(shape, np.int64)
        self.sums = {s: {m: np.zeros(shape, np.float64) for m in METRICS} for s in SUBSETS}

    def add(self, sums: dict[str, Any]) -> None:
        """Add one batch's `batch_sums` (arrays with leading L axis)."""
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
                "informative_share": _ratio(n_inf, valid),
                "all": derived({m: _ratio(sums["all"][m][j], valid) for m in METRICS}),
                "informative": derived({m: _ratio(sums["informative"][m][j], n_inf) for m in METRICS}),
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


def _ratio(num: float, den: float) -> float | None:
    """num / den as a float, None (JSON null) when there is no row to average over."""
    return float(num) / float(den) if den else None


@dataclasses.dataclass(frozen=True)
class IndexerEval:
    """What `evaluate_indexer` measured. `to_dict()` is the `--json` schema.

    Fields:
      ks: the k values swept. indexer_topk: the config's k (the model's own selection).
      batches, rows, tokens: eval batches run, query rows (B*T) per layer, real target tokens.
      lm_loss_dense / lm_loss_topk: mean next-token loss with every visible block / top-k blocks;
        lm_loss_gap = topk - dense.
      layers: per CSA layer {"layer", "valid_rows", "by_k": [{"k", "informative_rows",
        "informative_share", "all": {METRICS}, "informative": {METRICS}}]}; overall: the same,
        rows of every layer pooled, without "layer".
      seed: the random baseline's seed.
      warnings: lines from `topk_warnings` (top-k that cannot bind), [] when it binds.
      context: where the numbers come from ({"checkpoint", "step", "stage", "model_name",
        "batch_size", "max_target_length", "data"} from `evaluate_checkpoint`; {} otherwise).
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


# ----------------------------------------------------------------------------- the model


def parse_ks(text: str | Iterable[int] | None, default: int, num_blocks: int) -> tuple[int, ...]:
    """'4,8,16' -> (4, 8, 16), sorted and deduplicated; None -> (default,).

    Raises ConfigError for a non-integer, a k < 1, or a k above the row's num_blocks.
    """
    from core.errors import ConfigError

    if text is None or text == "":
        items: list[Any] = [default]
    elif isinstance(text, str):
        items = [s.strip() for s in text.split(",") if s.strip()]
    else:
        items = list(text)
    ks = []
    for item in items:
        try:
            k = int(item)
        except (TypeError, ValueError):
            raise ConfigError(f"--topk value {item!r} is not an integer: write e.g. --topk 4,8,16.") from None
        if not 1 <= k <= num_blocks:
            raise ConfigError(f"--topk {k} is out of range: each k must be in 1..{num_blocks} "
                              f"(max_target_length // 4 blocks).")
        ks.append(k)
    return tuple(sorted(set(ks)))


@functools.lru_cache(maxsize=8)
def make_eval_step(ks: tuple[int, ...], mesh=None) -> Callable[..., Any]:
    """A jitted (model, batch arrays, key) -> (metric sums, nll dense, nll top-k, target weight).

    Runs the decoder twice: mode "eval_dense" with collect=True (teacher, indexer scores,
    dense LM loss) and mode "eval" (top-k LM loss). With a `mesh` it is traced under the mesh's
    abstract mesh, as the train step is (`core.train.program.with_mesh`), so the MoE takes the same
    path as in training (expert parallelism on an `expert` axis). Cached per (ks, mesh), so
    repeated evaluations of same-shaped models reuse the compiled step.
    """
    from flax import nnx

    from core.train.program import with_mesh

    def step(model, tokens, positions, segment_ids, targets, loss_mask, key):
        logits_dense, aux = model(tokens, positions, segment_ids, mode="eval_dense", collect=True)
        logits_topk, _ = model(tokens, positions, segment_ids, mode="eval")
        random_lbtw = jax.random.uniform(key, aux["visible"].shape, jnp.float32)
        sums = batch_sums(aux, random_lbtw, ks)
        nll_dense, weight = token_nll(logits_dense, targets, loss_mask)
        nll_topk, _ = token_nll(logits_topk, targets, loss_mask)
        return sums, nll_dense, nll_topk, weight

    return nnx.jit(step if mesh is None else with_mesh(mesh, step))


def evaluate_indexer(model, cfg, batches: Iterable[dict[str, Any]], *, ks: Sequence[int] | None = None,
                     seed: int = 0, on_batch: Callable[[int], None] | None = None, mesh=None) -> IndexerEval:
    """Measure a decoder's indexers against their dense teachers over held-out batches.

    Args:
      model: a `core.model.transformer.Transformer` built from `cfg` (with use_indexer and CSA layers).
      cfg: its Config.
      batches: dicts of int [B, T] arrays with tokens, positions, segment_ids, targets, loss_mask
        (`core.data.batches.eval_batches`).
      ks: the k values to sweep (default: cfg.indexer_topk).
      seed: the random baseline's seed (batch i uses fold_in(key(seed), i)).
      on_batch: called with the number of batches done after each one (progress display).
      mesh: the device mesh the model's state lives on (`core.parallel.sharding.shard_state`):
        batches are split over it as in training and the step is traced under it; None: as placed.

    Returns:
      IndexerEval (this module's and core/eval/metrics.py's docstrings define every number).
    """
    from core.errors import ConfigError

    if not cfg.use_indexer or not cfg.csa_layers:
        raise ConfigError("this model has no lightning indexer to evaluate: it needs use_indexer=true "
                          "and at least one CSA layer (compress_ratios entry 4).")
    ks = tuple(ks or (cfg.indexer_topk,))
    step = make_eval_step(ks, mesh)
    acc = MetricSums(cfg.csa_layers, ks)
    nll = np.zeros(3, np.float64)  # dense, top-k, weight
    done = rows = 0
    names = ("tokens", "positions", "segment_ids", "targets", "loss_mask")
    for batch in batches:
        if mesh is None:
            arrays = [jnp.asarray(batch[name]) for name in names]
        else:
            from core.parallel.sharding import shard_batch

            placed = shard_batch({name: batch[name] for name in names}, mesh)
            arrays = [placed[name] for name in names]
        sums, nll_dense, nll_topk, weight = step(model, *arrays, jax.random.fold_in(jax.random.key(seed), done))
        acc.add(jax.tree.map(np.asarray, sums))
        nll += [float(nll_dense), float(nll_topk), float(weight)]
        rows += int(np.prod(batch["tokens"].shape))
        done += 1
        if on_batch is not None:
            on_batch(done)
    return IndexerEval(
        ks=ks, indexer_topk=cfg.indexer_topk, batches=done, rows=rows, tokens=int(nll[2]),
        lm_loss_dense=_ratio(nll[0], nll[2]), lm_loss_topk=_ratio(nll[1], nll[2]),
        layers=acc.layer_reports(), overall=acc.overall(), seed=seed,
        warnings=topk_warnings(ks, [int(n) for n in acc.informative.sum(axis=0)] if done else [],
                               cfg.indexer_topk, cfg.max_target_length))


def with_overrides(cfg, overrides: Sequence[str]):
    """cfg with "KEY=VALUE" overrides applied (validated; aliases accepted, unknown keys get a
    did-you-mean: `core.config.schema.canonical_key`)."""
    from core.config.schema import canonical_key
    from core.config.values import parse_override

    changes = {}
    for text in overrides:
        key, value = parse_override(text)
        changes[canonical_key(key, f"override {text!r}")] = value
    return cfg.replace(**changes) if changes else cfg


def evaluate_checkpoint(path, *, step: int | None = None, overrides: Sequence[str] = (),
                        batches: int = 4, ks: str | Sequence[int] | None = None, seed: int = 0,
                        on_batch: Callable[[int], None] | None = None) -> IndexerEval:
    """Restore a checkpoint's model and run `evaluate_indexer` on its held-out eval batches.

    The model runs on the config's mesh over every device (`core.parallel.mesh.make_mesh`, the
    training commands' mesh), its state restored straight into the rule shardings, so the MoE
    takes the training path (expert parallelism on an `expert` axis); a batch holds
    per_device_batch_size rows per device, as a training step does.

    Args:
      path: a run directory, its checkpoints/ directory or one step directory.
      step: the checkpoint step (default: the latest).
      overrides: "KEY=VALUE" changes to the saved config (e.g. the data source: hf_path,
        hf_eval_split, per_device_batch_size); keys that change parameter shapes fail with a
        CheckpointError naming the parameter.
      batches: at most this many eval batches of per_device_batch_size x devices rows (fewer if
        the held-out documents run out).
      ks: '4,8,16' or a sequence (default: the config's indexer_topk).
      seed, on_batch: as in `evaluate_indexer`.
    """
    from core.checkpoint import store as ckpt
    from core.data.batches import data_fingerprint, eval_batches
    from core.parallel.mesh import make_mesh

    _, ckpt_dir, step = ckpt.resolve_checkpoint(path, step)
    cfg = ckpt.config_of(ckpt_dir, step)
    cfg = with_overrides(cfg, overrides)
    ks = parse_ks(ks, cfg.indexer_topk, cfg.max_target_length // 4)
    mesh = make_mesh(cfg)  # a mesh that does not fit these devices: ConfigError naming the ici_* keys
    model, cfg, meta = ckpt.restore_model(ckpt_dir, step, cfg, mesh=mesh)
    rows_per_batch = cfg.per_device_batch_size * mesh.size
    data = eval_batches(cfg, rows_per_batch, batches)
    result = evaluate_indexer(model, cfg, data, ks=ks, seed=seed, on_batch=on_batch, mesh=mesh)
    if not result.batches:
        from core.errors import DataError

        raise DataError(f"the evaluation data of {data_fingerprint(cfg)['source']!r} is empty: give held-out "
                        "documents (hf_eval_split=..., a larger eval_holdout_fraction, or more data).")
    context = {"checkpoint": str(ckpt_dir / str(step)), "step": step, "stage": meta.get("stage"),
               "model_name": cfg.model_name, "batch_size": rows_per_batch,
               "max_target_length": cfg.max_target_length, "data": data_fingerprint(cfg)["source"]}
    return dataclasses.replace(result, context=context)

