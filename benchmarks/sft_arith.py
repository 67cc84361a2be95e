"""Does SFT beat its pretrained warm start on held-out arithmetic? (issue 18, item 3; accuracy only.)

1. Warm start: `zoo fit` of the quickstart model (configs/quickstart.yaml + configs/data/text_files.yaml,
   no role tokens) on prompt + reference-solution texts of the training split ("arith", difficulty 1 and 2:
   "12+7-3=" -> "12+7=19,19-3=16"), the loss on every token, as benchmarks/rl_heldout.py warms up.
2. SFT: `zoo fit --config configs/sft/arithmetic.yaml --model.init_args.init_from <warm start>`: the same
   architecture with the three role tokens added (`zoo.init_from`), the same training queries as
   conversations (user: prompt, assistant: worked answer), the loss on the answers only.
3. Control (`--control`): the warm start continued by plain pretraining for as many steps as SFT, so that a
   gain of SFT is not merely a gain of more steps.
4. Held-out evaluation on `--eval-prompts` distinct held-out prompts (never a training prompt): greedy exact
   (the integer the verifier reads is the answer). The warm start and the control are prompted as they were
   trained (`<bos> 12+7-3=`), the SFT model in the chat format (`<bos> <|user|> 12+7-3= <|assistant|>`, what
   `zoo.inference` sends). 95% intervals: normal approximation over prompts; deltas paired per prompt.

Prints one JSON line. About 8 minutes on 2 CPU cores with the defaults (10 with `--control`):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_arith.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_arith.py --quick     # checks the pipeline only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, mean_ci  # noqa: E402
from rl_heldout import heldout_prompts, warm_start  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = REPO / "configs" / "sft" / "arithmetic.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--out", default="/tmp/sft_arith", help="working directory (checkpoints, logs)")
    p.add_argument("--warm-start", default=None, help="reuse this warm-start .ckpt instead of training one")
    p.add_argument("--sft-checkpoint", default=None, help="reuse this SFT .ckpt instead of training one")
    p.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default 150; quick 10)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT and control steps (default 100; quick 5)")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="peak learning rate of SFT and the control")
    p.add_argument("--texts", type=int, default=60000, help="training queries of every stage")
    p.add_argument("--eval-prompts", type=int, default=None, help="distinct held-out prompts (default 512)")
    p.add_argument("--control", action="store_true", help="also continue the warm start by pretraining")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.task, args.difficulties = "arith", (1, 2)
    args.sft_texts = min(args.texts, 5000) if args.quick else args.texts  # rl_heldout's warm_start reads it
    args.sft_steps_warm = args.warm_steps or (10 if args.quick else 150)
    args.sft_steps = args.sft_steps or (5 if args.quick else 100)
    args.eval_prompts = args.eval_prompts or (32 if args.quick else 512)
    return args


def sft(args: argparse.Namespace, warm: Path, out: Path) -> Path:
    """`zoo fit` of configs/sft/arithmetic.yaml from the warm start; returns its last.ckpt."""
    from zoo.cli import main

    overlay = {
        "trainer": {
            "max_steps": args.sft_steps, "val_check_interval": args.sft_steps, "limit_val_batches": 1,
            "enable_progress_bar": False, "default_root_dir": str(out), "logger": False,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                "dirpath": str(out / "checkpoints"), "save_last": True, "enable_version_counter": False}}],
        },
        "model": {"init_args": {"init_from": str(warm), "lr": args.sft_lr,
                                "warmup_steps": min(20, args.sft_steps // 2)}},
        "data": {"init_args": {"batch_size": 256, "sources": [{
            "class_path": "zoo.rl.instructions.ArithmeticInstructions",
            "init_args": {"tasks": [args.task], "difficulties": list(args.difficulties),
                          "train_size": args.sft_texts, "val_size": 64}}]}},
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sft.yaml"
    path.write_text(json.dumps(overlay))  # JSON is YAML
    main(["fit", "--config", str(SFT_CONFIG), "--config", str(path)])
    return out / "checkpoints" / "last.ckpt"


def continued(args: argparse.Namespace, warm: Path, out: Path) -> Path:
    """The control: the warm start's own recipe for `sft_steps` more steps, from its weights."""
    from zoo.cli import main

    texts = Path(args.out) / "warm" / "train.jsonl"
    overlay = {
        "trainer": {
            "max_steps": args.sft_steps, "val_check_interval": args.sft_steps, "limit_val_batches": 1,
            "enable_progress_bar": False, "default_root_dir": str(out), "logger": False,
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                "dirpath": str(out / "checkpoints"), "save_last": True, "enable_version_counter": False}}],
        },
        "model": {"init_args": {"elastic": None, "init_from": str(warm), "lr": args.sft_lr,
                                "warmup_steps": min(20, args.sft_steps // 2)}},
        "data": {"init_args": {"train_files": [str(texts)], "seq_len": 128, "batch_size": 256}},
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / "continued.yaml"
    path.write_text(json.dumps(overlay))
    main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
          "--config", str(REPO / "configs" / "data" / "text_files.yaml"), "--config", str(path)])  # fmt: skip
    return out / "checkpoints" / "last.ckpt"


@torch.no_grad()
def greedy_correct(checkpoint: Path, queries: list, chat: bool, budget: int = 32) -> list[float]:
    """Per held-out query: 1.0 when the greedy answer is right. `chat`: prompted in the chat format."""
    from zoo.datamodules.chat import Turn, chat_document
    from zoo.datamodules.documents import decode_text
    from zoo.datamodules.paired_documents import DocumentMaker
    from zoo.datamodules.sequence import MediaLayout, TextSegment
    from zoo.hub import load_lightning_checkpoint
    from zoo.rl.scoring import safe_verify

    model, tokenizer = load_lightning_checkpoint(checkpoint)
    model.decode_text_with(tokenizer.vocab_size)
    vocab = model.vocab
    maker = DocumentMaker(vocab, tokenizer, MediaLayout(), model.backbone.max_seq_len)
    prompts = []
    for q in queries:
        if chat:
            document = chat_document(maker, [Turn("user", (q.prompt,))])
            prompts.append([i for s in document if isinstance(s, TextSegment) for i in s.ids])
        else:
            prompts.append([vocab.bos_id, *maker.ids(q.prompt)])
    correct = []
    for start in range(0, len(prompts), 128):
        outs = model.generate(prompts[start : start + 128], budget, temperature=0.0)
        for q, ids in zip(queries[start : start + 128], outs, strict=True):
            ids = ids[: ids.index(vocab.eos_id)] if vocab.eos_id in ids else ids
            correct.append(float(safe_verify(q, decode_text(tokenizer, vocab, ids)) >= 1.0))
    return correct


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    times: dict[str, float] = {}
    begin = time.perf_counter()
    warm = Path(args.warm_start) if args.warm_start else None
    if warm is None:
        args.sft_steps, sft_steps = args.sft_steps_warm, args.sft_steps  # warm_start reads args.sft_steps
        warm = warm_start(args, out / "warm")
        args.sft_steps = sft_steps
    times["warm_s"] = time.perf_counter() - begin
    begin = time.perf_counter()
    tuned = Path(args.sft_checkpoint) if args.sft_checkpoint else sft(args, warm, out / "sft")
    times["sft_s"] = time.perf_counter() - begin
    arms = {"warm_start": (warm, False), "sft": (tuned, True)}
    if args.control:
        begin = time.perf_counter()
        arms["continued_pretraining"] = (continued(args, warm, out / "continued"), False)
        times["control_s"] = time.perf_counter() - begin
    queries = heldout_prompts(args.eval_prompts, args.task, args.difficulties)
    begin = time.perf_counter()
    scores = {name: greedy_correct(path, queries, chat) for name, (path, chat) in arms.items()}
    times["eval_s"] = time.perf_counter() - begin
    result: dict[str, object] = {
        "benchmark": "sft_arith", "task": args.task, "difficulties": list(args.difficulties),
        "heldout_prompts": len(queries), "warm_steps": args.sft_steps_warm, "sft_steps": args.sft_steps,
        "sft_lr": args.sft_lr, "quick": args.quick,
    }  # fmt: skip
    base = scores["warm_start"]
    for name, values in scores.items():
        result[f"{name}_greedy"], result[f"{name}_greedy_ci95"] = mean_ci(values)
        if name != "warm_start":
            delta = [a - b for a, b in zip(values, base, strict=True)]
            result[f"{name}_delta"], result[f"{name}_delta_ci95"] = mean_ci(delta)
    if "continued_pretraining" in scores:
        delta = [a - b for a, b in zip(scores["sft"], scores["continued_pretraining"], strict=True)]
        result["sft_vs_continued_delta"], result["sft_vs_continued_delta_ci95"] = mean_ci(delta)
    result.update({k: round(v, 1) for k, v in times.items()})
    log(json.dumps(result, indent=1))
    emit(result)


if __name__ == "__main__":
    main()
