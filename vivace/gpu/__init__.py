"""The CUDA backend: Triton kernels (``vivace.gpu.kernels``), the forward built from them
(``vivace.gpu.forward``) and the runner behind the engine's device seam (``vivace.gpu.runner``).

Nothing here is imported on the CPU path. The kernels also run on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set before ``vivace.gpu.kernels`` is first imported): that
is how CI, which has no GPU, tests them.
"""
