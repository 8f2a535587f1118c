#!/usr/bin/env bash
# Pretrain GPT-2 XL (1.5B) on one node of 8 GPUs: ZeRO-2 over 8 data-parallel ranks, bf16.
# GPT-2 XL has 25 attention heads, so its only tensor-parallel sizes are 1, 5 and 25: keep TP=1.
#
# The first launch starts from scratch and later launches resume from CHECKPOINT_DIR (--save and --load
# name the same folder). The ranks rendezvous on 127.0.0.1 only.
#
# Environment (defaults in brackets):
#   DATA_PATH         [required unless MOCK_DATA=1] preprocessed data prefix(es), with optional blend weights: "0.7 a_text_document 0.3 b_text_document"
#   TOKENIZER_MODEL   [required unless MOCK_DATA=1] SentencePiece model used to preprocess the data
#   MOCK_DATA         [0]     1: random tokens instead of DATA_PATH (smoke tests; give --vocab-size in MODEL_ARGS)
#   MODEL_ARGS        [--model gpt2-xl]   the model flags (a smoke test passes a tiny shape instead)
#   CHECKPOINT_DIR    [checkpoints/gpt2-1.5b]   where checkpoints are saved and resumed from
#   TENSORBOARD_DIR   [runs/gpt2-1.5b]          TensorBoard event files
#   GPUS_PER_NODE     [8]     processes started on this node
#   MASTER_PORT       [a free port]   rendezvous port on 127.0.0.1
#   TP                [1]     tensor-model-parallel size (must divide 25 heads)
#   ZERO_STAGE        [2]
#   MICRO_BATCH       [8]
#   GLOBAL_BATCH      [512]
#   SEQ_LENGTH        [1024]
#   TRAIN_ITERS       [300000]
#   LR                [1.5e-4]
#   MIN_LR            [1.0e-5]
#   WARMUP_ITERS      [2000]
#   SAVE_INTERVAL     [1000]
#   EVAL_INTERVAL     [1000]
#   EVAL_ITERS        [10]
#   LOG_INTERVAL      [10]
#   EXTRA_ARGS        []      appended to the trainer's flags
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/data_args.sh"
MODEL_ARGS="${MODEL_ARGS:---model gpt2-xl}"
MASTER_PORT="${MASTER_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/gpt2-1.5b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-runs/gpt2-1.5b}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TP="${TP:-1}"
ZERO_STAGE="${ZERO_STAGE:-2}"
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-512}"
SEQ_LENGTH="${SEQ_LENGTH:-1024}"
TRAIN_ITERS="${TRAIN_ITERS:-300000}"
LR="${LR:-1.5e-4}"
MIN_LR="${MIN_LR:-1.0e-5}"
WARMUP_ITERS="${WARMUP_ITERS:-2000}"
SAVE_INTERVAL="${SAVE_INTERVAL:-1000}"
EVAL_INTERVAL="${EVAL_INTERVAL:-1000}"
EVAL_ITERS="${EVAL_ITERS:-10}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

# One node: the c10d rendezvous listens on the loopback address (torchrun --standalone would take any interface).
# shellcheck disable=SC2086
exec torchrun --nnodes 1 --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$MASTER_PORT" --rdzv-id "gpt2-1.5b-$MASTER_PORT" \
  -m hybrid.train \
  $MODEL_ARGS \
  --tensor-model-parallel-size "$TP" --zero-stage "$ZERO_STAGE" \
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 \
  --bf16 --recompute-activations --recompute-granularity selective \
  $DATA_ARGS \
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL" --keep-last 3 \
  --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --log-interval "$LOG_INTERVAL" \
  --tensorboard-dir "$TENSORBOARD_DIR" \
  $EXTRA_ARGS
