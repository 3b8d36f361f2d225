"""Speed and memory of the CSA indexer loss, direct vs chunked vs streamed (`dsv4 bench`).

For each sequence length the loss step (forward + backward to the indexer's queries, keys and
weights, with the top-k selection of sparse training) is built four ways, plus the teacher and KL
alone:

- `direct`:       indexer_scores + csa_indexer_loss, no chunking: [B,T,H,W] teacher logits.
- `head`:         the same with `head_chunk` heads per scan step (indexer scores too).
- `head+query`:   and `query_chunk` query rows per scan step in the loss.
- `streamed`:     csa_indexer_loss_streamed: scores, selection, teacher and KL per query block.
- `teacher+kl`:   csa_indexer_loss alone (head and query chunks) from given scores, gradient to
                  the scores: the part whose FLOPs are the teacher's matmul. Its loss equals
                  direct's; its gradient is w.r.t. other inputs, so no gradient difference.

Each is compiled once (compile time, XLA's temporary-buffer size) and, when the direct path fits
the memory budget, run: median step time after a warm-up (timed round-robin with a float32
matmul), max |diff| of loss and gradients vs direct, and achieved GFLOP/s against that matmul. FLOPs are counted
analytically (the matmuls of teacher, indexer forward and indexer backward), so a path that
recomputes gets no credit for it. Nothing here prints: results are dataclasses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from core.config.schema import load_config
from core.errors import ConfigError
from core.loss.indexer_kl import csa_indexer_loss_streamed
from core.loss.indexer_kl_direct import WholeTeacher, csa_indexer_loss
from core.ops.chunked_attention import Keys, RowQueries
from core.ops.masked_attention import csa_visible, selection_mask
from core.ops.topk import IndexerInputs, indexer_scores, select_topk

SHAPE_MODELS = {"flash": "deepseek4-284b", "tiny": "deepseek4-tiny"}
VARIANTS = ("direct", "head", "head+query", "streamed", "teacher+kl")
MAX_QUERY_CHUNK = 256  # default query chunk: min(this, T // 4)


@dataclasses.dataclass(frozen=True)
class LossShape:
    """Attention shapes of the benchmarked CSA layer (from the model config)."""

    name: str
    model: str
    batch: int
    heads: int             # H
    head_dim: int          # D
    indexer_heads: int     # HI
    indexer_head_dim: int  # DI
    topk: int              # blocks
    ratio: int = 4         # tokens per compressed block

    @property
    def default_head_chunk(self) -> int:
        """An eighth of the heads (8 at Flash shapes), at least 1, dividing H and HI."""
        return max(1, math.gcd(self.heads, self.indexer_heads) // 8)

    @property
    def matmul_size(self) -> int:
        """Side of the reference matmul: big enough to reach the device's f32 peak."""
        if self.name == "tiny":
            return 512
        return 2048 if jax.default_backend() == "cpu" else 8192


@dataclasses.dataclass
class VariantResult:
    variant: str
    head_chunk: int
    query_chunk: int
    flops: float                        # analytic FLOPs of this variant's fwd+bwd step
    compile_s: float
    temp_bytes: int                     # XLA temporary buffers of the compiled fwd+bwd step
    ran: bool
    step_s: float | None = None         # median over repeats
    loss: float | None = None
    loss_abs_diff: float | None = None  # vs direct
    grad_abs_diff: float | None = None  # max over q_idx, k_idx, w_idx, vs direct (not teacher+kl)
    gflops: float | None = None
    matmul_share: float | None = None   # gflops / same-run matmul GFLOP/s
    speed_vs_direct: float | None = None  # step_s / direct step_s


@dataclasses.dataclass
class SeqResult:
    seq: int
    flops: float                   # analytic FLOPs of one fwd+bwd step (teacher + indexer)
    direct_bytes: int              # direct path's arguments + outputs + temporaries
    fits: bool                     # direct_bytes within the budget: run, else compile only
    matmul_gflops: float           # f32 matmul timed in the same rounds as this length's variants
    variants: list[VariantResult]


@dataclasses.dataclass
class LossBenchResult:
    shape: LossShape
    head_chunk: int
    query_chunk: int | None  # None: min(256, T // 4) per length
    repeats: int
    device: str
    budget_bytes: int
    matmul_gflops: float  # best of the per-length matmul measurements
    seqs: list[SeqResult]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def loss_shape(name: str, batch: int = 1) -> LossShape:
    """`flash` (deepseek4-284b, DeepSeek-V4-Flash) or `tiny` (deepseek4-tiny) attention shapes."""
    if name not in SHAPE_MODELS:
        raise ConfigError(f"unknown bench shape {name!r}: use one of {', '.join(SHAPE_MODELS)}.")
    cfg = load_config(SHAPE_MODELS[name])
    return LossShape(name, cfg.model_name, batch, cfg.num_heads, cfg.head_dim, cfg.indexer_n_heads,
                     cfg.indexer_head_dim, cfg.indexer_topk)


def step_flops(shape: LossShape, seq: int, variant: str = "direct") -> float:
    """Analytic FLOPs of one loss step: teacher logits, indexer scores, and their backward.

    2BTW (H D) for the teacher; the indexer's q.k is 2BTW (HI DI) forward and twice that
    backward (to q and to k); its head weighting 2BTW HI forward and the same backward.
    `teacher+kl` counts the teacher only (softmax and KL are O(BTW(H + 1)) elementwise).
    """
    btw = shape.batch * seq * (seq // shape.ratio)
    hd, hid = shape.heads * shape.head_dim, shape.indexer_heads * shape.indexer_head_dim
    if variant == "teacher+kl":
        return 2.0 * btw * hd
    return 2.0 * btw * (hd + 3 * hid + 2 * shape.indexer_heads)


def memory_budget() -> int:
    """Bytes a run may use: the accelerator's memory limit, else the host's available RAM."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def variant_chunks(variant: str, head_chunk: int, query_chunk: int) -> tuple[int, int]:
    """(head_chunk, query_chunk) a variant runs with."""
    return (0 if variant == "direct" else head_chunk,
            query_chunk if variant in ("head+query", "streamed", "teacher+kl") else 0)


def _allowed(shape: LossShape, scores, visible):
    idx, ok = select_topk(scores, visible, shape.topk)
    return visible & selection_mask(idx, ok, scores.shape[-1])


@functools.partial(jax.jit, static_argnums=0)
def _scores_and_allowed(shape: LossShape, q_idx, k_idx, w_idx, query, kv, pos, seg):
    """The teacher+kl variant's inputs: indexer scores and the sparse allowed mask."""
    visible = csa_visible(pos, seg, shape.ratio)
    scores = indexer_scores(q_idx, k_idx, w_idx, visible)
    return scores, _allowed(shape, scores, visible), query, kv


def _loss_fn(shape: LossShape, variant: str, head_chunk: int, query_chunk: int) -> Callable:
    """A variant's loss: of (q_idx, k_idx, w_idx, query, kv, positions, segment_ids), or of
    (scores, allowed, query, kv) for teacher+kl. Sparse (top-k) in every case."""
    hc, qc = variant_chunks(variant, head_chunk, query_chunk)
    if variant == "teacher+kl":
        return lambda scores, allowed, query, kv: csa_indexer_loss(scores, WholeTeacher(query, kv), allowed,
                                                                   head_chunk=hc, query_chunk=qc)
    if variant == "streamed":
        return lambda q_idx, k_idx, w_idx, query, kv, pos, seg: csa_indexer_loss_streamed(
            IndexerInputs(RowQueries.given(q_idx), k_idx, w_idx), RowQueries.given(query),
            Keys(None, None, 0, kv, shape.ratio), pos, seg, topk=shape.topk, head_chunk=hc, query_chunk=qc)

    def loss(q_idx, k_idx, w_idx, query, kv, pos, seg):
        visible = csa_visible(pos, seg, shape.ratio)
        scores = indexer_scores(q_idx, k_idx, w_idx, visible, head_chunk=hc)
        return csa_indexer_loss(scores, WholeTeacher(query, kv), _allowed(shape, scores, visible), head_chunk=hc,
                                query_chunk=qc)

    return loss


def _input_specs(shape: LossShape, seq: int, variant: str = "direct") -> tuple[jax.ShapeDtypeStruct, ...]:
    b, w, f32, i32 = shape.batch, seq // shape.ratio, jnp.float32, jnp.int32
    if variant == "teacher+kl":
        return (jax.ShapeDtypeStruct((b, seq, w), f32), jax.ShapeDtypeStruct((b, seq, w), jnp.bool_),
                jax.ShapeDtypeStruct((b, seq, shape.heads, shape.head_dim), f32),
                jax.ShapeDtypeStruct((b, w, shape.head_dim), f32))
    return (
        jax.ShapeDtypeStruct((b, seq, shape.indexer_heads, shape.indexer_head_dim), f32),
        jax.ShapeDtypeStruct((b, w, shape.indexer_head_dim), f32),
        jax.ShapeDtypeStruct((b, seq, shape.indexer_heads), f32),
        jax.ShapeDtypeStruct((b, seq, shape.heads, shape.head_dim), f32),
        jax.ShapeDtypeStruct((b, w, shape.head_dim), f32),
        jax.ShapeDtypeStruct((b, seq), i32),
        jax.ShapeDtypeStruct((b, seq), i32),
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _make_inputs(shape: LossShape, seq: int, key):
    """Random inputs at the scales the model produces, one packed document per row."""
    kq, kk, kw, kx, kv = jax.random.split(key, 5)
    specs = _input_specs(shape, seq)
    weight_scale = (shape.indexer_heads * shape.indexer_head_dim) ** -0.5
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (shape.batch, seq))
    return (
        jax.random.normal(kq, specs[0].shape),
        jax.random.normal(kk, specs[1].shape),
        jax.random.normal(kw, specs[2].shape) * weight_scale,
        jax.random.normal(kx, specs[3].shape) * shape.head_dim ** -0.5,
        jax.random.normal(kv, specs[4].shape),
        pos,
        jnp.ones((shape.batch, seq), jnp.int32),
    )


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _matmul(size: int) -> Callable[[], Any]:
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))  # compile and warm up
    return lambda: matmul(a)


def compile_step(shape: LossShape, seq: int, variant: str, head_chunk: int, query_chunk: int):
    """(compiled fwd+bwd step, compile seconds, XLA memory analysis) of one variant at length `seq`."""
    argnums = (0,) if variant == "teacher+kl" else (0, 1, 2)
    step = jax.value_and_grad(_loss_fn(shape, variant, head_chunk, query_chunk), argnums=argnums)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(*_input_specs(shape, seq, variant)).compile()
    return compiled, time.perf_counter() - start, compiled.memory_analysis()


def _max_abs_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def progress_units(num_seqs: int, repeats: int) -> int:
    """How many times `run_loss_bench` calls `on_progress`: per length, each variant then each round."""
    return num_seqs * (len(VARIANTS) + max(repeats, 1))


def bench_seq(shape: LossShape, seq: int, *, head_chunk: int, query_chunk: int, repeats: int,
              budget_bytes: int, on_progress: Callable[[str], None] | None = None) -> SeqResult:
    """Compile every variant at one length; run them when the direct path fits the budget.

    Each variant is compiled, run once (warm-up, parity against direct), then timed round-robin:
    every round times the reference matmul and one step of each variant, so on a machine shared
    with other work all of them see the same conditions; medians over the rounds are reported.
    """
    report = on_progress or (lambda label: None)
    results, calls, reference, fits, direct_bytes, inputs = [], {}, None, False, 0, None
    for variant in VARIANTS:
        fn, compile_s, mem = compile_step(shape, seq, variant, head_chunk, query_chunk)
        res = VariantResult(variant, *variant_chunks(variant, head_chunk, query_chunk),
                            step_flops(shape, seq, variant), compile_s, int(mem.temp_size_in_bytes), ran=False)
        if variant == "direct":  # VARIANTS[0]: its memory decides whether this length runs
            direct_bytes = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            fits = direct_bytes <= budget_bytes
            inputs = _make_inputs(shape, seq, jax.random.key(seq)) if fits else None
        if fits:
            args = _scores_and_allowed(shape, *inputs) if variant == "teacher+kl" else inputs
            calls[variant] = functools.partial(fn, *args)
            out = calls[variant]()  # warm-up and parity
            reference = out if reference is None else reference
            res.ran, res.loss = True, float(out[0])
            res.loss_abs_diff = abs(float(out[0]) - float(reference[0]))
            if variant != "teacher+kl":
                res.grad_abs_diff = _max_abs_diff(out[1], reference[1])
            del out
        results.append(res)
        report(f"T={seq} {variant}")
    matmul, times = _matmul(shape.matmul_size), {"matmul": []}
    for r in range(max(repeats, 1)):
        times["matmul"].append(_timed(matmul))
        for variant, call in calls.items():
            times.setdefault(variant, []).append(_timed(call))
        report(f"T={seq} round {r + 1}")
    matmul_gf = 2.0 * shape.matmul_size**3 / statistics.median(times["matmul"]) / 1e9
    for res in results if fits else ():
        res.step_s = statistics.median(times[res.variant])
        res.gflops = res.flops / res.step_s / 1e9
        res.matmul_share = res.gflops / matmul_gf
        res.speed_vs_direct = res.step_s / results[0].step_s
    return SeqResult(seq, step_flops(shape, seq), int(direct_bytes), fits, matmul_gf, results)


def _query_chunk(query_chunk: int | None, seq: int) -> int:
    return min(MAX_QUERY_CHUNK, seq // 4) if query_chunk is None else query_chunk


def run_loss_bench(shape: LossShape, seqs: list[int], *, head_chunk: int | None = None,
                   query_chunk: int | None = None, repeats: int = 3, budget_bytes: int | None = None,
                   on_progress: Callable[[str], None] | None = None) -> LossBenchResult:
    """The whole `dsv4 bench` loss table; `on_progress` is called `progress_units(...)` times.

    head_chunk None = `shape.default_head_chunk`; query_chunk None = min(256, T // 4) per length.
    """
    head_chunk = shape.default_head_chunk if head_chunk is None else head_chunk
    for seq in seqs:
        qc = _query_chunk(query_chunk, seq) or seq
        if seq <= 0 or seq % shape.ratio or seq % qc:
            raise ConfigError(f"--seq {seq}: each length must be a positive multiple of {shape.ratio} and of the "
                              f"query chunk ({qc}); pick lengths that divide.")
    if head_chunk and (shape.heads % head_chunk or shape.indexer_heads % head_chunk):
        raise ConfigError(f"--chunk {head_chunk} must divide the {shape.heads} heads and the {shape.indexer_heads} "
                          f"indexer heads of the {shape.name} shape; pick a divisor.")
    budget = budget_bytes if budget_bytes is not None else memory_budget()
    rows = [bench_seq(shape, seq, head_chunk=head_chunk, query_chunk=_query_chunk(query_chunk, seq),
                      repeats=repeats, budget_bytes=budget, on_progress=on_progress) for seq in seqs]
    device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind} x{jax.device_count()}"
    matmul = max(row.matmul_gflops for row in rows)
    return LossBenchResult(shape, head_chunk, query_chunk, repeats, device, budget, matmul, rows)
