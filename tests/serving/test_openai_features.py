"""What vLLM users switch with, through a real `qir serve` (host kernels): scores in OpenAI's and
vLLM's shapes equal to the log-softmax of `qir run --block model` logits (lm-eval's exact
request shapes: echoed id lists in batches, max_tokens 0 and 1), n and best_of, the sampling
fields each doing what it says, structured outputs by every name that parse and validate
(streamed and not) on a random-weight model, and tool calls (forced by schema, and a family's
format streamed as tool_call deltas)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qir.cli import main
from qir.models import Model
from tests.requires import import_or_skip
from tests.serving.conftest import ACT, FIXTURE, NAME, Served, serve

jsonschema = import_or_skip("jsonschema", "jsonschema")

GREEDY = {"temperature": 0}


def qir_run_logits(tokens: list[int], tmp_path: Path) -> np.ndarray:
    """float64 log-softmax of `qir run --block model` logits for `tokens` (host kernels)."""
    out = tmp_path / f"run{len(tokens)}.npz"
    ids = ",".join(map(str, tokens))
    argv = ["run", str(FIXTURE), "--block", "model", "--tokens", ids, "--backend", "host"]
    argv += ["--act-dtype", ACT.name]  # as the server computes
    assert main([*argv, "--out", str(out)]) == 0
    z = np.load(out)["logits"].astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def post(server: Served, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = server.client().post(path, body=body, cast_to=object)  # type: ignore[attr-defined]
    assert isinstance(r, dict)
    return r


def test_lm_evals_loglikelihood_requests_score_the_prompt(server: Served, tmp_path: Path) -> None:
    """local-completions' loglikelihood batch: id lists, echo, logprobs 1, max_tokens 1 (and
    OpenAI's scoring form, max_tokens 0); token_logprobs are the log-softmax of the model's
    logits at each prompt position, top_logprobs the most likely token's."""
    prompts = [[1, 40, 41, 42, 43], [1, 7, 9], [1, 200, 3, 3, 3, 3, 3]]
    body = {"model": NAME, "prompt": prompts, "echo": True, "logprobs": 1, "seed": 1234}
    for max_tokens in (1, 0):
        r = post(server, "/completions", {**body, "max_tokens": max_tokens, **GREEDY})
        choices = sorted(r["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2]
        for ids, c in zip(prompts, choices, strict=True):
            lp = qir_run_logits(ids, tmp_path)
            got = c["logprobs"]["token_logprobs"]
            assert got[0] is None and len(got) == len(ids) + max_tokens
            want = [lp[p - 1, ids[p]] for p in range(1, len(ids))]
            assert got[1 : len(ids)] == pytest.approx(want, abs=2e-5)
            for p in range(1, len(ids)):
                (value,) = c["logprobs"]["top_logprobs"][p].values()
                assert value == pytest.approx(lp[p - 1].max(), abs=2e-5)
            if max_tokens:  # the drawn id: greedy, so the most likely
                assert got[-1] == pytest.approx(lp[-1].max(), abs=2e-5)
    assert r["usage"]["completion_tokens"] == 0


def test_lm_evals_generate_until_batch(server: Served, reference: Model) -> None:
    prompts = [reference.encode(t) for t in ("Once", "The cat", "Hello there")]
    r = post(
        server,
        "/completions",
        {
            "model": NAME,
            "prompt": prompts,
            "max_tokens": 5,
            "stop": ["\n\n"],
            "seed": 1234,
            **GREEDY,
        },
    )
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    for ids, text in zip(prompts, texts, strict=True):
        reference.reset()
        assert text == reference.generate(
            reference.tokenizer.decode(ids), 5, do_sample=False, stop=["\n\n"]
        )


def test_chat_logprobs_and_prompt_logprobs(server: Served, reference: Model) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    r = post(
        server,
        "/chat/completions",
        {
            "model": NAME,
            "messages": messages,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
            "prompt_logprobs": 2,
            "ignore_eos": True,
            **GREEDY,
        },
    )
    ids = reference.tokenizer.encode(reference.chat_prompt(messages), add_special_tokens=False)
    out = reference.tokenizer.encode(
        r["choices"][0]["message"]["content"], add_special_tokens=False
    )
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 3 for t in content)
    z = reference.logits(ids).astype(np.float64)
    lp = z - z.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    first = content[0]
    assert first["logprob"] == pytest.approx(lp[-1].max(), abs=2e-5)  # greedy: the top one
    assert first["top_logprobs"][0]["logprob"] == first["logprob"]
    assert bytes(first["bytes"]).decode() == first["token"]
    prompt = r["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(ids)
    for p in range(1, len(ids)):
        entry = prompt[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(lp[p - 1, ids[p]], abs=2e-5)
        ranks = sorted(e["rank"] for k, e in prompt[p].items() if e["rank"] is not None)
        assert ranks[:2] == [1, 2]
    assert out  # the text re-encodes to ids


def test_n_best_of_and_seeds(server: Served) -> None:
    body = {
        "model": NAME,
        "prompt": "Once",
        "max_tokens": 6,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    three = post(server, "/completions", {**body, "n": 3, "seed": 2**40 + 7})
    texts = [c["text"] for c in sorted(three["choices"], key=lambda c: c["index"])]
    alone = [
        post(server, "/completions", {**body, "seed": 2**40 + 7 + i})["choices"][0]["text"]
        for i in range(3)
    ]
    assert texts == alone and len(set(texts)) > 1
    assert three["usage"]["completion_tokens"] == 18
    # best_of 4, n 2: two of the four, ranked by their ids' summed logprob.
    best = post(server, "/completions", {**body, "n": 2, "best_of": 4, "seed": 3, "logprobs": 0})
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in best["choices"]]
    four = post(server, "/completions", {**body, "n": 4, "seed": 3, "logprobs": 0})
    every = sorted((sum(c["logprobs"]["token_logprobs"]) for c in four["choices"]), reverse=True)
    assert sums == pytest.approx(every[:2], abs=1e-4)


def test_sampling_fields_do_what_they_say(server: Served, reference: Model) -> None:
    base = {"model": NAME, "prompt": "Hello", "ignore_eos": True, **GREEDY}
    free = post(server, "/completions", {**base, "max_tokens": 8})["choices"][0]["text"]
    assert len(post(server, "/completions", {**base, "n_predict": 5})["choices"][0]["text"]) > 0
    r = post(server, "/completions", {**base, "n_predict": 5})
    assert r["usage"]["completion_tokens"] == 5
    r = post(server, "/completions", {**base, "max_completion_tokens": 3, "max_tokens": 7})
    assert r["usage"]["completion_tokens"] == 3
    forced = post(server, "/completions", {**base, "max_tokens": 4, "logit_bias": {"65": 100}})
    assert forced["choices"][0]["text"] == reference.tokenizer.decode([65] * 4)
    as_ids = {"logprobs": 0, "return_tokens_as_token_ids": True}
    allowed = post(
        server, "/completions", {**base, "max_tokens": 6, "allowed_token_ids": [70, 71], **as_ids}
    )
    tokens = allowed["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= {"token_id:70", "token_id:71"}
    stop = free[2:4]
    kept = post(
        server,
        "/completions",
        {**base, "max_tokens": 8, "stop": [stop], "include_stop_str_in_output": True},
    )
    assert kept["choices"][0]["text"] == free[: free.find(stop) + len(stop)]
    ids = reference.encode("Hello")
    first = reference.generate(ids, 8, ignore_eos=True, do_sample=False).tokens.tolist()
    k = next(k for k in range(1, 8) if first[k] not in first[:k])  # its first time
    r = post(server, "/completions", {**base, "max_tokens": 8, "stop_token_ids": [first[k]]})
    assert r["usage"]["completion_tokens"] == k + 1 and r["choices"][0]["finish_reason"] == "stop"
    r = post(
        server,
        "/completions",
        {**base, "max_tokens": 8, "stop_token_ids": [first[k]], "min_tokens": 8},
    )
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"
    penalized = post(server, "/completions", {**base, "max_tokens": 8, "repetition_penalty": 1.8})
    assert penalized["choices"][0]["text"] != free


SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
]


def _complete(server: Served, body: dict[str, Any], stream: bool) -> str:
    client = server.client()
    if not stream:
        return str(post(server, "/chat/completions", body)["choices"][0]["message"]["content"])
    known = {"model", "messages", "max_tokens", "temperature", "seed", "response_format"}
    extra = {k: v for k, v in body.items() if k not in known}
    given = {k: v for k, v in body.items() if k in known}
    chunks = client.chat.completions.create(stream=True, extra_body=extra, **given)  # type: ignore[attr-defined]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_parse_and_validate(server: Served, stream: bool) -> None:
    messages = [{"role": "user", "content": "Answer"}]
    base = {"model": NAME, "messages": messages, "max_tokens": 100, "temperature": 1.0}
    names = [
        lambda schema: {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema, "strict": True},
            }
        },
        lambda schema: {"structured_outputs": {"json": schema}},
        lambda schema: {"guided_json": schema},
        lambda schema: {"json_schema": schema},
    ]
    for i, schema in enumerate(SCHEMAS):  # every schema under two of the names
        for name in (names[i % 4], names[(i + 2 + int(stream)) % 4]):
            text = _complete(server, {**base, "seed": i, **name(schema)}, stream)
            jsonschema.validate(json.loads(text), schema)
    text = _complete(
        server,
        {**base, "response_format": {"type": "json_object"}, "max_tokens": 100, "seed": 9},
        stream,
    )
    assert isinstance(json.loads(text), dict)
    for ask, check in [
        (
            {"guided_regex": r"[a-c]{2,4}-\d{2}"},
            lambda t: __import__("re").fullmatch(r"[a-c]{2,4}-\d{2}", t),
        ),
        ({"structured_outputs": {"regex": r"(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        (
            {"grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'},
            lambda t: __import__("re").fullmatch(r"\(\d(\+\d)?\)", t),
        ),
        (
            {"guided_grammar": 'root ::= ("ab" | "cd")+ "."'},
            lambda t: __import__("re").fullmatch(r"(ab|cd)+\.", t),
        ),
    ]:
        text = _complete(server, {**base, "seed": int(stream), **ask}, stream)
        assert check(text), (ask, text)
    # A grammar asked for again is the cached one: compiled once.
    before = server.engine.grammars.compiled
    for seed in (5, 6):
        _complete(server, {**base, "seed": seed, "guided_regex": f"z{int(stream)}[0-9]"}, stream)
    assert server.engine.grammars.compiled == before + 1


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


def test_forced_tool_calls_parse_and_validate(server: Served) -> None:
    messages = [{"role": "user", "content": "Weather?"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    base = {
        "model": NAME,
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 100,
        "temperature": 1.0,
    }
    for seed in range(2):
        named = {"type": "function", "function": {"name": "add"}}
        r = post(server, "/chat/completions", {**base, "seed": seed, "tool_choice": named})
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "add" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), params["add"])
        one = {"tool_choice": "required", "parallel_tool_calls": False}
        r = post(server, "/chat/completions", {**base, "seed": seed, **one})
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        if True:
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), params[call["function"]["name"]]
            )


def test_a_familys_tool_calls_stream_as_deltas(server: Served) -> None:
    """tool_choice auto with the hermes parser (the fixture's template shows no family): the
    reply is held to a hermes call by a regex, and comes back as content then a tool_call
    delta, and as tool_calls whole."""
    assert server.engine.tool_parser == "hermes"
    regex = r'ok <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Add"}],
        "tools": TOOLS,
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 4,
        "extra_body": {"guided_regex": regex},
    }
    chunks = list(server.client().chat.completions.create(stream=True, **body))  # type: ignore[attr-defined]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "ok " and len(deltas) == 1
    assert deltas[0].function.name == "add" and deltas[0].id.startswith("call_")
    args = json.loads(deltas[0].function.arguments)
    assert set(args) == {"a", "b"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    extra = body.pop("extra_body")
    r = post(server, "/chat/completions", {**body, **extra})
    message = r["choices"][0]["message"]
    assert (
        message["content"] == "ok "
        and json.loads(message["tool_calls"][0]["function"]["arguments"]) == args
    )


def _mistral_fixture(root: Path) -> Path:
    """The fixture with Mistral's tool-call marker: [TOOL_CALLS] a special (control) token, as
    in Mistral's tokenizers (in place of '~', which no merge uses), its template spelling it."""
    path = shutil.copytree(FIXTURE, root / "mistral")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["[TOOL_CALLS]"] = vocab.pop("~")
    tokenizer["added_tokens"].append(
        {
            "id": vocab["[TOOL_CALLS]"],
            "content": "[TOOL_CALLS]",
            **dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False),
            "special": True,
        }
    )
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    template = path / "chat_template.jinja"
    template.write_text(template.read_text() + "{#- tools: [TOOL_CALLS] #}")
    return path


def _as_lark(compile_: Any) -> Any:
    return lambda _kind, spec, field: compile_("lark", spec, field)


def test_mistral_tool_calls_after_its_control_token(tmp_path: Path) -> None:
    """Mistral's [TOOL_CALLS] is a special token, which decoded text skips: the reply is held
    by a grammar to content, that token's id, then a call list, and the call is read from the
    ids (streamed and whole), while a reply without tools still skips the token. The served
    grammar fields are GBNF, which cannot name a token id: this engine reads them as Lark."""
    for served in serve(fixture=_mistral_fixture(tmp_path)):
        grammars = served.engine.grammars
        grammars.compile = _as_lark(grammars.compile)  # type: ignore[method-assign]
        marker = served.engine.tokenizer.token_id("[TOOL_CALLS]")
        assert marker in served.engine.tokenizer.special_ids
        assert served.engine.tool_parser == "mistral"
        grammar = (
            f'start: "ok" <[{marker}]> "[{{\\"name\\": \\"add\\", \\"arguments\\": '
            '{\\"a\\": " /[1-9]/ ", \\"b\\": " /[1-9]/ "}}]"'
        )
        body = {
            "model": served.engine.name,
            "messages": [{"role": "user", "content": "Add"}],
            "tools": TOOLS,
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": 4,
        }
        extra = {"structured_outputs": {"grammar": grammar}}
        chunks = list(
            served.client().chat.completions.create(stream=True, extra_body=extra, **body)  # type: ignore[attr-defined]
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert content == "ok" and [d.function.name for d in deltas] == ["add"]
        args = json.loads(deltas[0].function.arguments)
        assert set(args) == {"a", "b"}
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        message = post(served, "/chat/completions", {**body, **extra})["choices"][0]["message"]
        assert message["content"] == "ok"
        (call,) = message["tool_calls"]
        assert (
            call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == args
        )
        body.pop("tools")
        plain = post(served, "/chat/completions", {**body, **extra})["choices"][0]["message"]
        assert plain["content"].startswith('ok[{"name": "add"') and not plain.get("tool_calls")
