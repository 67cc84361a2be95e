"""The lm-evaluation-harness adapter (`zoo.evaluation.harness.ZooLM`, issue 16 item 5) and `zoo eval`.

The model is tiny, untrained and text-only, with a context of 32 positions so that truncation and rolling
windows come quickly. Every score is checked against a plain forward of the model written out here: the
log-softmax of `model.sampling_logits` (the text head, ids the tokenizer cannot decode masked) over
`<bos> + context + continuation`, one sequence at a time. Tasks are local YAMLs over jsonl files the tests
write; HF_DATASETS_OFFLINE keeps `datasets` off the network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from code_shard_helpers import VOCAB, write_text_tokenizer

# Only `datasets` (which only these tests use) is told so: the hub tests talk to a fake hub on localhost.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The dev extra has lm-eval: a missing one fails here rather than skipping the tests.
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from zoo.evaluation.command import eval_main  # noqa: E402
from zoo.evaluation.harness import ZooLM  # noqa: E402
from zoo.hub import save_pretrained  # noqa: E402
from zoo.inference import Pipeline  # noqa: E402
from zoo.models.backbone import UnifiedTransformer  # noqa: E402
from zoo.models.decode import text_prompts  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.tokenizers.text import TextTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 32
TEXTS = ["a small red circle at the top left", "a large blue square", "two green triangles", "the end."]
QUESTIONS = ["a small", "two green", "a large blue", "the", "a small red circle at the"]
CHOICES = ["circle", "square", "triangles", "end"]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> Pipeline:
    folder = tmp_path_factory.mktemp("lm_eval")
    tokenizer = TextTokenizer.load(write_text_tokenizer(folder / "tokenizer.json", TEXTS))
    torch.manual_seed(2)
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2,
        max_seq_len=CONTEXT,
    )  # fmt: skip
    return Pipeline(UnifiedModel(backbone, VOCAB, mtp_depth=0), tokenizer)


def ids(pipe: Pipeline, text: str) -> list[int]:
    return pipe.maker.ids(text)


@torch.no_grad()
def reference_logprobs(pipe: Pipeline, sequence: list[int]) -> torch.Tensor:
    """`[len(sequence) - 1]`: log p(sequence[i + 1] | sequence[: i + 1]), one plain forward of one row."""
    model = pipe.model
    hidden = model.forward_hidden(text_prompts(model, [sequence[:-1]])).hidden[0]
    logprobs = torch.log_softmax(model.sampling_logits(hidden).float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


@torch.no_grad()
def reference_greedy(pipe: Pipeline, sequence: list[int], scored: int) -> bool:
    model = pipe.model
    hidden = model.forward_hidden(text_prompts(model, [sequence[:-1]])).hidden[0, -scored:]
    return model.sampling_logits(hidden).argmax(-1).tolist() == sequence[-scored:]


def reference_pair(pipe: Pipeline, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (the whole text encoded, the context's tokens first), scored by a plain forward;
    a sequence longer than the context keeps its last CONTEXT + 1 tokens."""
    bos = pipe.model.vocab.bos_id
    whole, head = [bos, *ids(pipe, context + continuation)], [bos, *ids(pipe, context)]
    scored = len(whole) - len(head)
    sequence = whole[-(CONTEXT + 1) :]
    return float(reference_logprobs(pipe, sequence)[-scored:].sum()), reference_greedy(pipe, sequence, scored)


def requests(kind: str, *arguments: tuple) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


def test_loglikelihood_is_the_sum_of_the_continuations_token_logprobs_in_padded_batches(pipe):
    lm = ZooLM(pipe, batch_size=3)  # 5 requests of different lengths: two padded batches
    pairs = [("a small", " red circle"), ("two", " green triangles"), ("a large blue", " square"),
             ("the", " end."), ("", "a small red")]  # fmt: skip
    answers = lm.loglikelihood(requests("loglikelihood", *pairs))
    for (context, continuation), (logprob, greedy) in zip(pairs, answers, strict=True):
        if context:
            expected, expected_greedy = reference_pair(pipe, context, continuation)
        else:  # an empty context is scored after <bos> alone
            sequence = [pipe.model.vocab.bos_id, *ids(pipe, continuation)]
            expected = float(reference_logprobs(pipe, sequence).sum())
            expected_greedy = reference_greedy(pipe, sequence, len(sequence) - 1)
        assert logprob == pytest.approx(expected, abs=1e-4) and logprob < 0
        assert greedy == expected_greedy


def test_is_greedy_is_true_exactly_when_every_continuation_token_is_the_argmax(pipe):
    lm, model = ZooLM(pipe), pipe.model
    context = [model.vocab.bos_id, *ids(pipe, "a small red")]
    greedy = model.generate([context], 5, temperature=0)[0]
    assert model.vocab.eos_id not in greedy
    other = greedy[:-1] + [next(t for t in context[1:] if t != greedy[-1])]
    (logprob, is_greedy), (other_logprob, other_greedy) = lm._loglikelihood_tokens(
        [(("a", "b"), context, greedy), (("a", "c"), context, other)]
    )
    assert is_greedy and not other_greedy and logprob > other_logprob


def test_a_context_longer_than_the_model_is_left_truncated_not_refused(pipe):
    lm = ZooLM(pipe, batch_size=2)
    context = " ".join(TEXTS * 3)
    assert len(ids(pipe, context)) > 2 * CONTEXT
    (logprob, greedy), (short, _) = lm.loglikelihood(
        requests("loglikelihood", (context, " a large blue square"), ("a", " large"))
    )
    expected, expected_greedy = reference_pair(pipe, context, " a large blue square")
    assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    assert short == pytest.approx(reference_pair(pipe, "a", " large")[0], abs=1e-4)
    with pytest.raises(ValueError, match="loglikelihood_rolling"):
        lm.loglikelihood(requests("loglikelihood", ("a", " " + context)))


def test_rolling_windows_cover_every_token_once_and_sum_to_the_text_logprob(pipe):
    lm = ZooLM(pipe, batch_size=2)
    text = " ".join(TEXTS * 5)
    tokens = ids(pipe, text)
    assert len(tokens) > 3 * CONTEXT
    windows = lm.rolling_windows(text)
    assert len(windows) >= 4
    assert [t for _, continuation in windows for t in continuation] == tokens
    assert windows[0][0] == [pipe.model.vocab.bos_id]
    expected = 0.0
    for context, continuation in windows:
        sequence = context + continuation
        assert len(sequence) <= CONTEXT + 1
        expected += float(reference_logprobs(pipe, sequence)[-len(continuation) :].sum())
    (total, short) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,), ("two green",)))
    assert total == pytest.approx(expected, rel=1e-5)
    bos = pipe.model.vocab.bos_id
    assert short == pytest.approx(float(reference_logprobs(pipe, [bos, *ids(pipe, "two green")]).sum()), 1e-5)


def test_generate_until_is_the_pipelines_greedy_text_cut_at_the_first_stop_string(pipe):
    lm = ZooLM(pipe, batch_size=2)
    contexts = ["a small red", "two green", "the"]
    answers = [pipe(c, max_new_tokens=12, temperature=0) for c in contexts]
    # A stop string from inside each answer (not a replacement character an untrained model emits).
    stops = [
        next(a[k : k + 2] for k in range(3, len(a) - 1) if "\ufffd" not in a[k : k + 2]) for a in answers
    ]
    asked = [(c, {"until": [s], "max_gen_toks": 12}) for c, s in zip(contexts, stops, strict=True)]
    asked.append((contexts[0], {"until": [], "max_gen_toks": 12, "do_sample": False}))
    got = lm.generate_until(requests("generate_until", *asked))
    assert got[:3] == [a.split(s)[0] for a, s in zip(answers, stops, strict=True)]
    assert got[3] == answers[0]
    with pytest.raises(ValueError, match="not supported"):
        lm.generate_until(requests("generate_until", ("a", {"until": [], "num_beams": 4})))


def write_tasks(pipe: Pipeline, folder: Path) -> list[int]:
    """A multiple-choice task whose gold choice is, per question, the one a plain forward scores highest
    (rotated to a different position each question), and a generation task whose target is the
    pipeline's greedy answer; returns the gold labels."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, labels = [], []
    for n, question in enumerate(QUESTIONS):
        scores = [reference_pair(pipe, question, " " + choice)[0] for choice in CHOICES]
        best = max(range(len(CHOICES)), key=scores.__getitem__)
        shift = (best - n) % len(CHOICES)
        choices = CHOICES[shift:] + CHOICES[:shift]  # the best now sits at n % len(CHOICES)
        labels.append(choices.index(CHOICES[best]))
        answer = pipe(question, max_new_tokens=6, temperature=0)
        rows.append({"question": question, "choices": choices, "label": labels[-1], "answer": answer})
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "zoo_choice.yaml").write_text(
        f"task: zoo_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "zoo_answer.yaml").write_text(
        f"task: zoo_answer\ndataset_path: json\ndataset_kwargs:\n  data_files: {data}\n"
        "test_split: train\noutput_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "generation_kwargs:\n  until: []\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return labels


def test_a_local_multiple_choice_task_scores_the_model_with_simple_evaluate(pipe, tmp_path):
    labels = write_tasks(pipe, tmp_path / "tasks")
    assert len(set(labels)) > 1, "the gold choice must move, or always answering one position would pass"
    results = simple_evaluate(
        model=ZooLM(pipe, batch_size=4),
        tasks=["zoo_choice", "zoo_answer"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        bootstrap_iters=0,
        limit=4,
        log_samples=False,
    )
    assert results["results"]["zoo_choice"]["acc,none"] == 1.0
    assert results["results"]["zoo_answer"]["exact_match,none"] == 1.0
    assert results["n-samples"]["zoo_choice"]["effective"] == 4


def test_zoo_eval_runs_local_tasks_on_an_export_and_writes_the_results_json(pipe, tmp_path):
    folder = save_pretrained(pipe.model, tmp_path / "export", pipe.tokenizer)
    write_tasks(pipe, tmp_path / "tasks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    command = [sys.executable, "-m", "zoo.cli", "eval", str(folder), "--tasks", "zoo_choice",
               "--include-path", str(tmp_path / "tasks"), "--limit", "5", "--batch-size", "2",
               "--output", str(tmp_path / "out" / "results.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "zoo_choice" in done.stdout and "acc" in done.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["results"]["zoo_choice"]["acc,none"] == 1.0
    assert results["config"]["model_source"] == str(folder)


@pytest.mark.slow  # a task missing from --include-path is looked up among lm-eval's ~15,000 (~10 s)
def test_zoo_eval_names_a_task_found_nowhere(pipe, tmp_path):
    write_tasks(pipe, tmp_path / "tasks")
    argv = ["export", "--tasks", "zoo_choice,no_such_task", "--include-path", str(tmp_path / "tasks")]
    with pytest.raises(SystemExit, match=r"unknown task\(s\) no_such_task: not found in .* nor among"):
        eval_main(argv, argparse.ArgumentParser())


def test_zoo_eval_without_lm_eval_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    monkeypatch.delitem(sys.modules, "zoo.evaluation.harness")
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[eval\]'"):
        eval_main(["export", "--tasks", "any"], argparse.ArgumentParser())


def test_lm_eval_builds_the_registered_zoo_model_from_its_arguments(pipe, tmp_path):
    from lm_eval.api.registry import get_model

    folder = save_pretrained(pipe.model, tmp_path / "export", pipe.tokenizer)
    lm = get_model("zoo").create_from_arg_string(f"pretrained={folder},batch_size=2,max_length=16")
    assert isinstance(lm, ZooLM) and lm.batch_size == 2 and lm.max_length == 16
    pair = requests("loglikelihood", ("a small", " red circle"))
    assert lm.loglikelihood(pair)[0][0] == pytest.approx(ZooLM(pipe, max_length=16).loglikelihood(pair)[0][0])
    with pytest.raises(ValueError, match="'auto' is not supported"):
        ZooLM(pipe, batch_size="auto")
    write_tasks(pipe, tmp_path / "tasks")
    results = simple_evaluate(
        model="zoo",
        model_args=f"pretrained={folder}",
        batch_size=3,
        tasks=["zoo_choice"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        bootstrap_iters=0,
        limit=3,
        log_samples=False,
    )
    assert results["results"]["zoo_choice"]["acc,none"] == 1.0


def test_lm_evals_completions_client_scores_through_zoo_serve_as_the_adapter_does(pipe, tmp_path):
    """lm-eval's own `local-completions` model against a real `zoo serve` app: the tokenizer over HTTP
    (`tokenizer_backend=remote`), token-id prompts, `echo` + `logprobs`: the same answers and the same
    log-likelihoods as `ZooLM` in this process."""
    import lm_eval.models.openai_completions  # noqa: F401  (registers local-completions)
    from test_serve import Running

    from zoo.serve.app import create_app

    write_tasks(pipe, tmp_path / "tasks")
    tasks = dict(
        tasks=["zoo_choice", "zoo_answer"], bootstrap_iters=0, limit=4, log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
    )  # fmt: skip
    running = Running(create_app(pipe, "tiny", max_batch=4, max_queue=16))
    try:
        args = (
            f"model=tiny,base_url={running.url}/v1/completions,tokenizer_backend=remote,"
            f"tokenized_requests=True,max_length={CONTEXT - 1},num_concurrent=1,max_retries=1"
        )  # max_length leaves the server room for the <bos> it puts first
        served = simple_evaluate(model="local-completions", model_args=args, **tasks)
    finally:
        running.stop()
    local = simple_evaluate(model=ZooLM(pipe, batch_size=4), **tasks)
    assert served["results"]["zoo_choice"]["acc,none"] == local["results"]["zoo_choice"]["acc,none"] == 1.0
    assert served["results"]["zoo_answer"]["exact_match,none"] == 1.0

    def loglikelihoods(results: dict) -> list[float]:
        return [float(r[0][0]) for s in results["samples"]["zoo_choice"] for r in s["resps"]]

    assert loglikelihoods(served) == pytest.approx(loglikelihoods(local), abs=1e-4)
