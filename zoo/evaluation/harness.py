"""lm-evaluation-harness over a zoo model: `ZooLM`, registered as lm-eval's model `"zoo"` (issue 16, item 5).

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    lm = ZooLM(zoo.pipeline("exported/"))    # or ZooLM(pretrained=...): a checkpoint, an export, a hub id
    simple_evaluate(model=lm, tasks=["my_task"], task_manager=TaskManager(include_path="tasks/"),
                    bootstrap_iters=0)

Tokens are unified ids (`pipe.maker.ids`): a context is `<bos>` and its text, as training documents begin,
so lm-eval's `prefix_token_id` is `<bos>` and its `eot_token_id` is `<eos>`. A request is scored with one
forward over `<bos> + context + continuation` (left-padded batches of `batch_size` rows); the
distribution is `model.sampling_logits`, the text head with the ids the tokenizer cannot decode masked, so
that a continuation is greedy exactly when greedy generation (`generate_until`, `zoo.pipeline`) would
produce it. Contexts longer than the model's context are left-truncated, as lm-eval's HFLM does; texts
longer than it are scored in HFLM's rolling windows (`loglikelihood_rolling`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

try:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as error:  # the `eval` extra is optional
    raise ModuleNotFoundError(
        f"zoo.evaluation needs lm-evaluation-harness ({error.name} is missing): pip install -e '.[eval]'"
    ) from error

from zoo.datamodules.documents import decode_text
from zoo.inference.pipeline import Pipeline, pipeline
from zoo.inference.scoring import score_sequences
from zoo.models.decode import text_prompts
from zoo.models.generation import stream_text
from zoo.models.sampling import Sampler
from zoo.tokenizers.vocab import UnifiedVocab

# One request as `_loglikelihood_tokens` receives it: its (context, continuation) strings (None for a
# rolling window), the context's ids and the continuation's ids.
TokenRequest = tuple[tuple[str | None, str | None], list[int], list[int]]
GENERATION_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}


@register_model("zoo")
class ZooLM(TemplateLM):
    """A zoo model as an lm-eval `LM`: `loglikelihood`, `loglikelihood_rolling` and `generate_until`.

    Args:
        pretrained: a `Pipeline`, or what `zoo.pipeline` loads: a Lightning checkpoint, an exported folder or
            a Hub repo id (lm-eval's `--model_args pretrained=...`).
        batch_size: requests per forward (scoring) or per decode batch (generation).
        device: where a loaded model goes (a given pipeline stays where it is).
        max_length: the context used, at most the model's (`backbone.max_seq_len`); None: the model's.
        max_gen_toks: new tokens of a generation request that does not say (lm-eval's default, 256).
        seed: the sampling generator's seed, for generation requests that sample (`do_sample`).
    """

    def __init__(
        self,
        pretrained: Pipeline | str | Path,
        batch_size: int | str = 8,
        device: str = "cpu",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.pipe = pretrained if isinstance(pretrained, Pipeline) else pipeline(pretrained, device=device)
        if str(batch_size) == "auto" or int(batch_size) < 1:
            raise ValueError(
                f"batch_size must be a positive integer ('auto' is not supported), got {batch_size}"
            )
        self.batch_size = int(batch_size)
        context = self.pipe.model.backbone.max_seq_len
        if max_length is not None and not 1 < max_length <= context:
            raise ValueError(f"max_length must lie in 2..{context} (the model's context), got {max_length}")
        self._max_length = context if max_length is None else max_length
        self.max_gen_toks = max_gen_toks
        self.seed = seed

    # -- what lm-eval asks of a model ----------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.pipe.model

    @property
    def vocab(self) -> UnifiedVocab:
        return self.pipe.model.vocab

    @property
    def eot_token_id(self) -> int:
        return self.vocab.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.vocab.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self.pipe.device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: object) -> list[int]:
        """Unified ids of `string`, after `<bos>` unless `add_special_tokens=False` (lm-eval passes False for
        a continuation scored after `prefix_token_id`, and for rolling texts). kwargs: lm-eval's, unused."""
        ids = self.pipe.maker.ids(string) if string else []
        return ids if add_special_tokens is False else [self.vocab.bos_id, *ids]

    def tok_decode(self, ids: Iterable[int]) -> str:
        """The text of unified ids (specials and media ids left out)."""
        return decode_text(self.pipe.tokenizer, self.vocab, list(ids))

    # -- scoring ----------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: Sequence[TokenRequest], disable_tqdm: bool = False, **kwargs: object
    ) -> list[tuple[float, bool]]:
        """(log-prob of the continuation given the context, whether each of its tokens is the argmax), per
        request; `batch_size` requests per forward, the longest together. kwargs: lm-eval's, unused."""
        rows = [self._scoring_row(context, continuation, key) for key, context, continuation in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, answer in zip(chunk, self._score([rows[i] for i in chunk]), strict=True):
                answers[i] = answer
                key = requests[i][0]
                if key[0] is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def _scoring_row(
        self, context: list[int], continuation: list[int], key: tuple[str | None, str | None]
    ) -> tuple[list[int], list[int]]:
        """The inputs of one forward (context and continuation but its last token, the context
        left-truncated to fit) and the targets (the continuation)."""
        if not continuation:
            raise ValueError(f"nothing to score: the continuation of {key!r} encodes to no tokens")
        if len(continuation) > self.max_length:
            raise ValueError(
                f"the continuation of {key!r} takes {len(continuation)} tokens, more than the context of "
                f"{self.max_length}: score it with loglikelihood_rolling"
            )
        inputs = (context + continuation)[-(self.max_length + 1) :][:-1]
        return inputs, continuation

    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One left-padded forward (`zoo.inference.scoring.score_sequences`): every row's continuation is
        predicted by its last positions."""
        sequences = [[*inputs, targets[-1]] for inputs, targets in rows]
        scored = score_sequences(self.pipe.model, sequences)
        answers = []
        for (_, targets), scores in zip(rows, scored, strict=True):
            n = len(targets)
            greedy = [top[0] for top in scores.top_ids[-n:]] == targets
            answers.append((sum(scores.logprobs[-n:]), greedy))
        return answers

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """HFLM's disjoint rolling windows over `text`'s tokens, `<bos>` before the first: (context,
        continuation) pairs whose continuations cover every token exactly once, in order."""
        tokens = self.tok_encode(text, add_special_tokens=False)
        windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
        return [make_disjoint_window(window) for window in windows]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The log-prob of each whole text (perplexity tasks), summed over its rolling windows."""
        texts = [request.args[0] for request in requests]
        owners, windows = [], []
        for i, text in enumerate(texts):
            for context, continuation in self.rolling_windows(text):
                owners.append(i)
                windows.append(((None, None), context, continuation))
        totals = [0.0] * len(texts)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # -- generation -------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation (greedy unless the request samples), stopped at `<eos>`, after
        `max_gen_toks` tokens or at the first `until` string, which is cut off with what follows it."""
        answers: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        settings = [self._generation_settings(request.args[1]) for request in requests]
        for i, setting in enumerate(settings):
            groups.setdefault(setting, []).append(i)
        for setting, members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in chunk], *setting)
                for i, text in zip(chunk, texts, strict=True):
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return answers

    def _generation_settings(self, kwargs: dict) -> tuple:
        """(until, max_gen_toks, temperature, top_k, top_p) of a request's generation kwargs."""
        unknown = set(kwargs) - GENERATION_KEYS
        if unknown:
            raise ValueError(
                f"generation kwargs {sorted(unknown)} are not supported (the zoo decodes with "
                f"{sorted(GENERATION_KEYS)})"
            )
        until = kwargs.get("until") or []
        until = (until,) if isinstance(until, str) else tuple(until)
        max_gen_toks = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        if not 0 < max_gen_toks < self.max_length:
            raise ValueError(f"max_gen_toks must lie in 1..{self.max_length - 1}, got {max_gen_toks}")
        # Hugging Face's meaning: `do_sample: true` samples (at temperature 1 unless told), false is greedy;
        # without `do_sample` a temperature above 0 samples, as lm-eval's HFLM reads it.
        do_sample = kwargs.get("do_sample")
        temperature = float(kwargs.get("temperature", 1.0 if do_sample else 0.0))
        if do_sample is False:
            temperature = 0.0
        return until, max_gen_toks, temperature, kwargs.get("top_k"), kwargs.get("top_p")

    @torch.no_grad()
    def _generate(
        self,
        contexts: list[str],
        until: tuple[str, ...],
        max_gen_toks: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
    ) -> list[str]:
        """One decode batch: `<bos>` and each context, left-truncated to leave room for the answer."""
        model, eos = self.pipe.model, self.vocab.eos_id
        room = self.max_length - max_gen_toks
        prompts = [self.tok_encode(context)[-room:] for context in contexts]
        generator = torch.Generator(self.device).manual_seed(self.seed) if temperature > 0 else None
        sampler = Sampler(temperature, top_k, top_p, generator)
        ids: list[list[int]] = [[] for _ in contexts]
        done = [False] * len(contexts)
        for token, live in stream_text(model, text_prompts(model, prompts), max_gen_toks, sampler, (eos,)):
            for row, (value, alive) in enumerate(zip(token.tolist(), live.tolist(), strict=True)):
                if done[row] or not alive or value == eos:
                    done[row] = True
                    continue
                ids[row].append(value)
                if until and any(stop in self.tok_decode(ids[row]) for stop in until):
                    done[row] = True
            if all(done):
                break
        return [cut(self.tok_decode(row), until) for row in ids]


def cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first of the `until` strings (all of it when none occurs)."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
