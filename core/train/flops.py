"""Model FLOPs of one training step, counted from the config's shapes: the numerator of MFU.

MaxText's model FLOPs (`calculate_tflops_training_per_device`), for DESIGN.md's model and stage table:
the matmul work the step needs, once. Nothing is traced: every figure is a closed form of the
config's widths, T and the batch rows.

What counts. Matmul FLOPs only, 2·m·n·k for every contraction of the model's maths as DESIGN.md
writes it: the attention's projections (W_qa, W_qb, W_kv, the grouped W_oa and W_ob), its logits
q·k and weighted values p·v; the compressor's two projections (its pooling is elementwise); the
indexer's projections, its scores q_I·k_I and their weighted sum over heads; the router, the active
experts (num_experts_per_tok routed + shared_experts, SwiGLU: three matmuls each) and their weighted
combine; mHC's mixing projection and its pre, comb and post mixes; the head collapse and the LM
head. Norms, softmax, RoPE, top-k, the losses' closed forms, the optimizer and the MoE's load
statistics do not count. The indexer loss's teacher logits Q·K are the main attention's logits
(the same detached q·k over the same allowed blocks, and for the joint teacher the same window
keys): they count once, as the attention's.

Only the work the step needs (`live_parts`). A stage with an LM loss needs every layer. Without one
(the warm-up) the step's outputs are the indexer losses, the MoE's load-balance loss and the
indexer's gradients: the last layer any of them reads ends the count. In the last learned-routing
layer only its router is needed past the attention (its experts, their combine and the MoE's mHC
comb and post mix feed nothing); where a CSA layer's indexer loss is the last thing read, its
attention is needed up to the teacher's logits (no values, no output projection, no MoE).

Attended area. Each batch row is one document of T tokens (positions 0..T-1). Query t reads
min(S, t + 1) window keys and sees the floor((t + 1) / m) complete blocks before it (a block is
visible once its last token is, core/ops/chunked_attention.py). CSA with top-k (the sparse stage, the
no-indexer-loss row) attends min(k, visible) blocks; CSA over every visible block (pre-training,
warm-up, use_indexer false) and HCA attend the visible ones. The indexer scores every visible
block.

Passes. MaxText's "3 x forward" assumes that everything trains. Here each matmul counts its forward
once, plus once per operand that gets a gradient: a weight that trains, an activation with
something trainable upstream of it feeding a loss. From the stage table (core/config/stages.py):
- where the rest of the model trains (pre-training, sparse, no indexer loss), every matmul of the
  main path counts 3 (the embedding trains, so every activation gets its gradient);
- the indexer's inputs are detached: its projections count 2 (forward and weight gradient) and its
  scores 3 (both operands come from its own weights) when its loss is on, 1 otherwise;
- the warm-up's frozen model counts 1.
No remat recomputation and no recomputation of the implementation (the selection's scoring pass
before the loss's, the streamed loss's own teacher queries and logits, a closed-form backward):
each matmul of the model counts once.

Components are those of `dsv4 bench --train --profile` (core/bench/components.py), so the two
splits compare: the indexer's own compressor counts under "compressor", the head collapse under
"mHC".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

from core.config.stages import stage_of

COMPONENTS = ("attention", "compressor", "indexer", "MoE", "mHC", "head")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul of the model over the step's batch.

    Attributes:
      name: what it computes ("wq_a", "window logits", "routed experts", ...).
      component: one of COMPONENTS.
      flops: its forward, 2·m·n·k summed over the batch.
      passes: 1 (forward) + 1 per operand that gets a gradient (module docstring).
    """

    name: str
    component: str
    flops: float
    passes: int

    @property
    def step_flops(self) -> float:
        return self.flops * self.passes


class Area(NamedTuple):
    """(query, key) pairs of one layer in one sequence, summed over its T queries."""

    window: int     # raw keys in the sliding window
    attended: int   # compressed blocks the attention reads (the indexer loss's teacher reads the same)
    visible: int    # compressed blocks visible (the indexer scores them all)


def _blocks_seen(t: int, ratio: int) -> int:
    """sum over u = 1..t of floor(u / ratio): the blocks queries 0..t-1 see."""
    q, r = divmod(t, ratio)
    return ratio * q * (q - 1) // 2 + q * (r + 1)


def _blocks_capped(t: int, ratio: int, k: int) -> int:
    """sum over queries 0..t-1 of min(k, visible blocks): visible reaches k at query k * ratio - 1."""
    ramp = min(t, k * ratio - 1)
    return _blocks_seen(ramp, ratio) + k * (t - ramp)


def _window_keys(t: int, window: int) -> int:
    """sum over queries 0..t-1 of min(window, query + 1)."""
    ramp = min(t, window)
    return ramp * (ramp + 1) // 2 + window * (t - ramp)


def causal_area(cfg, layer: int) -> Area:
    """The pairs one sequence of `cfg` attends in `layer` (module docstring), in training."""
    t, ratio, stage = cfg.max_target_length, cfg.compress_ratios[layer], stage_of(cfg)
    window = _window_keys(t, cfg.sliding_window_size)
    if not ratio:
        return Area(window, 0, 0)
    visible = _blocks_seen(t, ratio)
    selected = _blocks_capped(t, ratio, cfg.indexer_topk)
    indexed = ratio == 4 and cfg.use_indexer  # only CSA layers have an indexer, and so a top-k
    return Area(window, selected if indexed and stage.csa_topk else visible, visible)


LIVE = ("all", "router", "teacher", "none")  # what of a layer the step needs (`live_parts`)


def live_parts(cfg) -> tuple[str, ...]:
    """What of each layer the step needs (module docstring), layer by layer, one of LIVE:

    "all" every matmul; "router" all but the MoE's experts, their combine and its mHC's comb and post
    mix (the last learned-routing layer of a step without an LM loss: the load-balance loss reads its
    router); "teacher" its mHC's mixing and pre mix before the attention, the queries, the compressor
    and the block logits (the window's too with the joint teacher) and the indexer (the last CSA
    layer, where no router after it is read); "none" nothing.
    """
    stage, n = stage_of(cfg), cfg.num_layers
    if stage.lm_loss:
        return ("all",) * n
    losses = [i for i, r in enumerate(cfg.compress_ratios) if r == 4 and cfg.use_indexer]
    last_loss = losses[-1] if losses and stage.indexer_loss != "off" else -1
    last_router = n - 1 if cfg.first_num_hash_layers < n else -1  # learned routing follows the hash layers
    last = max(last_loss, last_router)
    return tuple("all" if i < last else "router" if i == last_router else "teacher" if i == last_loss else "none"
                 for i in range(n))


def layer_matmuls(cfg, layer: int, rows: int, area: Area, live: str = "all") -> list[Matmul]:
    """The matmuls of one decoder layer over `rows` sequences that attend `area` each, of its `live`
    part (`live_parts`).

    Shapes (n = rows * T tokens; n_m = rows * (T // m) * m tokens in complete blocks):
      1. attention: n x (M·q_lora + q_lora·H·D + M·D + H·D·o_lora + G·o_lora·M); area x 2·H·D twice
      2. compressor (m > 0): 2 x n_m x M x c·D (c = 2 for m = 4)
      3. indexer (CSA, when it runs): n x (q_lora·HI·DI + M·HI), its compressor 2 x n_4 x M x 2·DI,
         visible x HI·(DI + 1)
      4. MoE: n x (M·E + 3·M·F·(k + shared) + k·M)
      5. mHC, twice: n x (n_hc·M·(2 + n_hc)·n_hc + n_hc·M·(2 + n_hc))
    """
    if live not in LIVE:
        raise ValueError(f"live={live!r}: one of {', '.join(LIVE)}")
    stage, ratio = stage_of(cfg), cfg.compress_ratios[layer]
    t, m, h, d = cfg.max_target_length, cfg.emb, cfg.num_heads, cfg.head_dim
    n = rows * t
    main = 3 if stage.trains_rest else 1
    out: list[Matmul] = []
    if live == "none":
        return out
    attends = live != "teacher"  # the attention's output is read (by the next layer or the router)
    joint = cfg.indexer_teacher == "joint"

    def add(name: str, component: str, flops: int, passes: int) -> None:
        out.append(Matmul(name, component, float(flops), passes))

    out += _hyper_connection(cfg, n, main, ("pre",) if not attends else ("pre", "post"))
    add("wq_a", "attention", 2 * n * m * cfg.q_lora_rank, main)
    add("wq_b", "attention", 2 * n * cfg.q_lora_rank * h * d, main)
    if attends or joint:  # the joint teacher's normaliser reads the window logits
        add("wkv", "attention", 2 * n * m * d, main)
        add("window logits", "attention", 2 * rows * area.window * h * d, main)
    if attends:
        add("window values", "attention", 2 * rows * area.window * h * d, main)
    if ratio:
        pooled = rows * (t // ratio) * ratio  # trailing tokens that fill no block are not compressed
        width = (2 if ratio == 4 else 1) * d
        add("block logits", "attention", 2 * rows * area.attended * h * d, main)
        if attends:
            add("block values", "attention", 2 * rows * area.attended * h * d, main)
        add("compressor wkv", "compressor", 2 * pooled * m * width, main)
        add("compressor wgate", "compressor", 2 * pooled * m * width, main)
    if attends:
        add("wo_a", "attention", 2 * n * h * d * cfg.o_lora_rank, main)
        add("wo_b", "attention", 2 * n * cfg.o_groups * cfg.o_lora_rank * m, main)
    if ratio == 4 and cfg.use_indexer and (stage.csa_topk or stage.indexer_loss != "off"):
        out += _indexer(cfg, stage, rows, area)
    if not attends:
        return out
    e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim
    add("router", "MoE", 2 * n * m * e, main)
    out += _hyper_connection(cfg, n, main, ("pre", "post") if live == "all" else ("pre",))
    if live == "router":  # the experts' output feeds nothing
        return out
    add("routed experts", "MoE", 3 * 2 * n * k * m * f, main)
    if cfg.shared_experts:
        add("shared experts", "MoE", 3 * 2 * n * cfg.shared_experts * f * m, main)
    add("expert combine", "MoE", 2 * n * k * m, main)
    return out


def _indexer(cfg, stage, rows: int, area: Area) -> list[Matmul]:
    """The lightning indexer of a CSA layer (its loss's teacher logits are the attention's)."""
    t, m, hi, di = cfg.max_target_length, cfg.emb, cfg.indexer_n_heads, cfg.indexer_head_dim
    n, pooled = rows * t, rows * (t // 4) * 4
    learns = stage.indexer_loss != "off" and stage.trains_indexer
    weights, scores = (2, 3) if learns else (1, 1)
    return [Matmul("indexer wq_b", "indexer", float(2 * n * cfg.q_lora_rank * hi * di), weights),
           Matmul("indexer weights_proj", "indexer", float(2 * n * m * hi), weights),
           Matmul("indexer compressor wkv", "compressor", float(2 * pooled * m * 2 * di), weights),
           Matmul("indexer compressor wgate", "compressor", float(2 * pooled * m * 2 * di), weights),
           Matmul("indexer scores", "indexer", float(2 * rows * area.visible * hi * di), scores),
           Matmul("indexer head sum", "indexer", float(2 * rows * area.visible * hi), scores)]


def _hyper_connection(cfg, n: int, passes: int, sides: tuple[str, ...]) -> list[Matmul]:
    """One mHC around a sublayer: the mixing projection and the pre mix (side "pre"), the comb and
    post mixes (side "post", the residual stream after the sublayer)."""
    m, c = cfg.emb, cfg.mhc_expansion_rate
    out = [Matmul("mHC mixing projection", "mHC", float(2 * n * c * m * (2 + c) * c), passes),
           Matmul("mHC pre", "mHC", float(2 * n * c * m), passes)]
    if "post" in sides:
        out += [Matmul("mHC comb", "mHC", float(2 * n * c * c * m), passes),
                Matmul("mHC post", "mHC", float(2 * n * c * m), passes)]
    return out


def step_matmuls(cfg, batch_rows: int | None = None, *,
                 area: Callable[..., Area] = causal_area) -> list[Matmul]:
    """Every matmul of one training step of `cfg` (module docstring), layer by layer, then the head.

    Args:
      cfg: a Config (its stage row decides what runs and what trains).
      batch_rows: sequences in the step's batch, the global one (default per_device_batch_size).
      area: (cfg, layer) -> the Area one sequence attends in that layer (default `causal_area`;
        a test passes the dense reference's full [T, T] / [T, W] area).
    Returns:
      [Matmul], each with its forward FLOPs over the batch and its passes.
    """
    rows = cfg.per_device_batch_size if batch_rows is None else batch_rows
    stage = stage_of(cfg)
    out = [mm for layer, live in enumerate(live_parts(cfg))
           for mm in layer_matmuls(cfg, layer, rows, area(cfg, layer), live)]
    if stage.lm_loss:  # the warm-up bypasses the head collapse and the head
        n, m, c = rows * cfg.max_target_length, cfg.emb, cfg.mhc_expansion_rate
        passes = 3 if stage.trains_rest else 1
        out += [Matmul("head collapse projection", "mHC", float(2 * n * c * m * c), passes),
                Matmul("head collapse", "mHC", float(2 * n * c * m), passes),
                Matmul("head", "head", float(2 * n * m * cfg.vocab_size), passes)]
    return out


def model_flops_per_step(cfg, batch_rows: int | None = None) -> dict[str, float]:
    """Model FLOPs of one training step of `cfg` over `batch_rows` sequences (module docstring).

    Args:
      cfg: a Config.
      batch_rows: sequences in the step's global batch (per_device_batch_size x data-parallel
        devices); default per_device_batch_size (one device).
    Returns:
      {component: FLOPs for each of COMPONENTS, "total": their sum, "tokens": batch_rows * T}.
      MFU = total / step seconds / devices / peak FLOP/s per device.
    """
    rows = cfg.per_device_batch_size if batch_rows is None else batch_rows
    out = dict.fromkeys(COMPONENTS, 0.0)
    for mm in step_matmuls(cfg, rows):
        out[mm.component] += mm.step_flops
    return {**out, "total": sum(out.values()), "tokens": float(rows * cfg.max_target_length)}
