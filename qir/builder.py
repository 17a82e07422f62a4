"""Building graphs in code. Every call type-checks at once, so a shape or dtype mismatch is
reported at the call that caused it, naming both operands."""

from __future__ import annotations

from dataclasses import dataclass

from qir.dtypes import DType
from qir.graph import AttrValue, Graph, Node, check_name, make_attrs
from qir.ops import IRTypeError, cache_problem, input_problem, param_problem, spec
from qir.types import Dim, QExperts, QWeight, TensorType, TupleType, ValueType


@dataclass(frozen=True)
class Value:
    name: str
    type: ValueType

    def __str__(self) -> str:
        return f"%{self.name}"


def _paging(pages: Value | None, page_size: int | None) -> dict[str, AttrValue]:
    if pages is None:
        return {}
    if page_size is None:
        raise IRTypeError("a block table needs its page_size")
    return {"page_size": page_size}


class Builder:
    def __init__(self, name: str = "main") -> None:
        check_name(name, "graph")
        self.graph = Graph(name)

    def _fresh(self, name: str | None, op: str) -> str:
        if name is not None:
            if name in self.graph:
                raise ValueError(f"value name %{name} is already used in graph {self.graph.name}")
            return name
        i = len(self.graph)
        while f"{op}{i}" in self.graph:
            i += 1
        return f"{op}{i}"

    def _op(
        self, op: str, operands: tuple[Value, ...], name: str | None, **attrs: AttrValue
    ) -> Value:
        types = [o.type for o in operands]
        names = [o.name for o in operands]
        for o in operands:
            if o.name not in self.graph or self.graph.node(o.name).type != o.type:
                raise ValueError(f"{o} does not belong to graph {self.graph.name}")
        result = spec(op).infer(types, names, attrs)
        node = Node(op, result, make_attrs(**attrs))
        n = self.graph.add(self._fresh(name, op), node, tuple(names))
        return Value(n, result)

    def op(self, op: str, *operands: Value, name: str | None = None, **attrs: AttrValue) -> Value:
        """A node of any registered op (qir.ops.register): the ops without a method of their own."""
        return self._op(op, operands, name, **attrs)

    def input(self, name: str, shape: tuple[Dim, ...], dtype: DType) -> Value:
        """A block input: an activation ("M", features), or i32 ("M",) token ids or positions;
        M is bound by each run."""
        t = TensorType(tuple(shape), dtype)
        problem = input_problem(t)
        if problem:
            raise IRTypeError(f"input %{name}: {t} {problem}")
        return Value(self.graph.add(self._fresh(name, "x"), Node("input", t)), t)

    def param(self, key: str, t: TensorType, name: str | None = None) -> Value:
        """An unquantized parameter vector (a norm's weight): weights[key]["weight"]."""
        problem = param_problem(t)
        if problem:
            raise IRTypeError(f"parameter {key!r}: {t} {problem}")
        node = Node("weight", t, make_attrs(key=key))
        return Value(self.graph.add(self._fresh(name, "p"), node), t)

    def state(self, key: str, t: TensorType, name: str | None = None) -> Value:
        """A KV cache [capacity, kv_heads, head_dim]: state a compiled block keeps across runs
        (a run starts from what the previous one left), written by one kv_append."""
        problem = cache_problem(t)
        if problem:
            raise IRTypeError(f"state {key!r}: {t} {problem}")
        node = Node("state", t, make_attrs(key=key))
        return Value(self.graph.add(self._fresh(name, "s"), node), t)

    def weight(
        self,
        key: str,
        weight: QWeight | QExperts,
        name: str | None = None,
        act_rule: dict[str, float] | None = None,
    ) -> Value:
        """`act_rule`: the calibrated activation scale of a W4A4 weight
        (WeightFormat.act_quant_rule), kept on the node for W4A4 routing. A QExperts weight is
        a stack of experts (their buffers with a leading expert dim)."""
        if isinstance(weight, QExperts) and weight.count < 1:
            raise IRTypeError(f"weight {key!r}: {weight} needs at least one expert")
        weight.format.check_shape(weight.out_features, weight.in_features)
        rule = {k: float(v) for k, v in (act_rule or {}).items()}
        node = Node("weight", weight, make_attrs(key=key, **rule))
        return Value(self.graph.add(self._fresh(name, "w"), node), weight)

    def qlinear(self, x: Value, w: Value, name: str | None = None) -> Value:
        return self._op("qlinear", (x, w), name)

    def silu(self, x: Value, name: str | None = None) -> Value:
        return self._op("silu", (x,), name)

    def mul(self, a: Value, b: Value, name: str | None = None) -> Value:
        return self._op("mul", (a, b), name)

    def add(self, a: Value, b: Value, name: str | None = None) -> Value:
        return self._op("add", (a, b), name)

    def rms_norm(self, x: Value, w: Value, eps: float, name: str | None = None) -> Value:
        """x / sqrt(mean(x^2) + eps) * w per row, in float32, rounded once to x's dtype."""
        return self._op("rms_norm", (x, w), name, eps=float(eps))

    def rope(
        self, x: Value, positions: Value, rope: dict[str, AttrValue], name: str | None = None
    ) -> Value:
        """x rotated per head by its row's position; `rope` holds head_dim, theta, rope_type and
        the type's scaling parameters (qir.rope)."""
        return self._op("rope", (x, positions), name, **rope)

    def kv_append(
        self,
        k_cache: Value,
        v_cache: Value,
        k: Value,
        v: Value,
        positions: Value,
        name: str | None = None,
        pages: Value | None = None,
        page_size: int | None = None,
        window: int | None = None,
    ) -> tuple[Value, Value]:
        """Writes row m of k and v at positions[m] of the caches; returns the written caches,
        which attention must read (not the states themselves). With a block table `pages`
        (i32[M, pages]) the caches are pools of pages of `page_size` rows (qir.ops); with a
        sliding `window`, a sequence's cache is a ring (position p at p % its room)."""
        operands = (k_cache, v_cache, k, v, positions, *((pages,) if pages else ()))
        attrs = {**_paging(pages, page_size), **({"window": window} if window else {})}
        both = self._op("kv_append", operands, name, **attrs)
        assert isinstance(both.type, TupleType)
        return self.get(both, 0, f"{both.name}.k"), self.get(both, 1, f"{both.name}.v")

    def get(self, t: Value, index: int, name: str | None = None) -> Value:
        return self._op("get", (t,), name, index=index)

    def attention(
        self,
        q: Value,
        k_cache: Value,
        v_cache: Value,
        positions: Value,
        scale: float | None = None,
        name: str | None = None,
        pages: Value | None = None,
        page_size: int | None = None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Value | None = None,
    ) -> Value:
        """Causal grouped-query attention of each row over its positions 0..positions[m] (through
        the block table `pages` where given; the last `window` of them with a sliding window, of
        a ring as kv_append wrote it); `scale` defaults to 1/sqrt(head_dim); with `softcap` the
        scaled scores are soft-capped (tanh(s / softcap) * softcap) before the softmax; `sinks`
        f32[heads] join each head's softmax denominator (gpt-oss)."""
        head_dim = k_cache.type.shape[2] if isinstance(k_cache.type, TensorType) else 1
        assert isinstance(head_dim, int)
        s = float(scale) if scale is not None else float(head_dim) ** -0.5
        operands = (q, k_cache, v_cache, positions, *((pages,) if pages else ()))
        operands += (sinks,) if sinks is not None else ()
        attrs: dict[str, AttrValue] = {
            **_paging(pages, page_size),
            **({"window": window} if window else {}),
            **({"sinks": True} if sinks is not None else {}),
        }
        if softcap is not None:
            attrs["softcap"] = float(softcap)
        return self._op("attention", operands, name, scale=s, **attrs)

    def embedding(
        self,
        ids: Value,
        table: Value,
        dtype: DType,
        name: str | None = None,
        scale: float | None = None,
    ) -> Value:
        """Row ids[m] of the (dequantized) table [vocab, features], in `dtype`; with `scale` (a
        `dtype` value) the row times it, rounded again."""
        attrs = {} if scale is None else {"scale": float(scale)}
        return self._op("embedding", (ids, table), name, dtype=dtype.name, **attrs)

    def gelu_tanh(self, x: Value, name: str | None = None) -> Value:
        return self._op("gelu_tanh", (x,), name)

    def softcap(self, x: Value, cap: float, name: str | None = None) -> Value:
        """tanh(x / cap) * cap, in float32, rounded once."""
        return self._op("softcap", (x,), name, cap=float(cap))

    def all_reduce(self, x: Value, ranks: int, name: str | None = None) -> Value:
        """The sum of every rank's x (qir.collectives)."""
        return self._op("all_reduce", (x,), name, ranks=ranks)

    def all_gather(self, x: Value, axis: int, ranks: int, name: str | None = None) -> Value:
        """Every rank's x concatenated along `axis` in rank order (qir.collectives)."""
        return self._op("all_gather", (x,), name, axis=axis, ranks=ranks)

    def sample(
        self,
        logits: Value,
        params: Value,
        seed: Value,
        positions: Value,
        name: str | None = None,
    ) -> Value:
        """A token id per row of `logits`, drawn under the row's params (temperature, top_k,
        top_p, min_p) with its seed and position keying the draw (qir.sampling)."""
        return self._op("sample", (logits, params, seed, positions), name)

    def adjust_logits(
        self,
        logits: Value,
        penalties: Value,
        tokens: Value,
        counts: Value,
        bias: Value,
        allow: Value,
        name: str | None = None,
    ) -> Value:
        """float32 logits with each row's bitmask, bias and penalties applied (qir.logits)."""
        return self._op("adjust_logits", (logits, penalties, tokens, counts, bias, allow), name)

    def logprobs(
        self, logits: Value, drawn: Value, targets: Value, k: int, name: str | None = None
    ) -> tuple[Value, Value]:
        """Each row's target's log-softmax and its k most likely tokens' (qir.logits): (ids
        i32[M, k + 1], logprobs f32[M, k + 1]), the target in column 0."""
        both = self._op("logprobs", (logits, drawn, targets), name, k=k)
        return self.get(both, 0, f"{both.name}.ids"), self.get(both, 1, f"{both.name}.values")

    def route(
        self, logits: Value, k: int, rule: str, name: str | None = None
    ) -> tuple[Value, Value]:
        """Each row's `k` experts and their weights from router logits [M, E] under `rule`
        (qir.moe.RULES): (ids i32[M, k], weights f32[M, k])."""
        both = self._op("route", (logits,), name, k=k, rule=rule)
        return self.get(both, 0, f"{both.name}.ids"), self.get(both, 1, f"{both.name}.weights")

    def expert_qlinear(
        self,
        x: Value,
        experts: Value | tuple[Value, Value],
        ids: Value,
        weights: Value | None = None,
        residual: Value | None = None,
        name: str | None = None,
        act: dict[str, AttrValue] | None = None,
    ) -> Value:
        """Each row's slots through their chosen experts (qir.moe): one stacked weight gives
        [M, k, N]; (gate, up) gives act(g) * u [M, k, N] (`act`: the node's act attributes, e.g.
        {"act": "swiglu_clamp", "limit": 7.0, "alpha": 1.702}; default silu); with the router's
        `weights` the slots are combined into [M, N] (plus `residual`)."""
        ws = experts if isinstance(experts, tuple) else (experts,)
        attrs: dict[str, AttrValue] = {}
        if len(ws) == 2:
            attrs["epilogue"] = "silu_mul"
            attrs.update(act or {})
        if weights is not None:
            attrs["epilogue"] = "combine" if residual is None else "combine_residual"
        extra = tuple(v for v in (weights, residual) if v is not None)
        return self._op("expert_qlinear", (x, *ws, ids, *extra), name, **attrs)

    def output(self, name: str, value: Value) -> None:
        check_name(name, "output")
        if any(n == name for n, _ in self.graph.outputs):
            raise ValueError(f"output {name!r} is already defined")
        self.graph.outputs.append((name, value.name))
