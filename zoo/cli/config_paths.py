"""Where `zoo` finds a recipe: a config path as given, else the copy shipped inside the package.

The recipes live in the checkout's `configs/`. The package holds them as `zoo/configs` (in git a link to
`../configs`, so there is one copy; in a wheel the files themselves). So `zoo fit --config
configs/quickstart.yaml` works in a checkout (the path is found in the working directory) and from any
directory after a wheel install: a relative `.yaml` path that does not exist where `zoo` runs is looked up in
the packaged configs (as `configs/presets/small.yaml` or as `presets/small.yaml`), and a line on stderr says
which file is used. Absolute paths and files that exist are never replaced. Because the resolved path is
absolute, whatever a packaged config names relative to itself resolves beside it, as it does in a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIG_SUFFIXES = (".yaml", ".yml")
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def packaged_configs() -> Path:
    """The recipes shipped with the zoo: `zoo/configs` (a wheel, or a checkout where git made the link), else
    the checkout's `configs/` beside the package (a checkout whose file system keeps links as plain files)."""
    inside = PACKAGE_DIR / "configs"
    return inside if inside.is_dir() else PACKAGE_DIR.parent / "configs"


def packaged_config(value: str) -> Path | None:
    """The packaged file a relative config path names when it does not exist here, or None."""
    path = Path(value)
    if path.suffix not in CONFIG_SUFFIXES or path.is_absolute() or path.exists():
        return None
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if not parts or ".." in parts:
        return None
    candidate = packaged_configs().joinpath(*parts)
    return candidate if candidate.is_file() else None


def with_packaged_configs(argv: list[str]) -> list[str]:
    """`argv` with every config path that is missing here but shipped with the zoo made absolute: a bare
    argument (`--config X.yaml`, `--data X.yaml`) or the value of `--flag=X.yaml`."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        found = packaged_config(value) if (eq or not arg.startswith("-")) else None
        if found is None:
            out.append(arg)
            continue
        print(f"zoo: {value} is not in {Path.cwd()}; using the packaged {found}", file=sys.stderr)
        out.append(f"{flag}={found}" if eq else str(found))
    return out
