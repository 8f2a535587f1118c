"""``python -m hybrid.train``: pretrain a GPT with TP x DP x ZeRO (run under torchrun). See docs/training.md."""

import sys

from hybrid.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
