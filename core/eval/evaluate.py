"""Indexer quality against the dense teacher: the eval step, its driver over batches, and a checkpoint's evaluation.

Implements `dsv4 eval-indexer` on top of DESIGN.md, "The indexer loss". The per-row figures and
their definitions (dense teacher, valid and informative rows, kl, recall@k, overlap@k, the oracle,
recent and random baselines, kl_uniform) are core/eval/metrics.py's; their pooling over batches,
kl_captured and gain@k are core/eval/report.py's; the rows are core/eval/rows.py's.

Choices: the metrics are taken inside a dense forward (mode "eval_dense"), so every layer's
teacher and indexer see the hidden states the warm-up distils on; the LM loss is reported for
both that forward and the top-k forward (mode "eval") that inference runs. The teacher is the
"compressed" one even for runs trained with indexer_teacher=joint (it is what attention over the
blocks alone would do, and the selection only decides among blocks).

Memory (DESIGN.md, "Memory"): the step is linear in T. Each CSA layer streams its metrics by query
block inside the forward (core/eval/metrics.py, each CSA layer's probe) and hands on
only its sums; the LM losses are chunked over tokens from the final hidden states
(core.loss.lm.chunked_lm_loss), so no [L, ...] stack of layer inputs, no [B, H, T, W] and no
[B, T, V] exists. The model runs as the run holds it: on its mesh, with expert parallelism where
the mesh has an expert axis, and frozen weights held in their released FP8/FP4 format
(frozen_weights: released) dequantised inside the layers as in training.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from core.checkpoint import store as ckpt
from core.config.schema import canonical_key
from core.config.values import parse_override
from core.data.batches import data_fingerprint
from core.errors import ConfigError, DataError
from core.eval.metrics import layer_probe
from core.eval.report import IndexerEval, MetricSums, ratio, topk_warnings
from core.eval.rows import EVAL_KEYS, EvalSet, batch_rows, eval_config, row_batches, row_keys
from core.loss.lm import chunked_lm_loss, compute_head
from core.model.transformer import abstract
from core.parallel.mesh import make_mesh, mesh_platform
from core.parallel.sharding import batch_sharding, shard_batch
from core.spec.resolve import data_spec, resolve
from core.train import program


# ----------------------------------------------------------------------------- the step


def parse_ks(text: str | Iterable[int] | None, default: int, num_blocks: int) -> tuple[int, ...]:
    """'4,8,16' -> (4, 8, 16), sorted and deduplicated; None -> (default,).

    Raises ConfigError for a non-integer, a k < 1, or a k above the row's num_blocks.
    """
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
                              f"(the rows' length // 4 blocks).")
        ks.append(k)
    return tuple(sorted(set(ks)))


class StepSpec(NamedTuple):
    """The eval step's static settings: the swept ks, the random baseline's seed, the teacher's and
    indexer's head chunk (csa_qk_head_chunk_size), the LM loss's tokens per chunk, and whether
    layers report progress."""

    ks: tuple[int, ...]
    seed: int
    head_chunk: int
    lm_chunk: int
    progress: bool = False

    @classmethod
    def of(cls, cfg, ks: Sequence[int], seed: int = 0, progress: bool = False) -> "StepSpec":
        """lm_chunk: lm_loss_chunk_size, or attention_query_chunk_size where that is 0 (the
        evaluation never builds [B, T, V] logits), of `cfg` resolved (core.spec.resolve)."""
        return cls(tuple(ks), seed, cfg.csa_qk_head_chunk_size,
                   cfg.lm_loss_chunk_size or cfg.attention_query_chunk_size, progress)


_LISTENERS: list[Callable[[], None]] = []  # progress listeners of the evaluation under way (`evaluate_indexer`)


def _tick() -> None:
    for listener in list(_LISTENERS):
        listener()


PROGRAMS = ("dense", "topk")  # the eval step's two programs, run one after the other


def eval_step(spec: StepSpec, program: str) -> Callable[..., Any]:
    """One program of the eval step as a plain function of (model, batch); batch:
    `core.eval.rows.EVAL_KEYS` arrays.

    "dense": mode "eval_dense" with each CSA layer's metrics streamed inside it
    (`core.eval.metrics.layer_probe` as each CSA layer's probe; progress ticks when spec.progress) ->
    (sums with a leading CSA-layer axis, nll sum, target weight). "topk": mode "eval" -> nll sum.
    Two programs, not one: one program would hold both forwards' activations at once (the compiler
    interleaves them), two hold one forward's (docs/evaluation.md#memory). The random baseline
    draws from one key per row, `core.eval.rows.row_keys(spec.seed, batch["rows"])`.
    """
    if program not in PROGRAMS:
        raise ValueError(f"program={program!r}: use one of {', '.join(PROGRAMS)}")

    def nll(model, h_btm, batch, weight):  # the chunked mean times the weight it divided by
        mean = chunked_lm_loss(h_btm, compute_head(model.head[...], model.dtype), batch["targets"], batch["loss_mask"],
                               chunk=spec.lm_chunk)
        return mean * jnp.maximum(weight, 1.0)

    def step(model, batch):
        args = (batch["tokens"], batch["positions"], batch["segment_ids"])
        weight = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        if program == "topk":
            return nll(model, model.hidden(*args, mode="eval")[0], batch, weight)
        probe = functools.partial(layer_probe, ks=spec.ks, keys_b=row_keys(spec.seed, batch["rows"]),
                                    head_chunk=spec.head_chunk, tick=_tick if spec.progress else None)
        h_btm, aux = model.hidden(*args, mode="eval_dense", probe=probe)
        return aux["observed"], nll(model, h_btm, batch, weight), weight

    return step


def state_step(spec: StepSpec, part: str, graphdef) -> Callable[..., Any]:
    """`eval_step(spec, part)` as a function of the model's state: (state, batch) -> its outputs;
    `graphdef, state` split the 1-tuple (model,), as the train step's split (model, optimizer).
    Jitted so, the state is an input only (nnx.jit would also return every variable, a second copy
    of the weights). Named step_<part>: its compiled module is jit_step_<part>."""
    step = eval_step(spec, part)

    def fn(state, batch):
        (model,) = nnx.merge(graphdef, state)
        return step(model, batch)

    fn.__name__ = fn.__qualname__ = f"step_{part}"
    return fn


@functools.lru_cache(maxsize=16)
def _jitted(spec: StepSpec, part: str, graphdef, mesh, cfg) -> Callable[..., Any]:
    """The part jitted as `core.train.program.jit_step` jits a step (traced under the mesh, the
    mesh's compiler options, nothing donated); plain `jax.jit` without a mesh."""
    fn = state_step(spec, part, graphdef)
    return jax.jit(fn) if mesh is None else program.jit_step(fn, cfg.xla_backend_optimization_level, mesh)


def make_eval_step(spec: StepSpec, mesh=None, cfg=None) -> Callable[..., Any]:
    """The eval step jitted: (model, batch) -> (sums, nll sum dense, nll sum top-k, target weight),
    its two programs run one after the other. With a `mesh` (and the run's `cfg`) they are jitted
    as a training command jits its step (`core.train.program.jit_step`): traced under the mesh, so
    the MoE takes the same path as in training (expert parallelism on an `expert` axis), compiled
    with the run's compiler options. Cached per (spec, the model's graphdef, mesh, cfg), so
    repeated evaluations of same-shaped models reuse the compiled programs."""
    def run(model, batch):
        graphdef, state = nnx.split((model,))
        sums, nll_dense, weight = _jitted(spec, "dense", graphdef, mesh, cfg)(state, batch)
        return sums, nll_dense, _jitted(spec, "topk", graphdef, mesh, cfg)(state, batch), weight

    return run


def lowered_eval(specs, ks: Sequence[int], mesh, eval_set: EvalSet = EvalSet()) -> tuple[dict[str, Any], Any]:
    """The eval step's programs of `specs` (core.spec.resolve, for `mesh`) lowered from
    `core.train.program.abstract_inputs` on `mesh`, as `make_eval_step` jits them, over a batch of the
    evaluation's own rows per step
    (`core.eval.rows.batch_rows(eval_set, mesh)`: `eval_set.batch_rows`, else one per batch shard;
    never the training batch); nothing is allocated. `dsv4 plan --stage eval` compiles these.

    Returns:
      ({part: jax.stages.Lowered} for PROGRAMS, program.StepInputs with the eval batch: EVAL_KEYS,
      [rows, T] and "rows" [rows], split over the batch axes).
    """
    cfg = specs.cfg
    inputs = program.abstract_inputs(cfg.per_device_batch_size, cfg.max_target_length, (abstract(specs.model),), mesh)
    rows, sharding = batch_rows(eval_set, inputs.mesh), batch_sharding(inputs.mesh)
    shape = lambda name: (rows,) if name == "rows" else (rows, cfg.max_target_length)  # noqa: E731
    batch = {name: jax.ShapeDtypeStruct(shape(name), jnp.int32, sharding=sharding) for name in EVAL_KEYS}
    spec = StepSpec.of(cfg, ks)
    level = cfg.xla_backend_optimization_level
    lowered = {part: program.jit_step(state_step(spec, part, inputs.graphdef), level, inputs.mesh).lower(inputs.state,
                                                                                                         batch)
               for part in PROGRAMS}
    return lowered, inputs._replace(batch=batch)


def _place(batch: dict[str, Any], mesh) -> dict[str, Any]:
    if mesh is None:
        return {name: jnp.asarray(batch[name]) for name in EVAL_KEYS}
    return shard_batch({name: batch[name] for name in EVAL_KEYS}, mesh)


def check_indexer(cfg) -> None:
    """ConfigError unless `cfg`'s model has a lightning indexer to evaluate."""
    if not cfg.use_indexer or not cfg.csa_layers:
        raise ConfigError("this model has no lightning indexer to evaluate: it needs use_indexer=true "
                          "and at least one CSA layer (compress_ratios entry 4).")


def evaluate_indexer(model, specs, batches: Iterable[tuple[dict[str, Any], int, int]], *,
                     ks: Sequence[int] | None = None, seed: int = 0, mesh=None,
                     on_progress: Callable[[int], None] | None = None) -> IndexerEval:
    """Measure a decoder's indexers against their dense teachers over held-out rows.

    Args:
      model: a `core.model.transformer.Transformer` built from `specs` (with use_indexer and CSA layers).
      specs: its config resolved (core.spec.resolve) for `mesh`, or without one for where the model is placed.
      batches: (dict of `core.eval.rows.EVAL_KEYS` arrays, index of its first row, real rows in
        it), as `core.eval.rows.row_batches` yields them.
      ks: the k values to sweep (default: cfg.indexer_topk).
      seed: the random baseline's seed (row r draws from fold_in(key(seed), r): `row_keys`).
      mesh: the device mesh the model's state lives on (`core.parallel.sharding.shard_state`):
        batches are split over it as in training and the step is traced under it; None: as placed.
      on_progress: called with the units done, a unit being one CSA layer of one batch (each layer
        reports when its sums are done; the count is exact after every batch).

    Returns:
      IndexerEval (this module's and core/eval/metrics.py's docstrings define every number).
    """
    cfg = specs.cfg
    check_indexer(cfg)
    ks = tuple(ks or (cfg.indexer_topk,))
    step = make_eval_step(StepSpec.of(cfg, ks, seed, progress=on_progress is not None), mesh, None if mesh is None else cfg)
    layers = len(cfg.csa_layers)
    acc = MetricSums(cfg.csa_layers, ks)
    nll = np.zeros(3, np.float64)  # dense, top-k, weight
    done = rows = 0
    ticks = [0]

    def listener():  # a layer's sums are done; the batch's last unit waits for its results
        ticks[0] += 1
        if ticks[0] < layers:
            on_progress(done * layers + ticks[0])

    if on_progress is not None:
        _LISTENERS.append(listener)
    try:
        for batch, _, real in batches:
            ticks[0] = 0
            sums, nll_dense, nll_topk, weight = step(model, _place(batch, mesh))
            acc.add(jax.tree.map(np.asarray, sums))
            nll += [float(nll_dense), float(nll_topk), float(weight)]
            rows += real * batch["tokens"].shape[1]
            done += 1
            if on_progress is not None:
                on_progress(done * layers)
    finally:
        if on_progress is not None:
            _LISTENERS.remove(listener)
    return IndexerEval(
        ks=ks, indexer_topk=cfg.indexer_topk, batches=done, rows=rows, tokens=int(nll[2]),
        lm_loss_dense=ratio(nll[0], nll[2]), lm_loss_topk=ratio(nll[1], nll[2]),
        layers=acc.layer_reports(), overall=acc.overall(), seed=seed,
        warnings=topk_warnings(ks, [int(n) for n in acc.informative.sum(axis=0)] if done else [],
                               cfg.indexer_topk, cfg.max_target_length))


# ----------------------------------------------------------------------------- a checkpoint


def with_overrides(cfg, overrides: Sequence[str]):
    """cfg with "KEY=VALUE" overrides applied (validated; aliases accepted, unknown keys get a
    did-you-mean: `core.config.schema.canonical_key`)."""
    changes = {}
    for text in overrides:
        key, value = parse_override(text)
        changes[canonical_key(key, f"override {text!r}")] = value
    return cfg.replace(**changes) if changes else cfg


@dataclasses.dataclass
class Evaluation:
    """A checkpoint restored and its evaluation planned (`prepare`); `run()` measures it.

    Fields: specs (the run's config with the evaluation's length, seed and overrides, resolved for the
    mesh: core.spec.resolve), ks, eval_set,
    mesh, batch (rows per step), batches (steps, at most), units (progress units: batches x CSA
    layers), and what `run` needs (model, context).
    """

    specs: Any
    ks: tuple[int, ...]
    eval_set: EvalSet
    mesh: Any
    batch: int
    batches: int
    model: Any
    context: dict[str, Any]

    @property
    def cfg(self):
        """The resolved Config."""
        return self.specs.cfg

    @property
    def units(self) -> int:
        return self.batches * len(self.cfg.csa_layers)

    def run(self, on_progress: Callable[[int], None] | None = None) -> IndexerEval:
        """`evaluate_indexer` on the evaluation's rows; DataError when there is none."""
        data = row_batches(self.cfg, self.eval_set.rows, self.batch)
        result = evaluate_indexer(self.model, self.specs, data, ks=self.ks, seed=self.eval_set.seed, mesh=self.mesh,
                                  on_progress=on_progress)
        if not result.batches:
            raise DataError(f"the evaluation data of {data_fingerprint(data_spec(self.cfg))['source']!r} is empty: give held-out "
                            "documents (hf_eval_split=..., a larger eval_holdout_fraction, or more data).")
        return dataclasses.replace(result, context={**self.context, "eval_rows": result.rows // self.cfg.max_target_length})


def prepare(path, *, step: int | None = None, overrides: Sequence[str] = (), eval_set: EvalSet = EvalSet(),
            ks: str | Sequence[int] | None = None) -> Evaluation:
    """Restore a checkpoint's model for `Evaluation.run` on the evaluation set `eval_set`.

    The model runs on the config's mesh over every device (`core.parallel.mesh.make_mesh`, the
    training commands' mesh), its state restored straight into the rule shardings and, for a run
    that holds its frozen weights released (import-hf --keep-quantized), as those FP8/FP4 codes
    and scales, so the model is the one the run trains.

    Args:
      path: a run directory, its checkpoints/ directory or one step directory.
      step: the checkpoint step (default: the latest).
      overrides: "KEY=VALUE" changes to the saved config (e.g. the data source: hf_path,
        hf_eval_split); keys that change parameter shapes fail with a CheckpointError naming the
        parameter.
      eval_set: rows, length, seed and rows per step (core/eval/rows.py).
      ks: '4,8,16' or a sequence (default: the config's indexer_topk).
    """
    _, ckpt_dir, step = ckpt.resolve_checkpoint(path, step)
    cfg = eval_config(with_overrides(ckpt.config_of(ckpt_dir, step), overrides), eval_set)
    check_indexer(cfg)
    ks = parse_ks(ks, cfg.indexer_topk, cfg.max_target_length // 4)
    mesh = make_mesh(cfg)  # a mesh that does not fit these devices: ConfigError naming the ici_* keys
    specs = resolve(cfg, mesh_platform(mesh), mesh.shape)  # once: the evaluation's entry point
    cfg = specs.cfg
    batch = batch_rows(eval_set, mesh)
    model, _, meta = ckpt.restore_model(ckpt_dir, step, specs.model, mesh=mesh)
    context = {"checkpoint": str(ckpt_dir / str(step)), "step": step, "stage": meta.get("stage"),
               "model_name": cfg.model_name, "batch_size": batch, "max_target_length": cfg.max_target_length,
               "data": data_fingerprint(data_spec(cfg))["source"], "frozen_weights": cfg.frozen_weights}
    return Evaluation(specs, ks, eval_set, mesh, batch, -(-eval_set.rows // batch), model, context)


def evaluate_checkpoint(path, *, step: int | None = None, overrides: Sequence[str] = (), eval_set: EvalSet = EvalSet(),
                        ks: str | Sequence[int] | None = None,
                        on_progress: Callable[[int], None] | None = None) -> IndexerEval:
    """`prepare(...).run(on_progress)`: a checkpoint's indexers measured on the evaluation set."""
    return prepare(path, step=step, overrides=overrides, eval_set=eval_set, ks=ks).run(on_progress)
