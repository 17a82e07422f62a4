"""lm-eval's `local-completions` model against `qir serve`, on inline tasks (a JSON file of a
few documents: no download): its loglikelihood scores are the log-softmax of `qir run --block
model` logits summed over each continuation's tokens, and generate_until runs in batches of 3
with each generation what the model gives alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qir.models import Model
from tests.serving.conftest import FIXTURE, NAME, Served
from tests.serving.test_openai_features import qir_run_logits

DOCS = [
    {"context": "The cat sat on the", "choices": [" mat", " moon"], "label": 0, "answer": "mat"},
    {
        "context": "Once upon a",
        "choices": [" time", " hill", " mountain"],
        "label": 0,
        "answer": "x",
    },
    {"context": "Hello", "choices": [" there", " world"], "label": 1, "answer": "y"},
]
TASKS = """
task: qir_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
---
task: qir_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_local_completions(
    server: Served, reference: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for i, text in enumerate(TASKS.format(data=data).split("---")):
        (tasks / f"task{i}.yaml").write_text(text)
    args = (
        f"base_url={server.url}/v1/completions,model={NAME},tokenizer={FIXTURE},"
        "tokenizer_backend=huggingface,max_length=128,num_concurrent=1"
    )
    monkeypatch.setenv("OPENAI_API_KEY", "sk-qir-test")
    result = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=["qir_choice", "qir_generate"],
        # our two tasks alone: indexing lm-eval's own ~10k task YAMLs took 8 of the test's 27 s
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=3,
        log_samples=True,
    )
    assert result is not None
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(FIXTURE))

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    sent = {st.request.prompt for st in server.streams if st.request.prompt_logprobs is not None}
    scored = 0
    for sample in result["samples"]["qir_choice"]:
        for (context, continuation), (logprob, _greedy) in zip(
            [a for a in sample["arguments"]], [r[0] for r in sample["resps"]], strict=True
        ):
            # the ids lm-eval sent for the pair (it may encode the continuation alone)
            ctx = encode(context)
            candidates = [
                ctx + encode(context + continuation)[len(ctx) :],
                ctx + encode(continuation),
            ]
            (whole,) = {tuple(c) for c in candidates} & sent
            lp = qir_run_logits(list(whole), tmp_path)
            want = sum(lp[p - 1, whole[p]] for p in range(len(ctx), len(whole)))
            assert logprob == pytest.approx(want, abs=1e-4)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
    generated = result["samples"]["qir_generate"]
    assert len(generated) == len(DOCS)
    for sample in generated:
        context = sample["arguments"][0][0]
        ids = encode(context)
        reference.reset()
        alone = reference.generate(ids, 4, do_sample=False)
        text = reference.tokenizer.decode(alone.tokens.tolist())
        assert sample["resps"][0][0] == text.split("\n\n")[0]
    assert np.isfinite(result["results"]["qir_choice"]["acc,none"])
