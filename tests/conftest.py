import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # `from tiny import save_tiny`

import torch  # noqa: E402

# tests/test_triton_kernels.py runs the Triton kernels interpreted on CPU tensors. triton reads the variable when it
# is imported (its own @triton.jit helpers), and importing transformers' models imports triton, so it is set here,
# before any of them. Without a GPU triton runs nothing but interpreted: no other test sees a difference.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models run faster on one thread (no fork-join per op); tests that time real models set their own.
torch.set_num_threads(1)
