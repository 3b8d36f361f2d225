"""The DeepSeek-V4 decoder (DESIGN.md, "The model"; the stage table under "The indexer loss").

  x = expand(embed[tokens], n)                                  residual stream [B, T, n, M]
  per layer:  y, post, comb = hc_attn.pre(x);  x = post(attn(attn_norm(y)), x, post, comb)
              y, post, comb = hc_ffn.pre(x);   x = post(ffn(ffn_norm(y)), x, post, comb)
  h = norm(hc_head(x));  logits = h @ head                     h [B, T, M], logits float32 [B, T, V]

The learned sublayer norms attn_norm / ffn_norm after the mHC `pre` are the official code's
(`Block.forward`); DESIGN.md leaves them implicit. Layer kind comes from compress_ratios (0 SWA,
4 CSA, 128 HCA); the first `first_num_hash_layers` route experts by token id.

Layer grouping (compile time). The layers are cut into segments (`layer_plan`): with
`scan_layers`, a run of >= 2 repeats of a 1- or 2-layer unit of identical structure is created
once with `nnx.vmap` (parameters stacked on a leading "layers" axis) and run with `jax.lax.scan`
over its split variables (`run_segment`: variables go in, never out), so deepseek4-tiny compiles
four distinct layer bodies (SWA, hash-routed CSA, HCA, CSA), not 43.
Parameter tree (`segments[s] = (start, unit, repeats)`):

  embed [V, M]; hc_head.{fn, base, scale}; norm.weight; head [M, V];
  layers.{s}.<block>              a single layer (repeats = 1): layer `start`
  layers.{s}.blocks.{u}.<block>   a scanned segment: leading axis j, layer start + j * unit + u
  <block> = attn_norm, attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink,
            compressor.{wkv, wgate, ape, norm}, indexer.{wq_b, weights_proj, compressor.*}},
            ffn_norm, ffn.{gate.{weight, bias | tid2eid}, experts.{w1, w2, w3},
            shared_experts.{w1, w2, w3}}, hc_attn.{fn, base, scale}, hc_ffn.{fn, base, scale}
Without `scan_layers` every segment is a single layer, so `layers.{i}` is layer i.

Activation checkpointing (`remat_policy`, MaxText's names where MaxText has one): every layer body,
scanned or not, runs under `jax.checkpoint` with the policy `remat_policy(name, platform)` gives,
which decides what the backward pass keeps from the forward and what it recomputes:
  none         no remat: every residual the autodiff wants is kept, per layer (most memory, no recompute);
  minimal      keep the outputs of matmuls without batch dimensions (x @ W projections), recompute the
               rest (norms, RoPE, attention scores and softmax, mHC mixing, Pallas kernels);
  projections  keep the products that are costly to recompute, by name (PROJECTION_NAMES: the attention's
               query projection and the queries the kernels read, its output and output projection, the
               fused kernels' log-sum-exp, the compressor's projections, the experts' gate and up products,
               the megablox kernels' too, and each sublayer's output), recompute the elementwise work
               between them and the small projections, and offload each layer's input to host memory
               where the platform has it apart from the device's (TPU, GPU);
  experts      keep the MoE's products by name (EXPERT_NAMES: the gate and up products of the routed and
               shared experts, the combine weights, both sublayers' outputs and the attention's grouped
               output projection) and each layer's input, on the device, and recompute the rest (the
               attention up to its output projections, the mHC, the rows the grouped matmuls read,
               under expert parallelism the exchange that brought them): the backward runs none of the
               MoE's matmuls nor the output projections again, at about a quarter of `projections`' bytes;
  full         keep only each layer's input; the whole layer runs again in the backward (one extra
               forward of the layers, least memory).
Every remat policy also keeps SAVED_NAMES, values tagged with `checkpoint_name` where they are
made: the CSA top-k selection (int [B, T, k] + bool), the streamed indexer loss's closed-form
gradients (per token [B, T, R + HI], its keys [B, W, DI], its query weight), the indexer's own
gradient where `indexer_gradient: local` takes it in the forward (core.model.attention.
local_gradient_loss: one copy of the indexer's parameters per layer) and the MoE's routing
(int: chosen experts, slot rows, tile experts). The backward then runs no indexer scoring, top-k,
indexer loss nor routing sort again, for a few bytes per token and layer. Under `full` the attention
output [B, T, M] is not kept: keeping it grows the temporaries at long T more than it saves.
`auto` (core/spec/platform.py, core/train/remat.py `remat_that_fits`) is `full`, or on a TPU the
first of `none`, `projections` and `experts` whose step compiles within the chip.
In the warm-up nothing but the indexer trains and its gradient is local, so no gradient crosses a
layer: the backward keeps no layer's input and runs no layer again, under any policy (the step's
memory is one layer's plus the weights': tests/model/test_local_gradient.py).

Modes: "train" follows the spec's row of the stage table (`ModelSpec.stage`): CSA attends the
top-k blocks iff `Stage.csa_topk`, the indexer loss is computed iff `Stage.indexer_loss` is not
"off" (dense over every visible block, or sparse over the top-k), the head runs iff
`Stage.lm_loss`. "eval": top-k, no indexer loss; "eval_dense": every visible block, no indexer
loss. Logits are None when the head is not run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from core.model.layers import RMSNorm, dense_init, hold_frozen, param
from core.loss.lm import head_logits
from core.model.block import Block, BlockSpec, HeadCollapse, expand
from core.model.moe import hash_table, update_router_bias
from core.model.params import mask_matcher
from core.model import quant
from core.ops.placement import backward_after_cotangent, mesh_platform_of

MODES = ("train", "eval", "eval_dense")
LAYER_KEYS = ("indexer_loss", "lb_loss", "load", "dropped")  # a block's aux; the rest is a probe's
# Small named values every remat policy keeps (module docstring): what the backward would
# otherwise recompute at a high op count for a few bytes per token (checkpoint_name at the source).
SAVED_NAMES = ("topk_idx", "topk_valid", "topk_mask", "indexer_loss_grads", "indexer_local_grads", "moe_routing")
# The costly products `projections` keeps, named where they are made: the query projection c_q W_qb, the
# queries the kernels read (normed, rotated), the attention's output (inverse-rotated) and its grouped
# projection (core.model.attention), the fused kernels' log-sum-exp (core.ops.fused_attention), the
# compressor's float32 projections, the experts' gate and up products (core.model.moe, routed and
# shared), and both sublayers' outputs, which the mHC post's backward reads (Block). Their elementwise
# consumers (norms, SwiGLU) and the small projections run again.
PROJECTION_NAMES = ("attn_q_proj", "attn_q", "attn_out", "attn_o_lora", "attn_lse", "compressor_proj", "moe_gate",
                    "moe_up", "attn_sublayer_out", "moe_sublayer_out")
# What `experts` keeps (core.model.moe's grouped_experts and swiglu_mlp, core.model.attention, Block): the
# experts' gate and up products and combine weights, the attention's grouped output projection, and both
# sublayers' outputs, which the mHC post's backward reads; the SwiGLU runs again, the down and output
# projections do not. The experts' rows ([B T k, M] in expert order) and the attention's [B, T, H, D] are not
# kept: each twice to eight times a kept product's bytes.
EXPERT_NAMES = ("moe_weights", "moe_gate", "moe_up", "attn_o_lora", "attn_sublayer_out", "moe_sublayer_out")
# and on a GPU the rows the batched experts read (core/ops/batched_experts.py): under expert parallelism across
# hosts the exchange that brought them crosses the network, the dearest work of a layer to run again
GPU_EXPERT_NAMES = ("moe_rows",)
LAYER_INPUT = "decoder_layer_input"  # each layer body's input x [B, T, n, M] (run_segment)
REMAT_POLICIES = ("none", "minimal", "projections", "experts", "full")  # module docstring


def remat_policy(name: str, platform: str):
    """The `jax.checkpoint` policy of remat_policy `name` for a step on `platform` (None: no remat).

    `projections` offloads each layer's input to the host's pinned memory on a TPU or GPU (copied
    out in the forward, back in the backward: MaxText's `decoder_layer_input: offload`); on a CPU,
    whose device memory is the host's, it keeps it like any saved value. `experts` keeps it on the
    device: its way back from the host waited in line in a scan of layers on the chip
    (docs/tpu.md), a wait the step-time model does not see."""
    names = jax.checkpoint_policies.save_only_these_names
    if name == "none":
        return None
    if name == "minimal":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, names(*SAVED_NAMES))
    if name == "full":
        return names(*SAVED_NAMES)
    if name not in ("projections", "experts"):
        raise ValueError(f"remat_policy={name!r} is unknown: use one of {', '.join(REMAT_POLICIES)}")
    if name == "experts":
        return names(*SAVED_NAMES, *EXPERT_NAMES, *(GPU_EXPERT_NAMES if platform == "gpu" else ()), LAYER_INPUT)
    kept = [*SAVED_NAMES, *PROJECTION_NAMES]
    if platform == "cpu":
        return names(*kept, LAYER_INPUT)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=kept, names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the decoder is built from, resolved for a platform (core.spec.resolve builds it
    from a config): its layers' specs, its widths, dtypes and masks, and the stage-table row
    "train" follows. Hashable: `abstract` traces once per spec."""

    blocks: tuple[BlockSpec, ...]   # one per layer
    vocab_size: int
    emb: int
    hc_n: int                       # mhc_expansion_rate
    hc_eps: float
    eps: float                      # normalization_layer_epsilon
    hc_form: str
    hc_mixes_backward: str
    first_hash: int                 # first_num_hash_layers
    csa_layers: tuple[int, ...]     # the CSA layers with an indexer (none without use_indexer)
    num_experts: int
    experts_per_token: int
    stage: Any                      # the config's row of the stage table (core.config.stages.Stage)
    joint: bool                     # indexer_teacher == "joint"
    cross_layer_gradient: bool      # a gradient crosses the layers (core.spec.resolve.crosses_layers)
    remat_policy: str               # one of REMAT_POLICIES
    scan_layers: bool
    weight_dtype: str
    dtype: str
    trainable_mask: tuple[str, ...]  # trainable_parameters_mask
    frozen_mask: tuple[str, ...]     # frozen_parameters_mask
    frozen_weights: str             # core.model.quant.FROZEN_WEIGHTS
    frozen_weight_dtype: str
    init_seed: int                  # init_weights_seed: the weights' and the hash tables' seed

    @property
    def num_layers(self) -> int:
        return len(self.blocks)


def hash_seed(init_seed: int, layer: int) -> int:
    """Seed of layer `layer`'s fixed token -> experts table (distinct per layer and init seed)."""
    return init_seed * 1000 + layer


class BlockGroup(nnx.Module):
    """The repeating unit of a scanned segment (one or two blocks), created stacked by nnx.vmap."""

    def __init__(self, specs, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
        self.blocks = nnx.List([Block(s, rngs=rngs, param_dtype=param_dtype, dtype=dtype) for s in specs])

    def __call__(self, x_btnm, *args, **flags):
        auxes = []
        for block in self.blocks:
            x_btnm, aux = block(x_btnm, *args, **flags)
            auxes.append(aux)
        return x_btnm, auxes


def layer_plan(specs, scan: bool):
    """Cut the layers into segments (start, unit, repeats) in layer order.

    Greedy from layer 0: the 1- or 2-layer unit of identical specs that repeats >= 2 times and
    covers the most layers becomes a scanned segment (ties: the shorter unit); otherwise the layer
    stands alone (unit 1, repeats 1). deepseek4-tiny -> [(0, 1, 2), (2, 1, 1), (3, 2, 20)]:
    the two SWA layers, the hash-routed CSA layer, twenty (HCA, CSA) pairs.
    """
    n, segments, i = len(specs), [], 0
    while i < n:
        best = (1, 1)
        for unit in ((1, 2) if scan else ()):
            r = 1
            while i + unit * (r + 1) <= n and specs[i + unit * r: i + unit * (r + 1)] == specs[i: i + unit]:
                r += 1
            if r >= 2 and unit * r > best[0] * best[1]:
                best = (unit, r)
        segments.append((i,) + best)
        i += best[0] * best[1]
    return tuple(segments)


def _segment(spec: ModelSpec, start, unit, reps, rngs, kw):
    """One Block, or a BlockGroup stacked over `reps` on a leading "layers" axis."""
    specs = spec.blocks
    if reps == 1:
        return Block(specs[start], seed_for_hash_table=hash_seed(spec.init_seed, start), rngs=rngs, **kw)

    @nnx.split_rngs(splits=reps)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=reps, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return BlockGroup(specs[start: start + unit], rngs=r, **kw)

    group = make(rngs)
    for u, block in enumerate(group.blocks):  # stacked hash layers: one table per layer
        table = block.ffn.gate.tid2eid
        if table is not None:
            table[...] = jnp.stack([
                hash_table(hash_seed(spec.init_seed, start + j * unit + u), spec.vocab_size, spec.num_experts,
                           spec.experts_per_token) for j in range(reps)])
    return group


def run_segment(layer, x_btnm, args, flags, *, remat: bool, policy, scanned: bool, tie: bool = True):
    """One segment's forward as a pure function of its variables: `(x, aux)`, or for a scanned
    segment `(x, [aux per unit position] with arrays [repeats, ...])`.

    The layer is split into (graphdef, variables) and its body runs under `jax.checkpoint`
    (`remat`, with `policy`), under core.ops.placement's `backward_after_cotangent` (its backward reads
    what it saved after its cotangent: docs/scaling.md#collective-order-on-the-cpu) and, when
    `scanned`, `jax.lax.scan` over the stacked variables' leading axis (`tie=False` leaves out the
    `backward_after_cotangent`: where no gradient crosses the segment, its opaque backward would
    recompute the whole segment that plain autodiff prunes). Variables go in as inputs
    only, never out (the forward changes none): nnx's own scan and remat would also return every
    variable, and a scan then carries a stacked copy of each one that is not differentiated, as
    large as the segment's weights (the frozen experts of the warm-up: tests/model/test_remat.py
    pins the compiled temp). Inputs outside the differentiated
    state (frozen parameters, router biases) get no tangent, so the backward builds no gradient
    for them.

    The tokens, positions and segment ids (`args`) ride in the scan's carry (through an
    optimization barrier, so that JAX cannot see that they pass unchanged and turn them back into
    constants), not as constants of its body. When JAX linearizes a scan it hoists out of the loop
    whatever the body computes from its constants alone (`_scan_known_hoisting`), and it does so
    inside nested loops too: the streamed indexer loss's per-block visibility masks, broadcast over
    heads, were built once for all layers and all query blocks and kept, stacked, through the step
    (on V4-Flash at T = 32768 they were the step's largest temporaries, `pred[256,1,128,64,8192]`:
    docs/planning.md#v4-flash).
    """
    graphdef, state = nnx.split(layer)

    def body(x, variables, a):
        return nnx.merge(graphdef, variables)(checkpoint_name(x, LAYER_INPUT), *a, **flags)

    if remat:
        body = jax.checkpoint(body, policy=policy, prevent_cse=not scanned)
    if tie:
        body = backward_after_cotangent(body)  # the backward follows the layers above (collective order on XLA:CPU)
    if not scanned:
        return body(x_btnm, state, args)

    def step(carry, variables):
        x, a = carry
        x, aux = body(x, variables, a)
        return (x, jax.lax.optimization_barrier(a)), aux  # a carry that is not a constant in disguise

    (x_btnm, _), aux = jax.lax.scan(step, (x_btnm, args), state)
    return x_btnm, aux


class Transformer(nnx.Module):
    """The decoder: `logits, aux = model(tokens, positions, segment_ids, mode=..., probe=...)`."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        pdt, dt = jnp.dtype(spec.weight_dtype), jnp.dtype(spec.dtype)
        self.dtype, self.n = dt, spec.hc_n
        self.num_layers, self.first_hash = spec.num_layers, spec.first_hash
        self.csa_layers = spec.csa_layers
        self.stage = spec.stage  # what "train" switches on and off (DESIGN.md's stage table)
        self.joint = spec.joint
        self.cross_layer_gradient = spec.cross_layer_gradient
        self.remat_policy = spec.remat_policy
        self.segments = layer_plan(spec.blocks, spec.scan_layers)
        kw = dict(param_dtype=pdt, dtype=dt)
        self.embed = param(rngs, nnx.initializers.normal(0.02), (spec.vocab_size, spec.emb),
                           ("vocab", "embed"), pdt)
        self.layers = nnx.List([_segment(spec, *seg, rngs, kw) for seg in self.segments])
        self.hc_head = HeadCollapse(spec.emb, self.n, spec.hc_eps, spec.eps,
                                    rngs=rngs, param_dtype=pdt, form=spec.hc_form,
                                    mixes_backward=spec.hc_mixes_backward)
        self.norm = RMSNorm(spec.emb, spec.eps, rngs=rngs, param_dtype=pdt)
        self.head = param(rngs, dense_init(), (spec.emb, spec.vocab_size), ("embed", "vocab"), pdt)
        trainable = mask_matcher(spec.trainable_mask, spec.frozen_mask)
        if quant.holds_released(spec.frozen_weights):  # frozen linear weights as the release stores them
            quant.hold_released(self, trainable)
        hold_frozen(self, trainable, jnp.dtype(spec.frozen_weight_dtype))  # no master copy where nothing trains

    def _flags(self, mode: str):
        """(dense, indexer loss, head run) of `mode`, from the stage table in training."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown: use one of {', '.join(MODES)}")
        train, stage = mode == "train", self.stage
        dense = mode == "eval_dense" or (train and not stage.csa_topk)
        loss = train and stage.indexer_loss != "off" and bool(self.csa_layers)
        return dense, loss, not (train and not stage.lm_loss)

    def __call__(self, tokens, positions, segment_ids, *, mode: str = "train", probe=None):
        """The logits: `hidden` then the head (evaluation and the HF parity test use this).

        Args:
          tokens, positions, segment_ids: int [B, T] (DESIGN.md's packed rows).
          mode: "train" | "eval" | "eval_dense" (module docstring).
          probe: called by every CSA layer with its view (core.model.attention.Attention, e.g. its
            `collect`); each key it returns is in aux, stacked in layer order (leading axis len(csa_layers)).

        Returns:
          (logits float32 [B, T, V] or None, aux) with aux["indexer_loss"] (mean over CSA layers
          of the scaled layer losses, 0.0 when not computed), aux["moe_lb_loss"] (mean over
          learned-routing layers), aux["expert_load"] [L, E], aux["moe_dropped"] (the fraction of
          routed slots dropped for expert-parallel capacity, mean over layers); the probe's keys.
        """
        h, aux = self.hidden(tokens, positions, segment_ids, mode=mode, probe=probe)
        return (None if h is None else self.logits(h)), aux

    def logits(self, h_btm):
        """The head: final hidden states [B, T, M] -> float32 logits [B, T, V]."""
        return head_logits(h_btm, self.head[...].astype(self.dtype))

    def hidden(self, tokens, positions, segment_ids, *, mode: str = "train", probe=None):
        """The decoder without its head: (h [B, T, M] = norm(hc_head(x)) or None, aux).

        Same arguments and aux as `__call__`; h is None where the head is not run (dense warm-up).
        The training step feeds h and `self.head` to the chunked LM loss (core/loss/lm.py).
        """
        dense, loss, run_head = self._flags(mode)
        flags = dict(dense=dense, indexer_loss=loss, probe=probe)
        args = (tokens, positions, segment_ids)
        x = expand(self.embed[...].astype(self.dtype)[tokens], self.n)  # cast first: FSDP gathers in dtype

        policy = remat_policy(self.remat_policy, mesh_platform_of(jax.sharding.get_abstract_mesh()))
        auxes = []  # per segment: [aux per unit position], arrays [repeats, ...] when scanned
        for (_, _, reps), layer in zip(self.segments, self.layers):
            x, aux = run_segment(layer, x, args, flags, remat=self.remat_policy != "none", policy=policy,
                                 scanned=reps > 1, tie=self.cross_layer_gradient)
            auxes.append(aux if reps > 1 else [aux])
        h = self.norm(self.hc_head(x)) if run_head else None
        return h, self._aux(auxes, loss)

    def _layer_values(self, auxes, key, layers):
        """Stack aux[key] (an array or a pytree of them) of the given layers in layer order:
        [len(layers), ...] (None if none)."""
        parts = []
        for (start, unit, reps), seg_aux in zip(self.segments, auxes):
            us = [u for u in range(unit) if start + u in layers]  # same kind in every repeat
            if not us:
                continue
            if reps == 1:
                parts.append(jax.tree.map(lambda a: a[None], seg_aux[0][key]))
            else:  # layer start + j * unit + u holds seg_aux[u][key][j]
                arr = jax.tree.map(lambda *a: jnp.stack(a, axis=1), *[seg_aux[u][key] for u in us])
                parts.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), arr))
        return jax.tree.map(lambda *a: jnp.concatenate(a), *parts) if parts else None

    def _aux(self, auxes, loss: bool):
        learned = set(range(self.first_hash, self.num_layers))
        csa = set(self.csa_layers)
        lb = self._layer_values(auxes, "lb_loss", learned)
        aux = {
            "indexer_loss": (jnp.mean(self._layer_values(auxes, "indexer_loss", csa)) if loss
                             else jnp.zeros((), jnp.float32)),
            "moe_lb_loss": jnp.mean(lb) if lb is not None else jnp.zeros((), jnp.float32),
            "expert_load": self._layer_values(auxes, "load", set(range(self.num_layers))),
            "moe_dropped": jnp.mean(self._layer_values(auxes, "dropped", set(range(self.num_layers)))),
        }
        probed = dict.fromkeys(k for seg in auxes for unit in seg for k in unit if k not in LAYER_KEYS)
        for key in probed if csa else ():  # the probe's, in the order it returned them
            aux[key] = self._layer_values(auxes, key, csa)
        return aux

    def update_router_biases(self, expert_load_le, rate: float) -> None:
        """After an optimizer step: bias_e += rate * sign(mean - load_e) in every learned layer.

        Args:
          expert_load_le: aux["expert_load"] [L, E] of the step (hash layers' rows are ignored).
          rate: routed_bias_update_rate.
        """
        for (start, unit, reps), layer in zip(self.segments, self.layers):
            blocks = [layer] if reps == 1 else list(layer.blocks)
            for u, block in enumerate(blocks):
                bias = block.ffn.gate.bias
                if bias is None:
                    continue
                if reps == 1:
                    bias[...] = update_router_bias(bias[...], expert_load_le[start], rate)
                else:
                    rows = expert_load_le[start + u: start + unit * reps: unit]
                    bias[...] = jax.vmap(update_router_bias, in_axes=(0, 0, None))(bias[...], rows, rate)


def abstract(spec: ModelSpec) -> Transformer:
    """The decoder of `spec` from `nnx.eval_shape`: every variable a ShapeDtypeStruct, nothing allocated.

    Traced once per spec (and x64 mode) in a process: a command asks for the same model's shapes
    several times (checks, restore targets, the HF names), and a full-size model takes seconds to
    trace. Each call returns a new object, so a caller may fill its variables.
    """
    return nnx.merge(*_abstract_parts(spec, jax.config.jax_enable_x64), copy=True)


@functools.lru_cache(maxsize=8)
def _abstract_parts(spec: ModelSpec, x64: bool):
    return nnx.split(nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(spec.init_seed))))


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """{"total", "active"} parameter counts of `spec`'s decoder, computed abstractly.

    total is `core.model.params.count_parameters`'s "parameters" (the official checkpoint's tensor
    inventory, MTP excluded: every nnx.Param plus the router selection biases; the hash tables
    are not parameters). active = total - the embedding - the routed experts a token does not
    choose ((E - k) / E of every expert weight).
    """
    from core.tree import shapes
    from core.model.params import count_parameters

    model = abstract(dataclasses.replace(spec, scan_layers=True, frozen_weights="param_dtype"))
    total = count_parameters(shapes(nnx.to_pure_dict(nnx.state(model))))["parameters"]
    unchosen = 0
    e, k = spec.num_experts, spec.experts_per_token
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and "experts" in (var.get_metadata().get("out_sharding") or ()):
            unchosen += math.prod(var.shape) // e * (e - k)
    embed = spec.vocab_size * spec.emb
    return {"total": total, "active": total - embed - unchosen}
