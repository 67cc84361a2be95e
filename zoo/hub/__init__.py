"""Publishing the unified model and reading training checkpoints (safetensors + JSON config + model card).

timm's split (STYLE.md): `save_pretrained` writes a complete, offline directory; `push_to_hub` only uploads
it. DESIGN.md, "Hub": `config.json` holds our own `class_path`/`init_args` spec, and `from_pretrained`
rebuilds it through an allow-list (only `Configurable` classes defined under `zoo.`), importing nothing
a downloaded config names before that check; weights load with `strict=True`. Nothing is unpickled.

    save_pretrained(model, "out/", tokenizer=tok, datasets=["shapes-world"], metrics={"val/loss": 2.1})
    save_pretrained(model, "out/", components={"visual_tokenizer": "user/zoo-vt"})  # named, not copied
    model = zoo.load_pretrained("out/")             # or a hub repo id; pulls the components it names
    tokenizer = load_tokenizer("out/")
    push_to_hub(model, "user/zoo-tiny", tokenizer=tok)

- `unified.py`: the unified model's folder (save, card, push, load).
- `components.py`: the component folders a unified folder names instead of carrying their weights.
- `checkpoints.py`: Lightning checkpoints of every task, read weights-only, to a model or a component.
The components' own folders (`VisualTokenizer.save_pretrained`, ...) are `zoo.publishing`'s.
"""

from zoo.hub.checkpoints import (
    TOKENIZER_KEY,
    checkpoint_tokenizer_json,
    components_named_by_weights,
    holds_unified_model,
    load_checkpoint_component,
    load_lightning_checkpoint,
    read_lightning_checkpoint,
)
from zoo.hub.components import UNIFIED_COMPONENTS
from zoo.hub.unified import (
    FORMAT,
    from_pretrained,
    load_config,
    load_tokenizer,
    load_weights,
    model_card,
    push_to_hub,
    save_pretrained,
)
from zoo.publishing.building import build_from_config, resolve_class
from zoo.publishing.layout import CARD_NAME, CONFIG_NAME, LIBRARY_NAME, TOKENIZER_NAME, WEIGHTS_NAME
from zoo.publishing.transfer import resolve
from zoo.trust import UnsafeConfigError

load_pretrained = from_pretrained

__all__ = [
    "CARD_NAME", "CONFIG_NAME", "FORMAT", "LIBRARY_NAME", "TOKENIZER_KEY", "TOKENIZER_NAME",
    "UNIFIED_COMPONENTS", "WEIGHTS_NAME", "UnsafeConfigError", "build_from_config",
    "checkpoint_tokenizer_json", "components_named_by_weights", "from_pretrained", "holds_unified_model",
    "load_checkpoint_component", "load_config",
    "load_lightning_checkpoint", "load_pretrained", "load_tokenizer", "load_weights", "model_card",
    "push_to_hub", "read_lightning_checkpoint", "resolve", "resolve_class", "save_pretrained",
]  # fmt: skip
