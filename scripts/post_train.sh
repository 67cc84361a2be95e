#!/usr/bin/env bash
# Post-training end to end on the tiny model (issue 18): pretraining, SFT, then the four RL stages, each stage
# initialised from the previous one's output (`init_from` in its config):
#
#   1. pretraining   configs/demo/{visual_tokenizer,audio_codec,vision_encoder,multimodal}.yaml (make demo's)
#                                                                                -> runs/demo/multimodal/latest/
#   2. SFT           configs/sft/tiny.yaml (the SFT stage; from the pretraining)   -> runs/sft/tiny/latest/
#   3. RL stage 1    configs/rl/stages/1_reasoning.yaml     (arithmetic chains)    -> runs/rl_stages/1_reasoning/latest/
#      RL stage 2    configs/rl/stages/2_multimodal.yaml    (image / speech captions)
#      RL stage 3    configs/rl/stages/3_instructions.yaml  (format constraints)
#      RL stage 4    configs/rl/stages/4_tools.yaml         (a calculator inside the rollout)
#
# Usage (from the repository root; `make post-train` runs it with the project's virtualenv):
#   scripts/post_train.sh                          # everything
#   SKIP_PRETRAIN=1 scripts/post_train.sh          # reuse runs/demo/multimodal (e.g. after `make demo`)
#   SKIP_PRETRAIN=1 SKIP_SFT=1 scripts/post_train.sh --trainer.max_steps=20   # RL stages only, shorter
#   SKIP_PRETRAIN=1 SFT_ARGS=--trainer.max_steps=20 scripts/post_train.sh --trainer.max_steps=5
#                                                  # the shortest chain after make demo: SFT and RL, a few steps
#   PRETRAIN_ARGS=--trainer.max_steps=5 SFT_ARGS=--trainer.max_steps=5 scripts/post_train.sh --trainer.max_steps=2
#                                                  # every stage a few steps: checks the chain, trains nothing
# Arguments after the script name go to every RL stage's `zoo fit`; PRETRAIN_ARGS (to each pretraining
# stage's) and SFT_ARGS (to SFT's) are split at spaces.
set -euo pipefail
ZOO=${ZOO:-zoo}
cd "$(dirname "$0")/.."
read -r -a pretrain_args <<< "${PRETRAIN_ARGS:-}"
read -r -a sft_args <<< "${SFT_ARGS:-}"

if [[ -z "${SKIP_PRETRAIN:-}" ]]; then
  "$ZOO" fit --config configs/demo/visual_tokenizer.yaml "${pretrain_args[@]}"
  "$ZOO" fit --config configs/demo/audio_codec.yaml "${pretrain_args[@]}"
  "$ZOO" fit --config configs/demo/vision_encoder.yaml "${pretrain_args[@]}"
  "$ZOO" fit --config configs/demo/multimodal.yaml "${pretrain_args[@]}"
fi
if [[ -z "${SKIP_SFT:-}" ]]; then
  "$ZOO" fit --config configs/sft/tiny.yaml "${sft_args[@]}"
fi
for stage in 1_reasoning 2_multimodal 3_instructions 4_tools; do
  "$ZOO" fit --config "configs/rl/stages/$stage.yaml" "$@"
done
