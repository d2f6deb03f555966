"""The CUDA backend: Triton kernels (``vivace.gpu.kernels``), the forward built from them
(``vivace.gpu.forward``) and the runner behind the engine's device seam (``vivace.gpu.runner``).

Nothing here is imported on the CPU path. Where torch sees no GPU, importing this package turns
Triton's interpreter on (``TRITON_INTERPRET=1``, unless set otherwise), before any kernel is
decorated: the kernels, the forward and the runner then run on CPU tensors, slowly. That is how
CI, which has no GPU, tests them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
