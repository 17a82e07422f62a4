"""The quantized GEMV kernel family: small M, each warp computes a few output rows.

One template covers every fusion: several weights sharing one input (one output each), the
SiLU-gate prologue, the residual epilogue, and gate/up paired in one warp with silu(g) * u as
the epilogue; the weight format enters only as its fragment (fragments/__init__.py).

Each warp owns SLOTS (row, weight) slots: four rows of one weight, or two rows of both gate and
up when paired. Lanes stride over K in chunks; every chunk's loads for all slots are issued
before any is decoded, so a warp keeps SLOTS 16-byte weight loads in flight, and one activation
load (and its permutation into the fragment's pair order) serves all slots. How a chunk becomes
products depends on the fragment and the activation dtype (`path`):

- "packed": 16-bit activations and a packed fragment. Codes are decoded into T pairs, multiplied
  with activation pairs and summed in T pairs over a run (a group, or up to 16 pairs); the run's
  sum joins the float accumulator once, times the group's scale (plus bias * sum(x) for MLX).
  At M = 1 a run spans its whole group; with more rows of x the run closes after every step so
  that only one pair accumulator per (slot, row) is live.
- "float": float32 activations (tolerance 1e-5) or an unpacked fragment (dense weights, GPTQ
  act-order): weights decoded to float, float FMAs.
- "a4": W4A4. The input is NVFP4 codes (from quantize_act, or silu(g) * u quantized here); the
  E2M1 x E2M1 products and their block sums are exact (integers with DP4A, or f16 pairs on a
  target with the FP4 conversion: see qgemv.cu.j2), the two block factors scale the block sum
  in float.
- "int": a table format's codes (IQ4_NL, IQ4_XS) at M = 1 with f16 activations. The block
  stages its row of x as integers, per run of codes a power of two times a 14-bit integer in
  two signed bytes; DP4A sums each run's products with the codes' table bytes exactly, and the
  run's sum joins the float accumulator times the scale and the power of two (int_act_fits; a
  launch of its own, M = 1 only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from qir.codegen.fragments import Fragment, fragment_for
from qir.codegen.kernel import Kernel, KernelParam
from qir.codegen.render import common_header, render
from qir.dtypes import F16, F32, DType
from qir.target import Target
from qir.types import QWeight, WeightFormat

WARPS_PER_BLOCK = 4
# (row, weight) slots per warp: four 16-byte loads in flight per lane for 4-bit codes, and the
# activations' load and permutation shared four ways. Grids stay above one block per SM at
# Llama-3-8B shapes (the k/v projections alone excepted, which launch with q).
SLOTS = 4
# Resident blocks per SM the register allocation must allow: 3 blocks of 128 threads leave each
# thread up to 168 registers. At 4 (128 registers) the eight-rows-of-x path of some formats
# spilled 16-56 B on sm_80/sm_100a/sm_120a (AWQ, MLX 6-bit) once a run's pair sums are kept per
# row of x. Fewer resident warps means fewer bytes in flight: `qir compile --resources` shows
# how many per kernel.
MIN_BLOCKS_PER_SM = 3
# Epilogue -> its kernel-name suffix.
# "gated": the up part of a pair of two formats (parts), y holding the gate part's g.
EPILOGUES = {
    "": "",
    "residual": "_res",
    "silu_mul": "_silumul",
    "softcap": "_softcap",
    "gated": "_gated",
}
# A gate's activation (a qlinear's `act`) -> its device function (qir_common.cuh).
GATE_ACTS = {"silu": "qir_silu", "gelu_tanh": "qir_gelu_tanh"}


def cap_suffix(cap: float | None) -> str:
    """The softcap epilogue's cap as a kernel name spells it (30.0: c30, 2.5: c2p5)."""
    return "" if cap is None else "_c" + f"{cap:g}".replace(".", "p").replace("+", "")


def c_cap(cap: float | None) -> str:
    """The cap as a C float literal (templates that have no softcap get 1.0f, unused)."""
    return f"{float(cap if cap is not None else 1.0)!r}f"


def gate_spelled(fused: str, gate_act: str) -> str:
    """A kernel name's fusion suffix with the gate's activation spelled where it is not silu."""
    if gate_act == "silu":
        return fused
    return fused.replace("_silumul", "_gelumul").replace("_silu", "_gelu")


A4_MODES = ("dynamic", "mul", "div")
# The passes' order in qgemv.cu.j2's enum.
PATHS = ("packed", "float", "a4", "int")
# Chunk pairs a lane takes per row at most before its row gets more lanes (lanes_per_row).
LANE_PASSES = 3


def lanes_per_row(chunks: int) -> int:
    """Lanes that share one row of `chunks` chunks (a power of two, at most a warp): the fewest
    that take its chunk pairs in LANE_PASSES passes or fewer. A warp of 32 / lanes groups computes
    that many rows per slot: a short row (an MoE expert's K = 768: 12 pairs) would otherwise leave
    most lanes idle, and the warp's set-up, reduction and store serve more rows."""
    pairs = -(-chunks // 2)
    lanes = 1
    while lanes < 32 and -(-pairs // lanes) > LANE_PASSES:
        lanes *= 2
    return lanes


def lanes_suffix(lanes: int) -> str:
    """The kernel-name part of a sub-warp row (nothing for a whole warp's), after the m-tile."""
    return "" if lanes == 32 else f"_l{lanes}"


def lanes_of(kernel_name: str) -> int:
    """The lanes per row a GEMV kernel's name spells (lanes_suffix)."""
    m = re.search(r"_m\d+_l(\d+)(?:_|$)", kernel_name)
    return int(m.group(1)) if m else 32


def rows_per_warp(frag: Fragment, weights_per_warp: int, act: DType, crowded: bool = False) -> int:
    """Rows of each of its `weights_per_warp` weights one warp computes (a gate/up pair: 2). A
    fragment that gathers per weight (GPTQ act-order) keeps one slot: four slots' gathers
    spill; so do four slots of f32 activations (eight rows of x, each a float per weight), and
    four of 2-bit codes at eight rows of x (16 codes a step: two slots). A fragment may ask for
    fewer where the kernel holds more (`crowded_slots` in its context): a `part` of a launch
    of several formats, an expert kernel (its routing; GemvSpec.crowded)."""
    if frag.context.get("gathers") or act == F32:
        slots = 1
    else:
        slots = SLOTS // 2 if int(frag.context.get("step", 8)) > 8 else SLOTS
    if crowded:
        # A fragment that spills where a kernel holds other code beside its four rows keeps to
        # fewer (ggml Q6_K).
        slots = min(slots, int(frag.context.get("crowded_slots", slots)))
    return max(1, slots // weights_per_warp)


@dataclass(frozen=True)
class GemvSpec:
    weights: tuple[QWeight, ...]  # one format and one in_features
    act: DType
    m_tile: int
    prologue: bool = False  # input = silu(g) * u
    # "residual": y = r + x W^T; "silu_mul": two weights (gate, up), each warp computes rows of
    # both and stores silu(x Wg^T) * (x Wu^T).
    epilogue: str = ""
    # W4A4: the input is NVFP4 codes + factors from quantize_act, or (with the prologue)
    # silu(g) * u quantized in registers with a per-row ("dynamic") or calibrated scale.
    a4: bool = False
    a4_mode: str = "dynamic"  # dynamic | mul | div (prologue only)
    # input = rms_norm(x, nw): the norm weight's dtype and eps (16-bit or f32 activations).
    norm: tuple[DType, float] | None = None
    # The target the code is specialised for (its name says so): E2M1 weights on a target with
    # the FP4 conversion (for_target). None: the same code for every target.
    target: Target | None = None
    # The gate's activation where the prologue or the silu_mul epilogue applies one (a key of
    # GATE_ACTS): silu, or Gemma's gelu_tanh (the name says "gelu" where it says "silu").
    gate_act: str = "silu"
    cap: float | None = None  # the softcap epilogue's: y = tanh(x W^T / cap) * cap
    # With `norm`: the normed row is h = res + rms_norm(x, pw) (norm_residual; pw's dtype, its
    # eps, and whether the kernel also stores h: output h, after the y's).
    res_norm: tuple[DType, float, bool] | None = None
    # Lanes per row at least (a power of two): an expert kernel's shared memory per block row.
    min_lanes: int = 1
    # One format's part of a launch of several (parts): the kernel holds the others' code too.
    part: bool = False
    # The kernel holds more code than its rows' (an expert kernel's routing): the fragment's
    # crowded_slots apply, as in a part.
    crowded: bool = False
    # A table format's row of x quantized to integers per run, products by DP4A ("int" path,
    # int_act_fits): one row of x a tile, for M = 1 (lower.py launches it there only).
    int_act: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.m_tile <= 32 // SLOTS:
            # A warp's lanes store its outputs, one each: SLOTS rows x m_tile rows of x.
            raise ValueError(f"m_tile must be 1..{32 // SLOTS}, got {self.m_tile}")
        if len({w.in_features for w in self.weights}) != 1:
            raise ValueError(f"one GEMV launch needs one in_features, got {self.weights}")
        if self.mixed and self.a4:
            raise ValueError("weights of several formats share a launch with 16-bit activations")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {self.epilogue!r}; known: {EPILOGUES}")
        if self.epilogue == "residual" and len(self.weights) != 1:
            raise ValueError("the residual epilogue takes exactly one weight")
        if self.epilogue == "silu_mul" and (
            len(self.weights) != 2
            or _shape(self.weights[0])[1:] != _shape(self.weights[1])[1:]
            or self.prologue
        ):
            raise ValueError("the silu_mul epilogue takes two weights of one shape, no prologue")
        if self.epilogue == "gated" and not (self.part and len(self.weights) == 1):
            raise ValueError("the gated epilogue is the up part of a pair of two formats")
        if self.a4 and self.weights[0].format.act_quant_scheme() != "nvfp4":
            raise ValueError(f"W4A4 needs NVFP4 weights, got {self.weights[0].format.spell()}")
        if self.a4_mode not in A4_MODES:
            raise ValueError(f"unknown a4_mode {self.a4_mode!r}; known: {A4_MODES}")
        if self.norm is not None and (self.prologue or self.a4):
            raise ValueError("the rms_norm prologue takes 16-bit activations and no other prologue")
        if self.res_norm is not None and self.norm is None:
            raise ValueError("the norm_residual prologue is an rms_norm prologue's input")
        if (self.epilogue == "softcap") != (self.cap is not None) or (
            self.epilogue == "softcap" and len(self.weights) != 1
        ):
            raise ValueError("the softcap epilogue takes one weight and a cap (and only it does)")
        if self.gate_act not in GATE_ACTS:
            raise ValueError(f"unknown gate activation {self.gate_act!r}; known: {GATE_ACTS}")
        if self.gate_act != "silu" and not (
            self.prologue or self.epilogue in ("silu_mul", "gated")
        ):
            raise ValueError(f"gate activation {self.gate_act}: needs a gate to apply it to")
        if self.int_act and not int_act_fits(self):
            raise ValueError(
                "the int path takes one table format's weights, f16 activations, m_tile 1"
            )
        if self.target is not None and not (
            self.target.fp4_cvt and any(f.e2m1 for f in self.fragments)
        ):
            raise ValueError(
                f"{self.target.arch} changes no code of {self.weights[0].format.spell()}"
            )

    @property
    def mixed(self) -> bool:
        """Weights of several formats: each format's weights a part of the launch (parts)."""
        return len({w.format for w in self.weights}) > 1

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        return tuple(
            fragment_for(w.format, w.out_features, w.in_features)
            for w in {w.format: w for w in self.weights}.values()
        )

    @property
    def parts(self) -> tuple[tuple[tuple[int, ...], GemvSpec], ...]:
        """The launch by format, in the order the formats first appear: the weights' indices
        and the one-format GEMV of them (a kernel of its own's blocks, at the target where it
        changes the format's code). A pair of two formats: the gate's GEMV storing g in y0,
        then the up's (epilogue "gated") over the same rows, reading g back."""
        groups: dict[WeightFormat, list[int]] = {}
        for j, w in enumerate(self.weights):
            groups.setdefault(w.format, []).append(j)
        out = []
        for i, (fmt, js) in enumerate(groups.items()):
            w = self.weights[js[0]]
            target = self.target and for_target(self.target, fmt, w.out_features, w.in_features)
            epilogue, gate_act, res_norm = self.epilogue, self.gate_act, self.res_norm
            if self.paired:
                # the gate's part stores g and any h (norm_residual); the up's applies the pair
                epilogue, gate_act = ("gated", gate_act) if i else ("", "silu")
                if res_norm is not None:
                    res_norm = (res_norm[0], res_norm[1], res_norm[2] and i == 0)
            sub = replace(
                self,
                weights=tuple(self.weights[j] for j in js),
                target=target,
                part=True,
                epilogue=epilogue,
                gate_act=gate_act,
                res_norm=res_norm,
            )
            out.append((tuple(js), sub))
        return tuple(out)

    @property
    def pair_rows(self) -> int:
        """A block's rows of a pair of two formats: the most either part's block computes (the
        other's runs as several of its blocks in a row)."""
        return max(WARPS_PER_BLOCK * p.warp_rows for _, p in self.parts)

    @property
    def name(self) -> str:
        w0 = self.weights[0]
        outs = segments(self.weights)
        if self.mixed:
            # each part's format (its lanes per row follow from the format and K)
            tags = "_".join(p.weights[0].format.tag() for _, p in self.parts)
            fused = ("_silu" if self.prologue else "") + norm_suffix(self.norm, self.res_norm)
            fused += EPILOGUES[self.epilogue] + cap_suffix(self.cap) + target_suffix(self.target)
            return (
                f"qgemv_{tags}_{self.act.name}_n{outs}_k{w0.in_features}_m{self.m_tile}"
                f"{gate_spelled(fused, self.gate_act)}"
            )
        fused = ("_silu" if self.prologue else "") + norm_suffix(self.norm, self.res_norm)
        fused += EPILOGUES[self.epilogue] + cap_suffix(self.cap)
        if self.a4:
            fused += "_a4" + (self.a4_mode if self.prologue else "")
        if self.int_act:
            fused += "_xi16"
        fused += target_suffix(self.target)
        fused = gate_spelled(fused, self.gate_act)
        lanes = lanes_suffix(self.lanes)
        return (
            f"qgemv_{w0.format.tag()}_{self.act.name}_n{outs}_k{w0.in_features}_m{self.m_tile}"
            f"{lanes}{fused}"
        )

    @property
    def paired(self) -> bool:
        """Each warp computes rows of every weight (one launch's blocks serve them all)."""
        return self.epilogue == "silu_mul"

    @property
    def fragment(self) -> Fragment:
        w0 = self.weights[0]
        return fragment_for(w0.format, w0.out_features, w0.in_features)

    @property
    def rows_per_warp(self) -> int:
        """Rows of each weight one group of `lanes` lanes computes (its slots)."""
        weights = len(self.weights) if self.paired else 1
        return rows_per_warp(self.fragment, weights, self.act, self.part or self.crowded)

    @property
    def lanes(self) -> int:
        w0 = self.weights[0]
        return max(self.min_lanes, lanes_per_row(self.fragment.chunks_per_row(w0.in_features)))

    @property
    def warp_rows(self) -> int:
        """Rows of each weight one warp computes: its groups' together."""
        return self.rows_per_warp * 32 // self.lanes

    def blocks(self, w: QWeight) -> int:
        return -(-w.out_features // (WARPS_PER_BLOCK * self.warp_rows))

    @property
    def grid_x(self) -> int:
        if self.mixed and self.paired:
            return -(-self.weights[0].out_features // self.pair_rows)
        if self.mixed:
            return sum(p.grid_x for _, p in self.parts)
        if self.paired:
            return self.blocks(self.weights[0])
        return sum(self.blocks(w) for w in self.weights)

    def path(self, frag: Fragment) -> str:
        if self.a4:
            return "a4"
        if self.int_act:
            return "int"
        return "packed" if frag.packed and self.act != F32 else "float"


def int_act_fits(spec: GemvSpec) -> bool:
    """Whether the int path serves the spec's weights and input: one table format (its codes
    bytes by lookup: IQ4_NL, IQ4_XS) and f16 activations (the quantization rounds in f16),
    neither W4A4 nor a part of a launch of several formats, one row of x a tile."""
    return (
        not spec.mixed
        and not spec.a4
        and not spec.part
        and spec.act == F16
        and spec.m_tile == 1
        and bool(spec.fragment.context.get("table"))
    )


def for_target(
    target: Target, fmt: WeightFormat, out_features: int, in_features: int
) -> Target | None:
    """The target a kernel of this weight is specialised for: `target` where its FP4 conversion
    changes the weight's decode (E2M1 codes), else None (one kernel serves every target)."""
    return target if target.fp4_cvt and fragment_for(fmt, out_features, in_features).e2m1 else None


def target_suffix(target: Target | None) -> str:
    return f"_{target.tag}" if target else ""


def _shape(w: QWeight) -> tuple[object, int, int]:
    return w.format, w.out_features, w.in_features


def segments(weights: tuple[QWeight, ...]) -> str:
    """The kernel-name part spelling each weight's rows, "b" after a biased one: n256b_64b_64b."""
    return "_".join(f"{w.out_features}{'b' if w.bias else ''}" for w in weights)


def weight_params(weights: tuple[QWeight, ...]) -> list[KernelParam]:
    """Each weight's buffers (its fragment's) as kernel parameters w<j>_<buffer>, its bias
    (float) last."""
    return [
        p
        for j, w in enumerate(weights)
        for p in (
            *(
                KernelParam(f"w{j}_{q.name.removeprefix('w_')}", q.c_type, "buffer")
                for q in fragment_for(w.format, w.out_features, w.in_features).params
            ),
            *(
                (KernelParam(f"w{j}_bias", "const float* __restrict__", "buffer"),)
                if w.bias
                else ()
            ),
        )
    ]


def bias_of(weights: tuple[QWeight, ...], j: int) -> str:
    """Weight j's bias pointer in C++ (nullptr without one)."""
    return f"w{j}_bias" if weights[j].bias else "nullptr"


def _params(spec: GemvSpec) -> list[KernelParam]:
    act_in = f"const {spec.act.c_type}* __restrict__"
    inputs: tuple[KernelParam, ...]
    if spec.prologue:
        inputs = (KernelParam("g", act_in, "buffer"), KernelParam("u", act_in, "buffer"))
    elif spec.norm:
        inputs = norm_params(act_in, spec.norm, spec.res_norm)
    elif spec.a4:
        inputs = (KernelParam("xq", "const uint8_t* __restrict__", "buffer"),)
    else:
        inputs = (KernelParam("x", act_in, "buffer"),)
    scale = spec.a4 and spec.prologue and spec.a4_mode != "dynamic"
    return [
        *inputs,
        *weight_params(spec.weights),
        *(
            KernelParam(f"y{j}", f"{spec.act.c_type}* __restrict__", "buffer")
            for j in range(1 if spec.paired else len(spec.weights))
        ),
        *h_param(spec.act, spec.res_norm),
        *((KernelParam("r", act_in, "buffer"),) if spec.epilogue == "residual" else ()),
        *((KernelParam("act_scale", "const float* __restrict__", "buffer"),) if scale else ()),
        KernelParam("M", "int", "int"),
    ]


def _select(
    spec: GemvSpec, frag: Fragment, index: tuple[int, ...] = (), block: int = 0, y: str = ""
) -> list[str]:
    """C++ statements choosing this block's weight(s), output and row count: a launch of several
    weights gives each a range of blocks; a paired launch reads both weights in every block. A
    part of a mixed launch (GemvSpec.parts) names its weights by their indices in the launch,
    `index`, its blocks start at `block` (its `block` argument counts them), and `y` names its
    output where that is not its weight's (a pair's parts both write y0)."""
    ws = spec.weights
    index = index or tuple(range(len(ws)))
    if spec.paired:
        w0, w1 = (frag.weight_init(f"w{j}_") for j in range(2))
        return [
            f"const qir_weight weights[QIR_WEIGHTS] = {{{w0}, {w1}}};",
            f"const float* biases[QIR_WEIGHTS] = {{{bias_of(ws, 0)}, {bias_of(ws, 1)}}};",
            f"const int n_rows = {spec.weights[0].out_features}, block0 = 0;",
            "act_t* __restrict__ y = y0;",
        ]
    ends, start = [], block
    for w in spec.weights:
        start += spec.blocks(w)
        ends.append(start)

    at = "block" if spec.part else "blockIdx.x"

    def pick(values: list[str]) -> str:
        # block < end_0 ? v_0 : block < end_1 ? v_1 : ... v_last
        expr = values[-1]
        for end, v in reversed(list(zip(ends[:-1], values[:-1], strict=True))):
            expr = f"{at} < {end} ? {v} : {expr}"
        return expr

    biased = {j: w for j, w in zip(index, ws, strict=True) if w.bias}
    return [
        "const qir_weight weights[QIR_WEIGHTS] = {"
        + pick([frag.weight_init(f"w{j}_") for j in index])
        + "};",
        "const float* biases[QIR_WEIGHTS] = {"
        + pick([f"(const float*){f'w{j}_bias' if j in biased else 'nullptr'}" for j in index])
        + "};",
        f"const int n_rows = {pick([str(w.out_features) for w in spec.weights])};",
        f"const int block0 = {pick([str(block), *map(str, ends[:-1])])};",
        f"act_t* __restrict__ y = {y or pick([f'y{j}' for j in index])};",
    ]


def _header(spec: GemvSpec) -> list[str]:
    """The comment at the top of the kernel: what it computes."""
    w0, k, fmt = spec.weights[0], spec.weights[0].in_features, spec.weights[0].format.spell()
    x = f"{spec.gate_act}(g[m, k]) * u[m, k]" if spec.prologue else "x[m, k]"
    if spec.norm:
        x = norm_doc(spec.norm, spec.res_norm) + "[m, k]"
    if spec.a4:
        x = f"nvfp4({x})"
    b = [f" + b{j}[n]" if w.bias else "" for j, w in enumerate(spec.weights)]
    if spec.paired:
        return [
            f"y0[m, n] = {spec.gate_act}(g) * u with g = sum_k {x} * W0[n, k]{b[0]}, "
            f"u = sum_k {x} * W1[n, k]{b[1]};",
            f"W0, W1 are [{w0.out_features}, {k}] in "
            + " and ".join(dict.fromkeys(w.format.spell() for w in spec.weights)),
        ]
    if spec.cap is not None:
        return [
            f"y0[m, n] = tanh(sum_k {x} * W0[n, k]{b[0]} / {spec.cap:g}) * {spec.cap:g}; W0 is "
            f"[{w0.out_features}, {k}] in {fmt}"
        ]
    res = "r[m, n] + " if spec.epilogue == "residual" else ""
    return [
        f"y{j}[m, n] = {res}(sum_k {x} * W{j}[n, k]{b[j]}); W{j} is [{w.out_features}, {k}] in "
        f"{fmt}"
        if b[j]
        else f"y{j}[m, n] = {res}sum_k {x} * W{j}[n, k]; W{j} is [{w.out_features}, {k}] in {fmt}"
        for j, w in enumerate(spec.weights)
    ]


def gemv_kernel(spec: GemvSpec) -> Kernel:
    params = _params(spec)
    signature = [f"{p.c_type} {p.name}" for p in params]
    if not spec.mixed:
        source = _render(spec, spec.name, signature, _select(spec, spec.fragment))
    else:
        # Each format's weights are a part: the one-format kernel's code in a namespace of its
        # own, entered by the blocks of its range.
        # A pair's parts both compute the block's rows (of y0), each as `blocks` of its own.
        parts, block = [], 0
        for i, (index, part) in enumerate(spec.parts):
            select = _select(part, part.fragment, index, block, "y0" if spec.paired else "")
            if not spec.paired:
                block += part.grid_x
            body = _render(part, spec.name, signature, select, part=f"qir_part{i}")
            blocks = spec.pair_rows // (WARPS_PER_BLOCK * part.warp_rows) if spec.paired else 1
            parts.append(
                {"namespace": f"qir_part{i}", "end": block, "source": body, "blocks": blocks}
            )
        source = render(
            "qgemv_mixed.cu.j2",
            name=spec.name,
            header=_header(spec),
            parts=parts,
            signature=signature,
            args=", ".join(p.name for p in params),
            paired=spec.paired,
            threads=32 * WARPS_PER_BLOCK,
            min_blocks=MIN_BLOCKS_PER_SM,
            target=spec.target.arch if spec.target else "",
            fp4_cvt=bool(spec.target and spec.target.fp4_cvt),
        )
    return Kernel(
        spec.name, source, tuple(params), (32 * WARPS_PER_BLOCK, 1, 1), (common_header(),)
    )


def _render(
    spec: GemvSpec, name: str, signature: list[str], select: list[str], part: str = ""
) -> str:
    """qgemv.cu.j2 for a one-format spec: the kernel, or (`part`) its code as a part of a mixed
    launch (no includes, the kernel a device function `qir_part`)."""
    w0 = spec.weights[0]
    frag = spec.fragment
    return render(
        "qgemv.cu.j2",
        name=name,
        part=part,
        header=_header(spec),
        fragment_template=frag.template,
        signature=signature,
        select=select,
        act_t=spec.act.c_type,
        K=w0.in_features,
        m_tile=spec.m_tile,
        weights_per_warp=len(spec.weights) if spec.paired else 1,
        rows_per_warp=spec.rows_per_warp,
        lanes=spec.lanes,
        shift_back=all(w.out_features >= spec.rows_per_warp for w in spec.weights),
        warps=WARPS_PER_BLOCK,
        threads=32 * WARPS_PER_BLOCK,
        min_blocks=MIN_BLOCKS_PER_SM,
        chunks_per_row=frag.chunks_per_row(w0.in_features),
        path=PATHS.index(spec.path(frag)),
        int_path=spec.int_act,
        epilogue=tuple(EPILOGUES).index(spec.epilogue),
        gate_fn=GATE_ACTS[spec.gate_act],
        cap=c_cap(spec.cap),
        has_bias=any(w.bias for w in spec.weights),
        source=_act_source(spec),
        stage_f32=_stages_f32(spec, frag),
        target=spec.target.arch if spec.target else "",
        fp4_cvt=bool(spec.target and spec.target.fp4_cvt),
        **frag.context,
    )


# Shared memory a float-path decode may give its staged row (K floats).
STAGE_F32_BYTES = 32 * 1024


def _stages_f32(spec: GemvSpec, frag: Fragment) -> int:
    """How many rows of x a float-path launch computes once per block into shared memory
    (rms_norm'd, silu(g) * u) instead of in every warp, for every chunk and slot: its whole
    m-tile where that fits, else the M = 1 row where that does, else none."""
    if spec.path(frag) != "float" or not (spec.prologue or spec.norm is not None):
        return 0
    row = 4 * spec.weights[0].in_features
    return spec.m_tile if spec.m_tile * row <= STAGE_F32_BYTES else int(row <= STAGE_F32_BYTES)


def _act_source(spec: GemvSpec) -> str:
    """The C++ object the kernel reads its activations through (qgemv.cu.j2 defines them)."""
    if spec.a4 and spec.prologue:
        mode = A4_MODES.index(spec.a4_mode)
        scale = "0.0f" if spec.a4_mode == "dynamic" else "*act_scale"
        return f"qir_act_silu_a4<{mode}>{{g + row_off, u + row_off, {scale}}}"
    if spec.a4:
        return "qir_act_a4{xq + (size_t)m0 * QIR_A4_ROW_BYTES}"
    if spec.prologue:
        return "qir_act_silu{g + row_off, u + row_off}"
    if spec.norm and spec.res_norm:
        (pw, res_eps, stores), (nw, eps) = spec.res_norm, spec.norm
        h = "h + row_off" if stores else "nullptr"
        return (
            f"qir_act_res_norm<{pw.c_type}, {nw.c_type}>{{x + row_off, pw, res + row_off, nw, "
            f"{h}, {res_eps!r}, {eps!r}}}"
        )
    if spec.norm:
        return f"qir_act_norm<{spec.norm[0].c_type}>{{x + row_off, nw, {spec.norm[1]!r}}}"
    return "qir_act_x{x + row_off}"


def norm_suffix(
    norm: tuple[DType, float] | None, res_norm: tuple[DType, float, bool] | None = None
) -> str:
    """The kernel-name part of an rms_norm prologue (the weight's dtype, as quantize_act's),
    after its norm_residual input's (_resnorm_w<dtype>, _resnormh_ where it stores h)."""
    res = f"_resnorm{'h' if res_norm[2] else ''}_w{res_norm[0].name}" if res_norm else ""
    return res + (f"_rmsnorm_w{norm[0].name}" if norm else "")


def norm_doc(norm: tuple[DType, float], res_norm: tuple[DType, float, bool] | None) -> str:
    """The normed input, as the kernel's comment spells it."""
    x = f"(res + rms_norm(x, pw) (eps {res_norm[1]}))" if res_norm else "x"
    return f"rms_norm({x}, nw) (eps {norm[1]})"


def norm_params(
    act_in: str, norm: tuple[DType, float], res_norm: tuple[DType, float, bool] | None
) -> tuple[KernelParam, ...]:
    """An rms_norm prologue's inputs: x and its weight, or x, pw, res and the weight."""
    if res_norm is None:
        return (KernelParam("x", act_in, "buffer"), norm_param(norm))
    pw = KernelParam("pw", f"const {res_norm[0].c_type}* __restrict__", "buffer")
    res = KernelParam("res", act_in, "buffer")
    return (KernelParam("x", act_in, "buffer"), pw, res, norm_param(norm))


def h_param(act: DType, res_norm: tuple[DType, float, bool] | None) -> tuple[KernelParam, ...]:
    """The norm_residual prologue's h, stored after the projections (where it is read)."""
    stores = res_norm is not None and res_norm[2]
    return (KernelParam("h", f"{act.c_type}* __restrict__", "buffer"),) if stores else ()


def norm_param(norm: tuple[DType, float]) -> KernelParam:
    """The norm weight an rms_norm prologue reads, after x."""
    return KernelParam("nw", f"const {norm[0].c_type}* __restrict__", "buffer")
