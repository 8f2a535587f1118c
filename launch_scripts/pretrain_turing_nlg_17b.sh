#!/usr/bin/env bash
# Pretrain the Turing-NLG 17B preset across nodes: TP=4 inside each node, ZeRO-1 data parallelism
# across nodes, fp16 with dynamic loss scaling. Run this script once per node (see
# slurm/pretrain_turing_nlg_17b.sbatch, which does that with srun). The first launch starts from
# scratch and later launches resume from CHECKPOINT_DIR (--save and --load name the same folder).
#
# Environment (defaults in brackets):
#   DATA_PATH         [required unless MOCK_DATA=1] preprocessed data prefix(es), with optional blend weights
#   TOKENIZER_MODEL   [required unless MOCK_DATA=1] SentencePiece model used to preprocess the data
#   MOCK_DATA         [0]        1: random tokens instead of DATA_PATH (smoke tests; give --vocab-size in MODEL_ARGS)
#   MODEL_ARGS        [--model turing-nlg-17b]   the model flags (a smoke test passes a tiny shape instead)
#   SEQ_LENGTH        [1024]
#   NNODES            [1]        number of nodes
#   NODE_RANK         [0]        this node's index, 0..NNODES-1
#   MASTER_ADDR       [127.0.0.1] host of node 0 (the c10d rendezvous endpoint unless RDZV_HOST is set)
#   MASTER_PORT       [29500]
#   RDZV_HOST         [$MASTER_ADDR] address of the node that hosts the c10d rendezvous, as every node reaches it
#   LOCAL_ADDR        []         this node's address as the other nodes reach it (torchrun --local-addr);
#                                set it where host names do not resolve across nodes (or all resolve to 127.0.0.1)
#   LOCAL_ADDR_IFACE  []         instead of LOCAL_ADDR: advertise this node's IPv4 address on that interface (e.g. ib0)
#   RDZV_IS_HOST      [auto]     1 on the rendezvous host, 0 elsewhere (--rdzv-conf is_host=...); auto: 1 where
#                                LOCAL_ADDR equals RDZV_HOST, 0 where LOCAL_ADDR is set and differs, else torchrun's
#                                own host-name check
#   GPUS_PER_NODE     [16]
#   RDZV_ID           [hybrid-tnlg]  rendezvous id shared by every node of one job
#   TP                [4]
#   PP                [1]        pipeline stages (outermost in the rank order: one stage spans whole nodes, so
#                                only activations cross between them); DP = world / (TP x PP)
#   PIPELINE_SCHEDULE [1f1b]     1f1b, gpipe, or interleaved (then set VIRTUAL_STAGE_LAYERS)
#   VIRTUAL_STAGE_LAYERS []      interleaved: layers per model chunk (--num-layers-per-virtual-pipeline-stage)
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
#   EVAL_INTERVAL     [1000]
#   EVAL_ITERS        [10]
#   LOG_INTERVAL      [10]
#   EXTRA_ARGS        []
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/data_args.sh"
MODEL_ARGS="${MODEL_ARGS:---model turing-nlg-17b}"
SEQ_LENGTH="${SEQ_LENGTH:-1024}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-16}"
RDZV_ID="${RDZV_ID:-hybrid-tnlg}"
RDZV_HOST="${RDZV_HOST:-$MASTER_ADDR}"
LOCAL_ADDR="${LOCAL_ADDR:-}"
if [ -z "$LOCAL_ADDR" ] && [ -n "${LOCAL_ADDR_IFACE:-}" ]; then
  LOCAL_ADDR=$(ip -4 -o addr show dev "$LOCAL_ADDR_IFACE" 2>/dev/null | sed -n 's/.* inet \([0-9.]*\).*/\1/p' | head -n 1 || true)
  : "${LOCAL_ADDR:?LOCAL_ADDR_IFACE=$LOCAL_ADDR_IFACE has no IPv4 address here; name an interface that has one (ip -4 addr)}"
fi
RDZV_IS_HOST="${RDZV_IS_HOST:-}"
if [ -z "$RDZV_IS_HOST" ] && [ -n "$LOCAL_ADDR" ]; then
  RDZV_IS_HOST=$([ "$LOCAL_ADDR" = "$RDZV_HOST" ] && echo 1 || echo 0)
fi
case "$RDZV_IS_HOST" in
  ""|0|1) ;;
  *) echo "RDZV_IS_HOST=$RDZV_IS_HOST: set it to 1 on the rendezvous host, 0 elsewhere, or leave it unset" >&2; exit 2 ;;
esac
# Rendezvous options beyond the endpoint: only those set, so that torchrun's defaults stay otherwise.
RDZV_ARGS=""
[ -n "$RDZV_IS_HOST" ] && RDZV_ARGS="--rdzv-conf is_host=$RDZV_IS_HOST"
[ -n "$LOCAL_ADDR" ] && RDZV_ARGS="$RDZV_ARGS --local-addr $LOCAL_ADDR"
TP="${TP:-4}"
PP="${PP:-1}"
PIPELINE_SCHEDULE="${PIPELINE_SCHEDULE:-1f1b}"
VIRTUAL_STAGE_LAYERS="${VIRTUAL_STAGE_LAYERS:-}"
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
EVAL_INTERVAL="${EVAL_INTERVAL:-1000}"
EVAL_ITERS="${EVAL_ITERS:-10}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

# shellcheck disable=SC2086
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$MASTER_PORT" --rdzv-id "$RDZV_ID" $RDZV_ARGS \
  -m hybrid.train \
  $MODEL_ARGS \
  --tensor-model-parallel-size "$TP" --zero-stage "$ZERO_STAGE" \
  --pipeline-model-parallel-size "$PP" --pipeline-schedule "$PIPELINE_SCHEDULE" \
  ${VIRTUAL_STAGE_LAYERS:+--num-layers-per-virtual-pipeline-stage "$VIRTUAL_STAGE_LAYERS"} \
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" \
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 \
  --fp16 --initial-loss-scale 4294967296 --loss-scale-window 1000 --hysteresis 2 --min-loss-scale 1 \
  --recompute-activations --recompute-granularity full \
  $DATA_ARGS \
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL" --keep-last 2 \
  --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --log-interval "$LOG_INTERVAL" \
  --tensorboard-dir "$TENSORBOARD_DIR" \
  $EXTRA_ARGS
