"""`indexer_init: teacher`: the warm-up's indexers initialised from their own layers' main attention
on calibration batches of the run's own data, once, before step 0 (docs/indexer-init.md).

Two dense forwards per calibration batch (mode "eval_dense", collect), jitted once each:
  1. statistics: per CSA layer the sums of core.model.indexer_init.LayerStats (the teacher's keys
     with RoPE undone, its queries, c_q and x), pooled in float64 on the host; then the projection
     `teacher_indexer` per layer, written into the model;
  2. temperature: the indexer's scores are linear in weights_proj, so each layer's KL to its dense
     teacher is measured for every factor of TEMPERATURES and weights_proj is scaled by the best.
The calibration batches are the first `indexer_init_batches` of the run's training stream, which
is then rewound: the training run meets the same batches, and no held-out row is used, so
`dsv4 eval-indexer` measures the initialisation on rows it never saw.
Deterministic: the same source, config and devices give the same indexer, bitwise.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from core.loss.indexer_kl import kl_rows, teacher_rows
from core.model.attention import collect
from core.model.indexer_init import LayerStats, TeacherWeights, teacher_indexer
from core.model.layers import apply_rope
from core.ops.chunked_attention import block_first_positions
from core.parallel.sharding import shard_batch
from core.train.program import with_mesh

TEMPERATURES = tuple(float(2.0 ** (e / 2)) for e in range(-16, 9))  # 1/256 .. 16, steps of sqrt(2)
INPUTS = ("tokens", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class TeacherInit:
    """What the initialisation did: per CSA layer (in layer order) the kept nope variance share,
    the head weights' least-squares R^2, the temperature chosen and the calibration KL against the
    uniform student's; its batches, tokens and seconds."""

    layers: tuple[int, ...]
    kept: tuple[float, ...]
    weight_fit: tuple[float, ...]
    temperature: tuple[float, ...]
    kl: tuple[float, ...]
    kl_uniform: tuple[float, ...]
    batches: int
    tokens: int
    seconds: float

    @property
    def kl_captured(self) -> float:
        """1 - KL / KL_uniform on the calibration rows, every layer pooled (the eval's definition)."""
        return 1.0 - sum(self.kl) / sum(self.kl_uniform)

    def line(self) -> str:
        return (f"indexer_init=teacher: {len(self.layers)} CSA layers from {self.batches} calibration batches "
                f"({self.tokens:,} tokens) in {self.seconds:.1f} s; nope variance kept "
                f"{np.mean(self.kept):.3f}, head-weight fit R^2 {np.mean(self.weight_fit):.3f}, calibration "
                f"kl_captured {self.kl_captured:.3f} (docs/indexer-init.md)")


def csa_attentions(model) -> list[tuple[int, Any, int | None]]:
    """(layer, Attention, index on the stacked axis or None) of every layer with an indexer, in layer
    order (the order of the collected aux)."""
    out = []
    for (start, unit, reps), segment in zip(model.segments, model.layers):
        blocks = [segment] if reps == 1 else list(segment.blocks)
        for u, block in enumerate(blocks):
            if getattr(block.attn, "indexer", None) is not None:
                out += [(start + j * unit + u, block.attn, None if reps == 1 else j) for j in range(reps)]
    return sorted(out, key=lambda entry: entry[0])


def _host(a) -> np.ndarray:
    """A device array on the host as float64, also one spread over other processes' devices."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(jax.device_get(a), np.float64)


def _read(variable, j: int | None) -> np.ndarray:
    value = _host(variable[...])
    return value if j is None else value[j]


def _write(variable, j: int | None, value: np.ndarray) -> None:
    old = variable[...]
    new = jnp.asarray(value, old.dtype)
    variable[...] = jax.device_put(new if j is None else old.at[j].set(new), old.sharding)


def _layer_sums(q_bthd, kv_bwd, visible_btw, x_btm, cq_btr, positions_bt, rope):
    """LayerStats' sums of one layer and batch (float32 on device)."""
    k_bwd = apply_rope(kv_bwd.astype(jnp.float32), block_first_positions(positions_bt, 4), rope, inverse=True)
    blocks_bw = jnp.any(visible_btw, axis=1).astype(jnp.float32)
    rows_bt = jnp.any(visible_btw, axis=2).astype(jnp.float32)
    q_bthd, x_btm, cq_btr = (a.astype(jnp.float32) for a in (q_bthd, x_btm, cq_btr))
    return (jnp.sum(blocks_bw), jnp.sum(rows_bt),
            jnp.einsum("bw,bwd->d", blocks_bw, k_bwd), jnp.einsum("bw,bwd,bwe->de", blocks_bw, k_bwd, k_bwd),
            jnp.einsum("bt,bthd,bthe->de", rows_bt, q_bthd, q_bthd),
            jnp.einsum("bt,btr,bts->rs", rows_bt, cq_btr, cq_btr),
            jnp.einsum("bt,btm->m", rows_bt, x_btm), jnp.einsum("bt,btm,btn->mn", rows_bt, x_btm, x_btm))


def _stats_step(rope):
    def step(model, tokens, positions, segment_ids):
        _, aux = model(tokens, positions, segment_ids, mode="eval_dense", probe=collect)
        fn = lambda a: _layer_sums(*a, positions, rope)
        return jax.lax.map(fn, tuple(aux[k] for k in ("teacher_query", "compressed_kv", "visible", "indexer_x",
                                                      "indexer_c_q")))
    return step


def _kl_step(model, tokens, positions, segment_ids):
    """Per layer: KL sums for every temperature [G], the uniform student's, valid rows."""
    _, aux = model(tokens, positions, segment_ids, mode="eval_dense", probe=collect)

    def layer(a):
        q_bthd, kv_bwd, scores_btw, visible_btw = a
        psum_btw = teacher_rows(q_bthd.astype(jnp.float32), kv_bwd.astype(jnp.float32), visible_btw)
        kls = jnp.stack([kl_rows(c * scores_btw, psum_btw, visible_btw, False)[0] for c in TEMPERATURES])
        return kls, kl_rows(jnp.zeros_like(scores_btw), psum_btw, visible_btw, False)[0]
    return jax.lax.map(layer, tuple(aux[k] for k in ("teacher_query", "compressed_kv", "index_scores", "visible")))


@functools.lru_cache(maxsize=8)
def _jitted(kind: str, rope, mesh):
    """The jitted statistics ("stats") or temperature ("kl") step, cached per (rope, mesh)."""
    fn = _stats_step(rope) if kind == "stats" else _kl_step
    return nnx.jit(fn if mesh is None else with_mesh(mesh, fn))


def calibration_batches(data, count: int, mesh=None) -> list[dict[str, Any]]:
    """The first `count` batches of `data`, a training stream at its start (core/data/batches.py:
    this process's rows), sharded over `mesh`; `data` is rewound to its start."""
    start = data.state()
    out = []
    for _ in range(count):
        batch = next(data)
        out.append(batch if mesh is None else shard_batch(batch, mesh, process_local=True))
    data.restore(start)
    return out


def layer_stats(model, batches, mesh=None) -> list[LayerStats]:
    """Each CSA layer's calibration sums over `batches` (in layer order), pooled in float64."""
    rope = csa_attentions(model)[0][1].spec.rope
    stats_step = _jitted("stats", rope, mesh)
    sums = None
    for batch in batches:
        out = [_host(a) for a in stats_step(model, *(batch[k] for k in INPUTS))]
        sums = out if sums is None else [a + b for a, b in zip(sums, out)]
    return [LayerStats(*(float(s[i]) if s.ndim == 1 else s[i] for s in sums)) for i in range(len(sums[0]))]


def teacher_init(model, batches: list[dict[str, Any]], mesh=None) -> TeacherInit:
    """Initialise every indexer of `model` (a Transformer holding a trained model) from its teacher.

    Args:
      model: the model, changed in place (only the indexers' parameters).
      batches: the calibration batches (`calibration_batches`).
      mesh: the device mesh its state lives on (the batches are sharded over it), or None.

    Returns:
      TeacherInit (its `line()` is the training commands' notice).
    """
    start = time.perf_counter()
    attns = csa_attentions(model)
    rope = attns[0][1].spec.rope
    results = []
    for (layer, attn, j), stats in zip(attns, layer_stats(model, batches, mesh)):
        comp = attn.compressor
        teacher = TeacherWeights(_read(attn.wq_b, j), _read(comp.wkv, j), _read(comp.wgate, j), _read(comp.ape, j),
                                 _read(comp.norm.weight, j))
        idx = attn.indexer
        new = teacher_indexer(teacher, stats, index_heads=idx.heads, index_dim=idx.head_dim, rope_dim=2 * len(rope))
        for var, value in ((idx.wq_b, new.wq_b), (idx.weights_proj, new.weights_proj), (idx.compressor.wkv, new.wkv),
                           (idx.compressor.wgate, new.wgate), (idx.compressor.ape, new.ape),
                           (idx.compressor.norm.weight, new.norm)):
            _write(var, j, value)
        results.append(new)

    kl_step = _jitted("kl", rope, mesh)
    kls, kl_u = 0.0, 0.0
    for batch in batches:
        a, b = kl_step(model, *(batch[k] for k in INPUTS))
        kls, kl_u = kls + _host(a), kl_u + _host(b)
    best = np.argmin(kls, axis=1)
    for i, (layer, attn, j) in enumerate(attns):
        proj = attn.indexer.weights_proj
        _write(proj, j, results[i].weights_proj * TEMPERATURES[best[i]])
    tokens = int(sum(np.sum(_host(b["segment_ids"]) > 0) for b in batches))
    return TeacherInit(layers=tuple(l for l, _, _ in attns), kept=tuple(r.kept for r in results),
                       weight_fit=tuple(r.weight_fit for r in results),
                       temperature=tuple(TEMPERATURES[k] for k in best),
                       kl=tuple(float(kls[i, k]) for i, k in enumerate(best)), kl_uniform=tuple(map(float, kl_u)),
                       batches=len(batches), tokens=tokens, seconds=time.perf_counter() - start)
