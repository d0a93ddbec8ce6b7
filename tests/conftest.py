import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # `from tiny import save_tiny`

import torch  # noqa: E402

# Tiny models run faster on one thread (no fork-join per op); tests that time real models set their own.
torch.set_num_threads(1)
