"""The `zoo` command: LightningCLI for fit/validate/test/predict, plus a few plain subcommands.

zoo fit --config configs/quickstart.yaml            # train (any component swappable by class_path)
zoo fit --config configs/quickstart.yaml --print_config
zoo predict --config configs/quickstart.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt
zoo train-tokenizer --files corpus.txt --vocab_size 8192 --out tokenizer.json
zoo models                                          # presets with total and active parameters
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

EXTRA_COMMANDS = {
    "train-tokenizer": "train a byte-level BPE tokenizer on text files",
    "models": "list the model presets with their parameter counts",
}


class ZooCLI(LightningCLI):
    """LightningCLI in subclass mode: the task and the datamodule are chosen by `class_path` in YAML."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            auto_configure_optimizers=False,
        )


def models_main(argv: list[str]) -> None:
    """Print every preset with its total and active parameter counts (built on the meta device)."""
    from zoo.registry import create_model, get_preset, list_models

    if argv:
        raise SystemExit(f"zoo models takes no arguments, got {argv}")
    print(f"{'name':<14} {'total':>10} {'active':>10} {'active %':>9}  description")
    for name in list_models():
        model = create_model(name, device="meta")
        total, active = model.num_parameters(), model.num_parameters(active=True)
        print(
            f"{name:<14} {total:>10.3g} {active:>10.3g} {100 * active / total:>8.2f}%  "
            + get_preset(name).description
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train-tokenizer":
        from zoo.tokenizers.text import train_tokenizer_main

        train_tokenizer_main(argv[1:])
        return
    if argv and argv[0] == "models":
        models_main(argv[1:])
        return
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Extra commands: " + "; ".join(f"{k}: {v}" for k, v in EXTRA_COMMANDS.items()))
    import zoo  # noqa: F401  (registers presets; checkpoints name zoo classes)

    ZooCLI(args=argv)


if __name__ == "__main__":
    main()
