"""Using a trained model: the pipeline API (`zoo.pipeline`), strings, images and speech in and out; a
conversation is a list of `Turn`s (`Pipeline.chat`)."""

from zoo.datamodules.chat import Turn
from zoo.inference.pipeline import Pipeline, Speech, pipeline

__all__ = ["Pipeline", "Speech", "Turn", "pipeline"]
