"""`qir serve`'s HTTP API driven by the official OpenAI client: chat and text completions,
streamed and not, equal to the same generation run alone (Model.generate / Model.chat, what
`qir generate` prints); seeds, usage, stop strings, concurrent clients, a client that goes away,
and every refusal as an OpenAI error object naming its field."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import pytest

from qir.cli import main
from qir.models import Model
from tests.requires import import_or_skip
from tests.serving.conftest import API_KEY, FIXTURE, MAX_BODY, NAME, Served, serve

openai = import_or_skip("openai", "openai")
import_or_skip("qir.serving.http", "serve")

GREEDY = {"temperature": 0}
HI = [{"role": "user", "content": "Hi there"}]


def _alone(reference: Model, prompt: str | list[dict[str, str]], n: int, **sampling: Any) -> Any:
    """The text a request gives run alone, its finish reason as the API says it and its
    prompt's length."""
    reference.reset()
    options = {"ignore_eos": sampling.pop("ignore_eos", False), **sampling}
    if isinstance(prompt, str):
        text = reference.generate(prompt, n, **options)
        ids = reference.encode(prompt)
    else:
        options.pop("ignore_eos")
        text = reference.chat(prompt, n, **options)
        ids = reference.tokenizer.encode(reference.chat_prompt(prompt), add_special_tokens=False)
    finish = {"eos": "stop", "stop": "stop", "length": "length"}[reference.last.finish]
    return text, finish, len(ids), len(reference.last.tokens)


def _wait(condition: Any, what: str, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _all_pages_free(server: Served) -> None:
    sched = server.engine.scheduler
    _wait(lambda: sched.idle and sched.pool.free == sched.pool.pages, "every KV page to be free")


def test_models_and_health(server: Served) -> None:
    models = server.client().models.list()  # type: ignore[attr-defined]
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].model_extra["max_model_len"] == server.engine.max_seq == 128
    with urllib.request.urlopen(f"{server.url}/health") as r:  # no key needed: a probe
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok", "model": NAME}


def test_chat_equals_the_model_alone(server: Served, reference: Model) -> None:
    text, finish, prompt_tokens, n = _alone(reference, HI, 6, do_sample=False)
    client = server.client()
    r = client.chat.completions.create(model=NAME, messages=HI, max_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish and r.choices[0].index == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, n)
    assert r.usage.total_tokens == prompt_tokens + n

    chunks = list(
        client.chat.completions.create(
            messages=HI,
            model=NAME,
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_equals_qir_generate(
    server: Served, reference: Model, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "The cat sat"
    argv = ["generate", str(FIXTURE), "--prompt", prompt, "--greedy", "--max-new-tokens", "6"]
    assert main([*argv, "--backend", "host"]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith("\n")
    text, finish, prompt_tokens, n = _alone(reference, prompt, 6, do_sample=False)
    assert printed[:-1] == text

    client = server.client()
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, n)

    chunks = list(
        client.completions.create(model=NAME, prompt=prompt, max_tokens=6, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish
    assert all(c.usage is None for c in chunks)  # no usage unless asked

    ids = reference.encode(prompt)  # a prompt of token ids gives the same
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert r.choices[0].text == text


def test_a_seed_reproduces_a_sampled_answer(server: Served, reference: Model) -> None:
    client = server.client()
    options = {"temperature": 1.0, "top_p": 0.9, "extra_body": {"top_k": 50, "min_p": 0.02}}

    def sampled(seed: int) -> str:
        r = client.completions.create(model=NAME, prompt="Once", max_tokens=8, seed=seed, **options)
        return r.choices[0].text

    a, b, c = sampled(7), sampled(7), sampled(8)
    alone = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.02, "seed": 7}
    assert a == b == _alone(reference, "Once", 8, **alone)[0]
    assert c != a


def test_stop_strings_end_the_text(server: Served, reference: Model) -> None:
    client = server.client()
    free = _alone(reference, "Hello", 12, do_sample=False, ignore_eos=True)[0]
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert len(stop) == 2 and free.find(stop) > 0
    extra = {"extra_body": {"ignore_eos": True}, **GREEDY}
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=12, stop=stop, **extra)
    assert r.choices[0].text == free[: free.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=12, stop=["zzzz", stop], stream=True, **extra
    )
    chunks = list(chunks)
    assert "".join(c.choices[0].text for c in chunks) == free[: free.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own_answer(server: Served, reference: Model) -> None:
    """16 clients at once, different prompts, half streamed: each gets exactly what its
    request gives alone (no token lost, duplicated or crossed between sequences)."""
    prompts = [f"Client {i} asks: {'why ' * (i % 4)}now?" for i in range(16)]
    alone = [_alone(reference, p, 3, do_sample=False)[0] for p in prompts]
    client = server.async_client()

    async def ask(i: int) -> str:
        common = {"model": NAME, "prompt": prompts[i], "max_tokens": 3, **GREEDY}
        if i % 2:
            r = await client.completions.create(**common)  # type: ignore[attr-defined]
            return str(r.choices[0].text)
        stream = await client.completions.create(stream=True, **common)  # type: ignore[attr-defined]
        return "".join([c.choices[0].text async for c in stream])

    async def everyone() -> list[str]:
        return list(await asyncio.gather(*(ask(i) for i in range(16))))

    steps = server.engine.scheduler.steps
    assert asyncio.run(everyone()) == alone
    assert len(set(alone)) > 1  # the prompts lead to different answers
    _all_pages_free(server)
    # They ran together: one at a time, 16 requests of 3 tokens take 16 prefills and 32 decode
    # steps; batched, the decode steps serve many sequences each. (Steps, not seconds: the
    # benchmark measures time, benchmarks/serve.py.)
    assert server.engine.scheduler.steps - steps < 16 + 32


def test_a_client_that_disconnects_cancels_its_stream(server: Served) -> None:
    client = server.client()
    before = len(server.streams)
    chunks = client.completions.create(
        model=NAME, prompt="Go on", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(chunks))
    chunks.close()  # the client hangs up mid-stream
    _wait(lambda: len(server.streams) > before and server.streams[-1].cancelled.is_set(), "cancel")
    assert not server.streams[-1].done
    _all_pages_free(server)  # the engine dropped the sequence

    # Not streamed: the client leaves while it waits for the whole answer.
    body = json.dumps({"prompt": "Go on", "max_tokens": 100, "ignore_eos": True})
    where = urlsplit(server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body, headers)
    _wait(lambda: len(server.streams) > before + 1, "the request to reach the engine")
    conn.close()
    _wait(lambda: server.streams[-1].cancelled.is_set(), "cancel")
    _all_pages_free(server)

    # The engine goes on serving.
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens >= 1


def _refusal(call: Any, kind: type[openai.APIStatusError]) -> openai.APIStatusError:
    with pytest.raises(kind) as e:
        call()
    assert isinstance(e.value.body, dict) and set(e.value.body) == {
        "message",
        "type",
        "param",
        "code",
    }
    return e.value


def test_over_long_prompts_get_400_naming_the_field(server: Served) -> None:
    client = server.client()
    long = "hello " * 200
    e = _refusal(
        lambda: client.completions.create(model=NAME, prompt=long, max_tokens=4),
        openai.BadRequestError,
    )
    assert (e.status_code, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert "context of 128" in e.message
    messages = [{"role": "user", "content": long}]
    e = _refusal(
        lambda: client.chat.completions.create(model=NAME, messages=messages),
        openai.BadRequestError,
    )
    assert (e.param, e.code) == ("messages", "context_length_exceeded")
    # A prompt that fits, asking for more than the rest of the context.
    e = _refusal(
        lambda: client.completions.create(model=NAME, prompt="Hi", max_tokens=500),
        openai.BadRequestError,
    )
    assert (e.param, e.code) == ("max_tokens", "context_length_exceeded")
    # Left out, max_tokens is what fits: the rest of the context.
    chunks = client.completions.create(model=NAME, prompt="Hi", stream=True)
    next(iter(chunks))
    chunks.close()
    asked = server.streams[-1].request
    assert asked.max_tokens == server.engine.max_seq - len(asked.prompt)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"n": 2, "extra_body": {"best_of": 1}}, "best_of"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"999": 1.0}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": [5, 999]}}, "allowed_token_ids"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"mirostat": 2}}, "mirostat"),
        ({"extra_body": {"guided_regex": "("}}, "guided_regex"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.[0].content.[0]",
        ),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_get_400_naming_the_field(
    server: Served, options: dict[str, Any], param: str
) -> None:
    body = {"model": NAME, "messages": HI, "max_tokens": 2, **options}
    e = _refusal(lambda: server.client().chat.completions.create(**body), openai.BadRequestError)
    assert e.param == param and e.type == "invalid_request_error" and param in e.message
    assert "Traceback" not in e.message


def test_fields_that_do_not_change_the_result_are_ignored(server: Served) -> None:
    extra = {"user": "u1", "metadata": {"k": "v"}, "frobnicate": 3, "logprobs": False, "n": 1}
    r = server.client().chat.completions.create(
        model=NAME, messages=HI, max_tokens=2, extra_body=extra, **GREEDY
    )
    assert r.choices[0].message.content is not None


def test_another_models_name_gets_404(server: Served) -> None:
    e = _refusal(
        lambda: server.client().chat.completions.create(model="gpt-4o", messages=HI),
        openai.NotFoundError,
    )
    assert (e.param, e.code) == ("model", "model_not_found")


def test_a_wrong_or_missing_api_key_gets_401(server: Served) -> None:
    e = _refusal(lambda: server.client("sk-wrong").models.list(), openai.AuthenticationError)
    assert e.code == "invalid_api_key"
    request = urllib.request.Request(f"{server.url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request)
    assert missing.value.code == 401
    assert json.loads(missing.value.read())["error"]["code"] == "invalid_api_key"


def test_a_body_over_the_limit_gets_413(server: Served) -> None:
    messages = [{"role": "user", "content": "x" * MAX_BODY}]
    e = _refusal(
        lambda: server.client().chat.completions.create(model=NAME, messages=messages),
        openai.APIStatusError,
    )
    assert (e.status_code, e.code) == (413, "request_too_large")


def test_a_body_that_is_not_json_gets_400(server: Served) -> None:
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=b"{prompt: 1",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request)
    assert e.value.code == 400
    assert "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def _burst(served: Served, n: int) -> list[Any]:
    client = served.async_client()

    async def ask() -> Any:
        try:
            return await client.completions.create(  # type: ignore[attr-defined]
                model=NAME, prompt="Hi", max_tokens=12, extra_body={"ignore_eos": True}
            )
        except openai.RateLimitError as e:
            return e

    async def burst() -> list[Any]:
        return list(await asyncio.gather(*(ask() for _ in range(n))))

    return asyncio.run(burst())


def test_a_full_queue_gets_429() -> None:
    """One request runs, one waits (--max-queue 1): of a burst, the rest are refused."""
    for served in serve(max_queue=1):
        answers = _burst(served, 8)
        refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
        done = [a for a in answers if not isinstance(a, openai.RateLimitError)]
        assert refused and done
        assert all(e.status_code == 429 and e.code == "rate_limit_exceeded" for e in refused)
        assert all(int(e.response.headers["retry-after"]) >= 1 for e in refused)
        assert "busy" in refused[0].message
        assert all(a.usage.completion_tokens == 12 for a in done)


def test_the_docs_client_example_runs(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/serving.md's client example (tests/test_docs.py leaves it to this test)."""
    page = (FIXTURE.parent.parent.parent / "docs" / "serving.md").read_text()
    (example,) = re.findall(r"```python\n(from openai.*?)```", page, flags=re.S)
    for placeholder in ('"http://127.0.0.1:8000/v1"', '"KEY"', '"checkpoint"', "max_tokens=32"):
        assert placeholder in example
    example = example.replace('"http://127.0.0.1:8000/v1"', repr(f"{server.url}/v1"))
    example = example.replace('"KEY"', repr(API_KEY)).replace('"checkpoint"', repr(NAME))
    exec(example.replace("max_tokens=32", "max_tokens=3"), {})
    assert capsys.readouterr().out.strip()


def test_an_engine_failure_is_a_500_not_a_traceback(
    server: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a step reaches the client as a server_error (the response, or an error event
    in the stream); a bug in a handler as a 500 with a one-line message."""
    scheduler = server.engine.scheduler
    step = scheduler.step

    def fail_once() -> None:
        scheduler.step = step  # type: ignore[method-assign]
        raise RuntimeError("boom")

    client = server.client()
    scheduler.step = fail_once  # type: ignore[method-assign]
    e = _refusal(
        lambda: client.completions.create(model=NAME, prompt="Hi", max_tokens=2),
        openai.InternalServerError,
    )
    assert e.type == "server_error" and e.body["message"] == "generation failed: RuntimeError: boom"
    scheduler.step = fail_once  # type: ignore[method-assign]
    with pytest.raises(openai.APIError, match="generation failed: RuntimeError: boom"):
        list(client.completions.create(model=NAME, prompt="Hi", max_tokens=2, stream=True))

    from qir.serving.tokenizing import TextWorker  # the serve extra: imported past its check

    async def broken(self: Any, *args: Any, **options: Any) -> tuple[int, ...]:
        raise KeyError("oops")

    monkeypatch.setattr(TextWorker, "chat", broken)
    e = _refusal(
        lambda: client.chat.completions.create(model=NAME, messages=HI), openai.InternalServerError
    )
    assert e.type == "server_error" and "KeyError" in e.message and "oops" not in e.message
