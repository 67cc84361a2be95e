"""`python -m zoo.cli ...`: the same as the `zoo` console script."""

from zoo.cli import console_main

console_main()
