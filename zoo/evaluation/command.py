"""`zoo eval SOURCE --tasks a,b`: lm-evaluation-harness tasks on a checkpoint, an export or a hub id.

The harness's own `lm_eval` command only knows models registered when it starts, so the zoo drives the
evaluation itself: `simple_evaluate` with a `ZooLM`, the tasks looked up in `--include-path` (local task
YAMLs) and, only when some are not found there, among lm-eval's built-in tasks (indexing those takes ~10 s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager


def eval_main(argv: list[str], parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a Lightning checkpoint, an exported folder or a hub repo id")
    parser.add_argument("--tasks", required=True, help="comma-separated task names (globs allowed)")
    parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (searched first)")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    parser.add_argument("--max-gen-toks", type=int, default=256, help="default new tokens of a generation")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--bootstrap-iters", type=int, default=0, help="stderr bootstrap (0: none, fast)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and of few-shot selection")
    parser.add_argument("--log-samples", action="store_true", help="keep every request's answer in the JSON")
    parser.add_argument("--output", default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    try:
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable, make_table

        from zoo.evaluation.harness import ZooLM
    except ModuleNotFoundError as error:
        raise SystemExit(
            f"zoo eval needs lm-evaluation-harness ({error}): pip install -e '.[eval]'"
        ) from None

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise SystemExit("--tasks names no task")
    manager = _task_manager(tasks, args.include_path)
    lm = ZooLM(args.source, args.batch_size, args.device, max_gen_toks=args.max_gen_toks, seed=args.seed)
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        bootstrap_iters=args.bootstrap_iters,
        task_manager=manager,
        log_samples=args.log_samples,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    results["config"]["model_source"] = str(args.source)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
        print(f"wrote {out}")


def _task_manager(tasks: list[str], include_path: str | None) -> TaskManager:
    """lm-eval's TaskManager over `include_path` alone when it holds every task, else with the built-ins;
    SystemExit naming the tasks found nowhere."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise SystemExit(f"--include-path {include_path} is not a folder of task YAMLs")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if _missing(local, tasks) == []:
            return local
    manager = TaskManager(include_path=include_path)
    missing = _missing(manager, tasks)
    if missing:
        where = f"in {include_path} nor " if include_path else ""
        raise SystemExit(
            f"unknown task(s) {', '.join(missing)}: not found {where}among lm-eval's tasks "
            "(`lm_eval ls tasks` lists them; a local YAML's folder goes in --include-path)"
        )
    return manager


def _missing(manager: TaskManager, tasks: list[str]) -> list[str]:
    return [name for name in tasks if not manager.match_tasks([name])]
