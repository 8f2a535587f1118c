#!/usr/bin/env bash
# The main job: pretrain the `tiny` GPT (or MODEL) on this machine's CPUs, end to end, with nothing downloaded.
#   1. builds a corpus from the docstrings of the Python standard library (tools/make_stdlib_corpus.py)
#   2. trains a SentencePiece tokenizer and preprocesses the corpus into an indexed dataset
#   3. pretrains with TP=2 x DP=2 and ZeRO-1 on 4 CPU processes (torchrun, gloo); PP=2 makes it TP=2 x PP=2;
#      an MoE preset (MODEL=tiny-moe) runs its experts expert-parallel: EP=2 by default, with sequence parallelism;
#      CP=2 splits each sequence over 2 context-parallel ranks (TP=2 x CP=2, ring attention) and keeps attention
#      inside each packed document (--reset-attention-mask)
#   4. writes TensorBoard logs and checkpoints
#   5. prints where they are and a text sample from the trained model
# It sets up .venv on first use (launch_scripts/setup_env.sh).
#
# Environment (defaults in brackets):
#   WORK_DIR        [runs/VARIANT] everything the run writes; each variant has its own folder: runs/MODEL, plus
#                                 -tpN, -ppN, -cpN, -zeroN, -npN for a TP, PP, CP, ZERO_STAGE or NPROC other than the
#                                 default (runs/tiny, runs/tiny-gqa, runs/tiny-pp2, ...). A folder holding
#                                 another variant's checkpoints is refused, naming WORK_DIR: this script
#                                 starts from scratch and would overwrite them
#   MODEL           [tiny]        model_zoo preset: tiny (GPT-2 style), llama-tiny, tiny-gqa (Llama 3 style:
#                                 grouped-query attention, 8 query heads sharing 2 key/value heads, RoPE scaling),
#                                 or tiny-moe (Mixture of Experts: 4 experts, top-2, every layer)
#   NPROC           [4]           processes (CPU ranks)
#   MASTER_PORT     [a free port] rendezvous port on 127.0.0.1
#   TP              [2]           tensor-model-parallel size
#   PP              [1]           pipeline-parallel size (stages; DP = NPROC / (TP x CP x PP))
#   CP              [1]           context-parallel size (--context-parallel-size: each sequence split over CP
#                                 ranks; above 1 also --reset-attention-mask); -cpN in the folder name
#   EP              [2 for an MoE preset, else 1]  expert-parallel size (divides DP; -epN in the folder name
#                                 when not the default)
#   ZERO_STAGE      [1]
#   COMPILE         [0]           1: --torch-compile, each transformer block compiled by torch.compile (the same
#                                 run and checkpoints; inductor's cache under WORK_DIR/checkpoints/compile-cache,
#                                 docs/compile.md)
#   TRAIN_ITERS     [300]         optimizer steps (CI lowers it)
#   MICRO_BATCH     [4]
#   GLOBAL_BATCH    [16]
#   SEQ_LENGTH      [128]
#   VOCAB_SIZE      [4096]        SentencePiece vocabulary
#   LR              [3e-3]
#   EVAL_INTERVAL   [50]
#   LOG_INTERVAL    [10]
#   SAVE_INTERVAL   [100]
#   MAX_DOCUMENTS   [0]           cap on corpus documents (0: all docstrings)
#   MAX_NEW_TOKENS  [40]          length of the continuation printed at the end (greedy: the most likely
#                                 token at each step, so the same checkpoint always prints the same text)
#   SETUP           [1]           0 skips the virtual-environment set-up (use the active Python)
#   EXTRA_ARGS      []            appended to the trainer's flags
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-tiny}"
NPROC="${NPROC:-4}"
TP="${TP:-2}"
PP="${PP:-1}"
CP="${CP:-1}"
ZERO_STAGE="${ZERO_STAGE:-1}"
VARIANT="$MODEL"
if [ "$TP" != 2 ]; then VARIANT="$VARIANT-tp$TP"; fi
if [ "$PP" != 1 ]; then VARIANT="$VARIANT-pp$PP"; fi
if [ "$CP" != 1 ]; then VARIANT="$VARIANT-cp$CP"; fi
if [ "$ZERO_STAGE" != 1 ]; then VARIANT="$VARIANT-zero$ZERO_STAGE"; fi
case "$MODEL" in *moe*) EP_DEFAULT=2 ;; *) EP_DEFAULT=1 ;; esac
EP="${EP:-$EP_DEFAULT}"
if [ "$EP" != "$EP_DEFAULT" ]; then VARIANT="$VARIANT-ep$EP"; fi
if [ "$NPROC" != 4 ]; then VARIANT="$VARIANT-np$NPROC"; fi
WORK_DIR="${WORK_DIR:-runs/$VARIANT}"
TRAIN_ITERS="${TRAIN_ITERS:-300}"
MICRO_BATCH="${MICRO_BATCH:-4}"
GLOBAL_BATCH="${GLOBAL_BATCH:-16}"
SEQ_LENGTH="${SEQ_LENGTH:-128}"
VOCAB_SIZE="${VOCAB_SIZE:-4096}"
LR="${LR:-3e-3}"
EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
MAX_DOCUMENTS="${MAX_DOCUMENTS:-0}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-40}"
SETUP="${SETUP:-1}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

# What makes a run another run's: the trainer starts from scratch here and would overwrite its checkpoints.
# (EP and CP only when above 1: the key of a run without them, and so its folder's record, stays what it was)
EP_KEY=""
if [ "$EP" != 1 ]; then EP_KEY=" EP=$EP"; fi
CP_KEY=""
if [ "$CP" != 1 ]; then CP_KEY=" CP=$CP"; fi
RUN_KEY="MODEL=$MODEL TP=$TP PP=$PP$CP_KEY$EP_KEY ZERO_STAGE=$ZERO_STAGE NPROC=$NPROC SEQ_LENGTH=$SEQ_LENGTH VOCAB_SIZE=$VOCAB_SIZE"
RUN_FILE="$WORK_DIR/demo_run.txt"
if [ -e "$WORK_DIR/checkpoints/latest" ] && [ "$(cat "$RUN_FILE" 2>/dev/null)" != "$RUN_KEY" ]; then
  held="$(cat "$RUN_FILE" 2>/dev/null || echo "a run this script did not record")"
  echo "pretrain_gpt_tiny.sh: WORK_DIR=$WORK_DIR holds the checkpoints of another run ($held), which this one" \
       "($RUN_KEY) would overwrite: set WORK_DIR to a new folder, or delete $WORK_DIR/checkpoints" >&2
  exit 1
fi
echo "hybrid demo: pretraining $MODEL on $NPROC CPU processes (TP=$TP, PP=$PP,${CP_KEY:+$CP_KEY,}${EP_KEY:+$EP_KEY,}" \
     "ZeRO-$ZERO_STAGE)" \
     "into $WORK_DIR"
if [ "$SETUP" = "1" ]; then
  source launch_scripts/setup_env.sh
fi
# An MoE model splits its tokens over the TP ranks (sequence parallelism) before routing them: docs/moe.md
MOE_ARGS=""
if [ "$EP" != 1 ]; then MOE_ARGS="--expert-model-parallel-size $EP"; fi
if [ "$EP_DEFAULT" = 2 ] && [ "$TP" != 1 ]; then MOE_ARGS="$MOE_ARGS --sequence-parallel"; fi
# Context parallelism with document masking: each rank holds 2 of the 2 x CP chunks of every sequence, and the
# end-of-document tokens the preprocessing appended (--append-eod) separate the documents (docs/context_parallel.md)
CP_ARGS=""
if [ "$CP" != 1 ]; then CP_ARGS="--context-parallel-size $CP --reset-attention-mask"; fi
COMPILE_ARGS=""
if [ "${COMPILE:-0}" = 1 ]; then COMPILE_ARGS="--torch-compile"; fi
MASTER_PORT="${MASTER_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
mkdir -p "$WORK_DIR"
echo "$RUN_KEY" >"$RUN_FILE"
stage() { printf '\n== %s\n' "$1"; STAGE_START=$(date +%s.%N); }
stage_done() { awk -v a="$STAGE_START" -v b="$(date +%s.%N)" 'BEGIN { printf "   (%.1f s)\n", b - a }'; }

stage "1/4 corpus from the standard library's docstrings"
python tools/make_stdlib_corpus.py --output "$WORK_DIR/corpus.jsonl" --max-documents "$MAX_DOCUMENTS"
stage_done

stage "2/4 SentencePiece tokenizer (vocab $VOCAB_SIZE) and preprocessing"
python tools/train_tokenizer.py --input "$WORK_DIR/corpus.jsonl" --output-prefix "$WORK_DIR/tokenizer" \
  --vocab-size "$VOCAB_SIZE" --model-type bpe --no-progress
python tools/preprocess_data.py --input "$WORK_DIR/corpus.jsonl" --tokenizer-model "$WORK_DIR/tokenizer.model" \
  --output-prefix "$WORK_DIR/corpus" --append-eod --workers 2 --no-progress
stage_done

stage "3/4 pretraining $MODEL: $NPROC CPU processes, TP=$TP, PP=$PP,${CP_KEY:+$CP_KEY,}${EP_KEY:+$EP_KEY,} ZeRO-$ZERO_STAGE, $TRAIN_ITERS iterations"
# One intra-op thread per rank: the ranks already share the cores. The c10d rendezvous listens on the
# loopback address only (torchrun --standalone would take any interface).
# shellcheck disable=SC2086
OMP_NUM_THREADS=1 torchrun --nnodes 1 --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$MASTER_PORT" --rdzv-id "tiny-$MASTER_PORT" -m hybrid.train \
  --model "$MODEL" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --zero-stage "$ZERO_STAGE" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
  --lr "$LR" --min-lr "$(python -c "print($LR / 10)")" --lr-decay-style cosine \
  --lr-warmup-iters "$((TRAIN_ITERS / 20 + 1))" --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "$WORK_DIR/corpus_text_document" --split 90,5,5 --tokenizer-model "$WORK_DIR/tokenizer.model" \
  --save "$WORK_DIR/checkpoints" --save-interval "$SAVE_INTERVAL" --keep-last 2 \
  --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --log-interval "$LOG_INTERVAL" --log-params-norm \
  --log-num-zeros-in-grad --tensorboard-dir "$WORK_DIR/tensorboard" --seed 1234 $MOE_ARGS $CP_ARGS $COMPILE_ARGS $EXTRA_ARGS
stage_done

stage "4/4 a sample from the trained model (greedy: the most likely next token each time)"
python -m hybrid.training.generate --load "$WORK_DIR/checkpoints" --tokenizer-model "$WORK_DIR/tokenizer.model" \
  --prompt "Return the" --max-new-tokens "$MAX_NEW_TOKENS" --greedy
stage_done

cat <<MSG

Done.
  checkpoints:  $WORK_DIR/checkpoints (latest: $(cat "$WORK_DIR/checkpoints/latest"))
  TensorBoard:  $WORK_DIR/tensorboard
  view with:    tensorboard --logdir $WORK_DIR/tensorboard
MSG
