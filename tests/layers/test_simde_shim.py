"""The AVX2 build's own intrinsics (``vivace/layers/simde_avx512.h``, force-included before the
native sources on a CPU without AVX-512): each against numpy, built the way ``native`` builds a
library there, on any CPU with AVX2. A masked load or store must not touch the lanes its mask
leaves out: checked against a guard page, where a touch is a crash."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vivace.layers import native

pytestmark = pytest.mark.skipif(native.simde_target() is None, reason="needs AVX2, FMA, F16C and the simde-py headers")

SOURCE = r"""
#include <cstdint>
#include <cstring>

extern "C" {
void t_dpbusd(const int32_t* acc, const uint8_t* u, const int8_t* s, int32_t* out, int small) {
  const __m512i a = _mm512_loadu_si512(acc), w = _mm512_loadu_si512(u), x = _mm512_loadu_si512(s);
  _mm512_storeu_si512(out, small ? vivace_simde::dpbusd_small(a, w, x) : _mm512_dpbusd_epi32(a, w, x));
}
void t_maskz_load(const float* src, unsigned k, float* out) {
  _mm512_storeu_ps(out, _mm512_maskz_loadu_ps(static_cast<__mmask16>(k), src));
}
void t_mask_store(float* dst, unsigned k, const float* src) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>(k), _mm512_loadu_ps(src));
}
void t_maskz_load16(const uint16_t* src, unsigned k, uint16_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_maskz_loadu_epi16(static_cast<__mmask16>(k), src));
}
void t_mask_store16(uint16_t* dst, unsigned k, const uint16_t* src) {
  _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>(k), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
void t_floats(const float* x, uint16_t* halves, float* sum) {
  const __m512 v = _mm512_loadu_ps(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  *sum = _mm512_reduce_add_ps(v);
}
void t_ints(const int32_t* x, const int8_t* b, int16_t* narrowed, int32_t* widened, int32_t* sum) {
  const __m512i v = _mm512_loadu_si512(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(narrowed), _mm512_cvtepi32_epi16(v));
  _mm512_storeu_si512(widened, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
  *sum = _mm512_reduce_add_epi32(v);
}
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    build_dir = tmp_path_factory.mktemp("simde") / "build"
    source = build_dir.parent / "shim_check.cpp"
    source.write_text(SOURCE)
    assert native._build_and_load(source, native.simde_target(), build_dir, "check")
    (library,) = build_dir.glob("*.so")
    return ctypes.CDLL(str(library))


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def test_dpbusd_is_exact_over_every_code(shim: ctypes.CDLL) -> None:
    rng = np.random.default_rng(0)
    for small, top in ((0, 256), (1, 64)):
        for _ in range(50):
            acc = rng.integers(-2**20, 2**20, 16, dtype=np.int32)
            u = rng.integers(0, top, 64, dtype=np.uint8)
            s = rng.integers(-128, 128, 64, dtype=np.int8)
            u[:4], s[:4] = top - 1, -128  # the extremes: no saturation anywhere
            out = np.empty(16, np.int32)
            shim.t_dpbusd(ptr(acc), ptr(u), ptr(s), ptr(out), small)
            expected = acc + (u.astype(np.int32) * s.astype(np.int32)).reshape(16, 4).sum(1)
            np.testing.assert_array_equal(out, expected)


def test_masked_loads_and_stores_keep_to_their_lanes(shim: ctypes.CDLL) -> None:
    src = np.arange(1, 17, dtype=np.float32)
    for k in (0x0001, 0x00FF, 0x0100, 0xA5C3, 0x7FFF, 0xFFFF):
        keep = np.array([k >> i & 1 for i in range(16)], bool)
        out = np.empty(16, np.float32)
        shim.t_maskz_load(ptr(src), k, ptr(out))
        np.testing.assert_array_equal(out, np.where(keep, src, 0))
        dst = np.full(16, -1, np.float32)
        shim.t_mask_store(ptr(dst), k, ptr(src))
        np.testing.assert_array_equal(dst, np.where(keep, src, -1))
        half_src = np.arange(1, 17, dtype=np.uint16)
        half_out = np.empty(16, np.uint16)
        shim.t_maskz_load16(ptr(half_src), k, ptr(half_out))
        np.testing.assert_array_equal(half_out, np.where(keep, half_src, 0))
        half_dst = np.full(16, 9, np.uint16)
        shim.t_mask_store16(ptr(half_dst), k, ptr(half_src))
        np.testing.assert_array_equal(half_dst, np.where(keep, half_src, 9))


_GUARD = """
import ctypes, mmap, sys
lib, page = ctypes.CDLL(sys.argv[1]), mmap.PAGESIZE
region = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None)
assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # the second page: no access
for lanes, width, load, store in ((5, 4, lib.t_maskz_load, lib.t_mask_store),
                                  (5, 2, lib.t_maskz_load16, lib.t_mask_store16)):
    tail = ctypes.c_void_p(base + page - lanes * width)  # 5 lanes before the guard, 11 past it
    out = (ctypes.c_char * 64)()
    load(tail, (1 << lanes) - 1, out)
    store(tail, (1 << lanes) - 1, out)
print("ok")
"""


def test_a_row_tail_before_a_guard_page(shim: ctypes.CDLL) -> None:
    result = subprocess.run([sys.executable, "-c", _GUARD, shim._name], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


def test_conversions_and_reductions(shim: ctypes.CDLL) -> None:
    x = np.array([-3.75, -2.5, -1.0, -0.25, 0.0, 0.3, 1.5, 2.5, 7.9, 1e-8, -1e-8, 65504.0, 1.0009765625,
                  1.00048828125, 100.125, -0.5], np.float32)
    halves, total = np.empty(16, np.uint16), np.zeros(1, np.float32)
    shim.t_floats(ptr(x), ptr(halves), ptr(total))
    np.testing.assert_array_equal(halves, x.astype(np.float16).view(np.uint16))  # round to nearest even
    assert total[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-6)
    ints = np.array([0, 1, -1, 32767, 32768, -32769, 65535, 65536 + 5, 2**31 - 1, -2**31, 7, -7, 123456,
                     -123456, 300, -300], np.int32)
    b = np.arange(-8, 8, dtype=np.int8) * 16
    narrowed, widened, isum = np.empty(16, np.int16), np.empty(16, np.int32), np.zeros(1, np.int32)
    shim.t_ints(ptr(ints), ptr(b), ptr(narrowed), ptr(widened), ptr(isum))
    np.testing.assert_array_equal(narrowed, ints.astype(np.int16))  # truncation, as VPMOVDW
    np.testing.assert_array_equal(widened, b.astype(np.int32))
    assert isum[0] == np.array(ints.astype(np.int64).sum()).astype(np.int32)  # wrapping, as VPADDD
