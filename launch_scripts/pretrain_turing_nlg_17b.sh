#!/usr/bin/env bash
# Pretrain the Turing-NLG 17B preset across nodes: TP=4 inside each node, ZeRO-1 data parallelism
# across nodes, fp16 with dynamic loss scaling. Run this script once per node (see
# slurm/pretrain_turing_nlg_17b.sbatch, which does that with srun).
#
# Environment (defaults in brackets):
#   DATA_PATH         [required] preprocessed data prefix(es), with optional blend weights
#   TOKENIZER_MODEL   [required] SentencePiece model used to preprocess the data
#   NNODES            [1]        number of nodes
#   NODE_RANK         [0]        this node's index, 0..NNODES-1
#   MASTER_ADDR       [127.0.0.1] host of node 0 (the c10d rendezvous endpoint)
#   MASTER_PORT       [29500]
#   GPUS_PER_NODE     [16]
#   RDZV_ID           [hybrid-tnlg]  rendezvous id shared by every node of one job
#   TP                [4]
#   ZERO_STAGE        [1]
#   MICRO_BATCH       [1]
#   GLOBAL_BATCH      [512]
#   TRAIN_ITERS       [300000]
#   LR                [1.0e-4]
#   MIN_LR            [1.0e-5]
#   WARMUP_ITERS      [2000]
#   CHECKPOINT_DIR    [checkpoints/turing-nlg-17b]
#   TENSORBOARD_DIR   [runs/turing-nlg-17b]
#   SAVE_INTERVAL     [500]
#   EXTRA_ARGS        []
set -euo pipefail
: "${DATA_PATH:?set DATA_PATH to the preprocessed data prefix (see tools/preprocess_data.py)}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model used for preprocessing}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-16}"
RDZV_ID="${RDZV_ID:-hybrid-tnlg}"
TP="${TP:-4}"
ZERO_STAGE="${ZERO_STAGE:-1}"
MICRO_BATCH="${MICRO_BATCH:-1}"
GLOBAL_BATCH="${GLOBAL_BATCH:-512}"
TRAIN_ITERS="${TRAIN_ITERS:-300000}"
LR="${LR:-1.0e-4}"
MIN_LR="${MIN_LR:-1.0e-5}"
WARMUP_ITERS="${WARMUP_ITERS:-2000}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/turing-nlg-17b}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-runs/turing-nlg-17b}"
SAVE_INTERVAL="${SAVE_INTERVAL:-500}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

# shellcheck disable=SC2086
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
  -m hybrid.train \
  --model turing-nlg-17b \
  --tensor-model-parallel-size "$TP" --zero-stage "$ZERO_STAGE" \
  --seq-length 1024 --max-position-embeddings 1024 \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" \
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 \
  --fp16 --initial-loss-scale 4294967296 --loss-scale-window 1000 --hysteresis 2 --min-loss-scale 1 \
  --recompute-activations --recompute-granularity full \
  --data-path $DATA_PATH --split 949,50,1 --tokenizer-model "$TOKENIZER_MODEL" \
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL" --keep-last 2 \
  --eval-interval 1000 --eval-iters 10 --log-interval 10 --tensorboard-dir "$TENSORBOARD_DIR" \
  $EXTRA_ARGS
