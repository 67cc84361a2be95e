# The two commands of the README: `make demo` and `make test`. Both create or update .venv first, with the
# exact versions CI tests (constraints.txt; pyproject.toml holds the compatible ranges).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-video post-train test test-slow lint bench wheel-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The main job: a visual tokenizer, an audio codec and a vision encoder, then the unified model on ShapesWorld text, images
# and speech, then the gallery of what it generates and understands (runs/demo/multimodal/latest/gallery/gallery.md).
demo: $(STAMP)
	$(BIN)/zoo fit --config configs/demo/visual_tokenizer.yaml
	$(BIN)/zoo fit --config configs/demo/audio_codec.yaml
	$(BIN)/zoo fit --config configs/demo/vision_encoder.yaml
	$(BIN)/zoo fit --config configs/demo/multimodal.yaml

# The video demo (issue 19): the causal 3D tokenizer inflated from the demo's 2D one, then the tiny unified model
# on ShapesWorld clips (caption to video, video to caption through the vision encoder, captions) and its gallery
# (runs/demo/video/latest/gallery/gallery.md). Needs `make demo`'s first and third stages (its 2D visual
# tokenizer and its vision encoder, under runs/demo/): run `make demo` first.
demo-video: $(STAMP)
	$(BIN)/zoo fit --config configs/demo/video_tokenizer.yaml
	$(BIN)/zoo fit --config configs/demo/video.yaml

# Post-training end to end (issue 18): pretraining (the demo's stages), SFT, then RL stages 1-4
# (configs/rl/stages/), each from the previous one's output; see scripts/post_train.sh for shorter runs.
post-train: $(STAMP)
	ZOO=$(BIN)/zoo scripts/post_train.sh

# Two workers, one torch thread each (tests/conftest.py says how files are grouped); the 20 slowest tests listed.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=20

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# Build the wheel, install it into a fresh virtual environment outside the checkout, train two steps there.
wheel-check: $(STAMP)
	PYTHON=$(PYTHON) BUILD_PYTHON=$(BIN)/python .ci/wheel_check

lint: $(STAMP)
	$(BIN)/ruff check zoo tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/moe_dispatch.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/elastic.py
	$(BIN)/python benchmarks/nfsp.py

clean:
	rm -rf $(VENV) lightning_logs runs build dist
