"""The zoo's version, at the bottom of the house: `zoo.hub` writes it into every saved model's config, and
the package root re-exports it (a module of its own, so that the hub need not import the root)."""

__version__ = "0.1.0"
