"""Using a trained model: the pipeline API (`zoo.pipeline`), strings, images and speech in and out."""

from zoo.inference.pipeline import Pipeline, Speech, pipeline

__all__ = ["Pipeline", "Speech", "pipeline"]
