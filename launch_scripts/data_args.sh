#!/usr/bin/env bash
# Sourced by the pretraining scripts: sets DATA_ARGS from MOCK_DATA, DATA_PATH and TOKENIZER_MODEL.
MOCK_DATA="${MOCK_DATA:-0}"
if [ "$MOCK_DATA" = "1" ]; then
  DATA_ARGS="--mock-data"
else
  : "${DATA_PATH:?set DATA_PATH to the preprocessed data prefix (see tools/preprocess_data.py), or MOCK_DATA=1}"
  : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model used for preprocessing}"
  DATA_ARGS="--data-path $DATA_PATH --split 949,50,1 --tokenizer-model $TOKENIZER_MODEL"
fi
