"""The native kernels' AVX2 build (SIMDe, ``native.simde_target``) on a CPU with AVX-512, where
``vivace.layers.native`` would otherwise only ever build the AVX-512 one: the kernel tests run in a
child process whose CPU flags hide AVX-512, so the AVX2 loops (``half_tile_block`` of the
quantized GEMM, the attention kernels' 256-bit twins, the fused ops) are built and checked on
every machine CI draws, not only on AVX2 ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vivace.layers import native

REPO = Path(__file__).resolve().parents[2]
TESTS = ["test_gguf_blocks.py", "test_linear.py", "test_decode_attention.py", "test_prefill_attention.py",
         "test_fused.py"]
# The child: AVX-512 hidden before any kernel is built, every AVX-512 library's target checked to
# be the SIMDe build, then pytest over TESTS.
CHILD = """
import sys
import pytest
from vivace.layers import native
native.cpu_flags = lambda: frozenset(native.SIMDE_CPU_FLAGS)
for library in native.LIBRARIES.values():
    if any(flag.startswith("avx512") for flag in library.cpu_flags):
        built = native.target(library.cflags, library.cpu_flags, library.simde)
        assert built is not None and any(flag.startswith("-DVIVACE_SIMDE") for flag in built.cflags), library
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.cpu_has(native.AVX512_CPU_FLAGS), reason="this CPU runs the AVX2 build already"),
    pytest.mark.skipif(native.simde_target() is None, reason="needs AVX2, FMA, F16C and the simde-py headers"),
]


def test_kernel_tests_pass_on_the_avx2_build() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, *(str(REPO / "tests" / "layers" / name) for name in TESTS)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, f"{summary}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert " passed" in summary and "skipped" not in summary.split(" passed")[0], summary
