"""Publishing any zoo component: a folder of JSON config, safetensors weights and a model card, read back
without executing code, pushed to and pulled from the Hugging Face Hub.

The foundation of the house (layer 0), so that the component classes themselves (the tokenizers, the vision
encoder, the refiner) carry `save_pretrained` / `from_pretrained` / `push_to_hub`; `zoo.hub` (layer 4)
builds the unified model's folder on the same pieces.

- `layout.py`: the file names and formats of a folder, and reading its config.
- `building.py`: rebuilding `{class_path, init_args}` trees through the allow-list (`zoo.trust`).
- `cards.py`: model cards with the Hub's metadata (pipeline tag, library, datasets, model-index results).
- `transfer.py`: a local folder or a hub id to a local folder; the push (an existing card is kept).
- `component.py`: `PretrainedComponent`, the mixin of every publishable component, and `load_component`.
"""
