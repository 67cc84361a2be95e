"""The argument parser of the extra `zoo` commands: `--config FILE.yaml` and `--print_config`, as the
Lightning subcommands have them.

`zoo export|extract|push|pull|tokenize|generate|chat|serve|eval|train-tokenizer` read their options from the
command line as before, and also from YAML files: `--config export.yaml` (keys are the options' names with
dashes as underscores, positionals included; what comes later on the command line wins), and they print the
options they would run with as YAML with `--print_config` (a file that `--config` reads back). The parser is
jsonargparse's ArgumentParser, argparse's own class plus config files, so a command declares its options with
`add_argument` exactly as with argparse. `zoo ablate`, `zoo analyze` and `zoo plan` keep argparse: their
`--config` is already a training config (the base of the ablation; the data to probe; the run to plan), as
`zoo fit --config` is.
"""

from __future__ import annotations

from jsonargparse import ActionConfigFile, ArgumentParser

CONFIG_HELP = (
    "a YAML file of these options (keys: the options' names, dashes as underscores; positionals too); "
    "options given after it win. --print_config prints the options a run would use, as such a file"
)


def command_parser(prog: str, description: str) -> ArgumentParser:
    """An argparse-compatible parser for one `zoo` command, with `--config` and `--print_config`."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", action=ActionConfigFile, help=CONFIG_HELP)
    return parser
