"""The `zoo` command: LightningCLI for fit/validate/test/predict, plus a few plain subcommands.

zoo fit --config configs/quickstart.yaml            # train into runs/quickstart/version_N (latest -> it)
zoo fit --config configs/quickstart.yaml --print_config
zoo predict --config configs/quickstart.yaml --config configs/predict.yaml \\
    --ckpt_path runs/quickstart/latest/checkpoints/last.ckpt
zoo train-tokenizer --files corpus.txt --vocab_size 8192 --out tokenizer.json
zoo models                                          # presets with total and active parameters
zoo export --checkpoint last.ckpt --out exported/ [--depth 0.5 --width 0.5 --topk 0.5]
zoo push --checkpoint last.ckpt --repo_id user/zoo-tiny [--token T] [--private]
zoo pull --repo_id user/zoo-tiny --out pulled/
zoo analyze --checkpoint last.ckpt --out analysis/ [--batches 8] [--config data.yaml]   # routing by modality
zoo tokenize pairs.jsonl 'shards-{0000..0099}.tar' --out codes/ --model exported/   # code shards
zoo ablate --config base.yaml --variant a= --variant b=overlay.yaml --seeds 0 1 2 --out runs/ablation/

A relative config path that is not in the working directory is read from the configs shipped with the zoo
(`zoo.cli.config_paths`): `zoo fit --config configs/quickstart.yaml` works from any directory after a wheel
install. A refusal prints its cause in a line or two (`--debug` prints the traceback); classes named in YAML,
flags or checkpoints must be on the allow-list of `zoo.trust` (add your own modules with
ZOO_ALLOW_IMPORTS=pkg,...).
"""

from __future__ import annotations

import sys

from zoo.cli.commands import EXTRA_COMMANDS, extra_command
from zoo.cli.config_paths import with_packaged_configs
from zoo.cli.errors import USER_ERRORS, debug_requested, report
from zoo.cli.lightning_cli import ZooCLI

__all__ = ["ZooCLI", "console_main", "main"]


def main(argv: list[str] | None = None) -> None:
    """Run one `zoo` command; errors propagate (the Python entry point, used by tests and scripts)."""
    argv = with_packaged_configs(sys.argv[1:] if argv is None else list(argv))
    command = extra_command(argv[0]) if argv else None
    if command is not None:
        command(argv[1:])
        return
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Extra commands: " + "; ".join(f"{k}: {v}" for k, v in EXTRA_COMMANDS.items()))
    import zoo  # noqa: F401  (registers presets; checkpoints name zoo classes)

    ZooCLI(args=argv)  # sys.argv is `argv` while it runs (ZooCLI.__init__): no LightningCLI `args` warning


def console_main(argv: list[str] | None = None) -> None:
    """The `zoo` console script: like `main`, but a refusal is printed for a person (`zoo.cli.errors`)."""
    debug, argv = debug_requested(sys.argv[1:] if argv is None else list(argv))
    if debug:
        main(argv)
        return
    try:
        main(argv)
    except USER_ERRORS as error:
        raise SystemExit(report(argv[0] if argv else "", error)) from None
