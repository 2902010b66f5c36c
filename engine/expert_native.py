"""A compiled kernel for the routed experts: the whole expert MLP per (expert, rows) span in C++.

Why (measured on 2 cores, D=1024, I=256, fp32; figures in engine/expert_kernel.py): per expert,
torch's matmuls (MKL) leave time on the table at every row count m:
- m <= 4 (decode, small batches): a few matrix-vector products over 3 MB of weights from memory.
  The BLAS treats [m, 1024] x [1024, 512] as a small GEMM: per call it packs the weight, and its
  matrix-vector loops run at about the speed of memory from the cache, so reading an expert and
  computing with it do not overlap (~480 us per expert and core at m~2 where memory alone takes
  ~260 us). The dot products here (`proj`) stream each weight row once (4 rows of W x up to 4 rows
  of x in registers) with a software prefetch 16 KiB ahead.
- m > 4 (prefill; ~64 rows per expert at T=512): the BLAS packs the 2 MB weight per call for only
  m rows and cannot prefetch the next expert, so ~0.4 ms of each expert's ~1.5 ms per core waits
  on memory (45-72 GFLOP/s per core at m=17-100 in this loop). The tiles here (`projT`) transpose
  the expert's rows once (xt [D, m], 16 x 16 blocks in registers) and broadcast one weight at a
  time against 3 vectors of 16 rows: 8 rows of W x 48 rows of x = 24 accumulators, every weight
  read once from memory (the next 8 rows prefetched while these compute), the rows from L2. No
  packing, no horizontal sums: ~98-104 GFLOP/s per core at m >= 64 from memory, where MKL's
  dense [4096, 1024] x [1024, 768] reaches 91-95 on one core. Rows are padded to 8 (a half
  vector), not 16. Above 96 rows an expert is split into work items of whole blocks of 16 rows.
Both fuse silu(gate) * up * routing weight, and hand items to torch's own OpenMP threads one at a
time (the library resolves libgomp.so.1 to the one torch loaded), so no Python thread has to be
woken while torch's OpenMP workers still spin after the previous op. With index maps the kernel
reads each row straight from the token's row of x and writes it to its (token, k) row: no gathered
copy, no index_add.

Single core, 64 experts from memory (192 MB), ms, this kernel vs torch's per-expert matmuls, the
same run (min of 4): m=1 14.2 vs 18.8, m=4 15.7 vs 28.6, m=8 14.4 vs 32.2, m=17 26.6 vs 44.0,
m=64 65.7 vs 93.2 (98 vs 69 GFLOP/s), m=100 103 vs 132, m=200 202 vs 233, m=512 494 vs 571
(104 vs 90 GFLOP/s). Max abs difference to torch's fp32 ~4e-6 on outputs of magnitude ~1.

The tiles need AVX-512's 32 vector registers of 16 floats; built without AVX-512 (checked by
building for AVX2 here) they spill, so such a build computes with the dot products only and
`max_rows()` says 2 (where they are still ahead of the BLAS); the caller's torch matmuls take
experts with more rows.

It is built on first use with the system C++ compiler (~1.5 s, -O3 -march=native: it is compiled
on the machine that runs it) into a per-user cache keyed by the source, the flags and the CPU's
feature flags. Without a compiler, or if the build or load fails, `library()` returns None once
and for all and the caller keeps the torch path.

Layout it expects (all float32, contiguous): x [*, D], gate_up [S, 2I, D], down [S, D, I],
w [out rows] or NULL, out [*, D]; spans int64 [n, 4] = (slot, first x position, first out
position, rows); x_rows / out_rows int64 [positions] or NULL (position p is row p).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int vi8 __attribute__((vector_size(32)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define LD(p) (*(const v16u *)(p))

// The transposed tiles need 32 vector registers of 16 floats (AVX-512): elsewhere their accumulators spill
// (built for AVX2 here: 9-30x slower than the BLAS), the dot products take every expert and do well only up
// to lp_expert_max_rows() = 2 rows (AVX2: m=1,2 0.91x,0.95x the BLAS' time; m=4 1.7x); the caller's torch
// matmuls take the experts with more.
#if defined(__AVX512F__)
#define TILES 1
#else
#define TILES 0
#endif
// Rows of one expert up to which the dot products (proj) run, and above which the transposed tiles (projT):
// with 1-4 rows both are memory bound and the dot products read faster; from 5 rows the tiles win.
#define SMALL_ROWS 4
// Rows in one work item of the tiles: its transposed rows [D, MAX_P] and activations [2I, MAX_P] stay in L2.
#define MAX_P 96
// Rows of W per tile: 8 x (3 vectors of 16 rows) = 24 accumulators + 3 + 1 of the 32 vector registers.
#define RB 8
// Prefetch locality of the tiles' next weight rows (1: prefetcht2; measured ahead of t0 and nta).
#define PF_LOC 1

#if defined(__AVX512F__)
#include <immintrin.h>
static inline float hsum(v16 v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hsum(v16 v) {
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = v[i] + v[i + 8];
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}
#endif

// y[j, o] = sum_d W[o, d] x[j, d], j < M, o < O: R rows of W and M rows of x held in registers,
// the next rows of W prefetched `pf` rows ahead, one cache line per line read.
template <int R, int M>
static void proj_rm(const float *x, long ldx, const float *W, long O, long Din, float *y, long ldy, long pf) {
    for (long o = 0; o < O; o += R) {
        v16 acc[R][M];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) acc[r][j] = v16{};
        const float *w0 = W + o * Din;
        for (long d = 0; d < Din; d += 16) {
            for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (pf + r) * Din + d, 0, 0);
            v16 xv[M];
            for (int j = 0; j < M; j++) xv[j] = LD(x + j * ldx + d);
            for (int r = 0; r < R; r++) {
                v16 wv = LD(w0 + r * Din + d);
                for (int j = 0; j < M; j++) acc[r][j] += wv * xv[j];
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) y[j * ldy + o + r] = hsum(acc[r][j]);
    }
}

// Up to 8 rows of x against all of W (O a multiple of 4, Din of 16).
static void proj(const float *x, long ldx, int m, const float *W, long O, long Din, float *y, long ldy) {
    long pf = 16384 / (Din * 4);
    if (pf < 4) pf = 4;
    switch (m) {
    case 1: proj_rm<4, 1>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 2: proj_rm<4, 2>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 3: proj_rm<4, 3>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 4: proj_rm<4, 4>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 5: proj_rm<2, 5>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 6: proj_rm<2, 6>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 7: proj_rm<2, 7>(x, ldx, W, O, Din, y, ldy, pf); break;
    default: proj_rm<2, 8>(x, ldx, W, O, Din, y, ldy, pf); break;
    }
}

// ---- many rows: the rows transposed, weights broadcast -------------------------------------------

// exp for 8 floats (one rounding to the nearest power of two, a degree-7 polynomial, the power put into
// the exponent bits): within ~2 ulp; clamped so the result is a normal float, silu(a) for any a finite.
static inline v8 vexp8(v8 x) {
    const v8 hi = v8{} + 88.3f, lo = v8{} - 87.3f;
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    const float magic = 12582912.f;                                    // 1.5 * 2^23: rounds to an integer
    v8 n = (x * 1.44269504f + magic) - magic;
    v8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8 p = 1.f / 5040 + r * (1.f / 40320);
    p = 1.f / 720 + r * p;
    p = 1.f / 120 + r * p;
    p = 1.f / 24 + r * p;
    p = 1.f / 6 + r * p;
    p = 0.5f + r * p;
    p = 1.f + r * p;
    p = 1.f + r * p;
    vi8 e = __builtin_convertvector(n, vi8) << 23;
    return (v8)((vi8)p + e);
}

// yt[r, :16 NV + 8 H] = sum_d w0[r, d] xt[d, :16 NV + 8 H] for r < R: one weight at a time broadcast
// against NV vectors of 16 rows of x (and H of 8), R * (NV + H) accumulators in registers. pf: prefetch the
// next R rows of W, one line of each per 16 columns (they are read once, from memory).
template <int R, int NV, int H>
static inline void tileT(const float *w0, long Din, const float *xt, long P, float *yt, bool pf) {
    v16 acc[R][NV > 0 ? NV : 1];
    v8 acch[R];
    for (int r = 0; r < R; r++) {
        for (int v = 0; v < NV; v++) acc[r][v] = v16{};
        acch[r] = v8{};
    }
    for (long d0 = 0; d0 < Din; d0 += 16) {
        if (pf)
            for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (R + r) * Din + d0, 0, PF_LOC);
        for (int dd = 0; dd < 16; dd++) {
            const float *xr = xt + (d0 + dd) * P;
            v16 xv[NV > 0 ? NV : 1];
            v8 xh = H ? *(const v8 *)(xr + 16 * NV) : v8{};
            for (int v = 0; v < NV; v++) xv[v] = *(const v16 *)(xr + 16 * v);
            for (int r = 0; r < R; r++) {
                float b = w0[r * Din + d0 + dd];
                for (int v = 0; v < NV; v++) acc[r][v] += b * xv[v];
                if (H) acch[r] += b * xh;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int v = 0; v < NV; v++) *(v16 *)(yt + r * P + 16 * v) = acc[r][v];
        if (H) *(v8 *)(yt + r * P + 16 * NV) = acch[r];
    }
}

// yt[o, :n] = sum_d W[o, d] xt[d, :n] for o < O, n a multiple of 8 <= P (P a multiple of 16): per block of R
// rows of W, the columns in chunks of up to 3 vectors of 16 (+ one of 8); the block's weights come from
// memory in the first chunk (prefetched a block ahead) and from the cache in the others.
template <int R>
static void projT_rows(const float *W, long O, long Din, const float *xt, long P, long n, float *yt) {
    for (long o = 0; o + R <= O; o += R) {
        const float *w0 = W + o * Din;
        float *y0 = yt + o * P;
        long v = 0, nv = n / 16;
        for (; nv - v > 4; v += 3) tileT<R, 3, 0>(w0, Din, xt + 16 * v, P, y0 + 16 * v, v == 0);
        const float *x1 = xt + 16 * v;
        float *y1 = y0 + 16 * v;
        bool pf = v == 0;
        switch ((nv - v) * 2 + n / 8 % 2) {
        case 1: tileT<R, 0, 1>(w0, Din, x1, P, y1, pf); break;
        case 2: tileT<R, 1, 0>(w0, Din, x1, P, y1, pf); break;
        case 3: tileT<R, 1, 1>(w0, Din, x1, P, y1, pf); break;
        case 4: tileT<R, 2, 0>(w0, Din, x1, P, y1, pf); break;
        case 5: tileT<R, 2, 1>(w0, Din, x1, P, y1, pf); break;
        case 6: tileT<R, 3, 0>(w0, Din, x1, P, y1, pf); break;
        case 7: tileT<R, 2, 0>(w0, Din, x1, P, y1, pf); tileT<R, 1, 1>(w0, Din, x1 + 32, P, y1 + 32, false); break;
        case 8: tileT<R, 2, 0>(w0, Din, x1, P, y1, pf); tileT<R, 2, 0>(w0, Din, x1 + 32, P, y1 + 32, false); break;
        case 9: tileT<R, 2, 0>(w0, Din, x1, P, y1, pf); tileT<R, 2, 1>(w0, Din, x1 + 32, P, y1 + 32, false); break;
        }
    }
}

// O is a multiple of 16 (applies() checks D and I), so of RB.
static void projT(const float *W, long O, long Din, const float *xt, long P, long n, float *yt) {
    projT_rows<RB>(W, O, Din, xt, P, n, yt);
}

struct Job {
    const float *x, *gate_up, *down, *w;   // w [out rows] or NULL
    float *out;
    const int64_t *xmap, *omap;            // row of x / of out for position p: map[p], or p when NULL
    long D, I;
    long xrow(long p) const { return xmap ? xmap[p] : p; }
    long orow(long p) const { return omap ? omap[p] : p; }
};

// dst[l][doff + i] = src[i][soff + l] for l < ndst, i < 16, where rows i >= nsrc of src read as zeros: one
// 16 x 16 block transposed in registers.
static inline void tr16(const float *const *src, int nsrc, long soff, float *const *dst, int ndst, long doff) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = i < nsrc ? _mm512_loadu_ps(src[i] + soff) : _mm512_setzero_ps();
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 16; i += 8)
        for (int c = 0; c < 4; c++) {
            t[i + c] = _mm512_shuffle_f32x4(r[i + c], r[i + 4 + c], 0x88);
            t[i + 4 + c] = _mm512_shuffle_f32x4(r[i + c], r[i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
        r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd);
    }
    for (int l = 0; l < ndst; l++) _mm512_storeu_ps(dst[l] + doff, r[l]);
#else
    for (int l = 0; l < ndst; l++)
        for (int i = 0; i < 16; i++) dst[l][doff + i] = i < nsrc ? src[i][soff + l] : 0.f;
#endif
}

// m rows of one expert s at positions x0.., out0.. (SMALL_ROWS < m <= MAX_P): x's rows transposed into
// xt [D, P] (zero past m), G^T = Wgu xt [2I, n], H^T = silu(G^T gate) * G^T up * w [I, n] in place, out^T =
// Wdown H^T [D, n] into ot, then transposed into out's rows; n = m rounded up to 8, P to 16.
static void big_span(const Job &J, long s, long x0, long out0, long m, float *xt, float *gt, float *ot) {
    long D = J.D, I = J.I, P = (m + 15) / 16 * 16, n = (m + 7) / 8 * 8;
    const float *src[16];
    float *dst[16];
    for (long j0 = 0; j0 < P; j0 += 16) {              // xt: x's rows (zeros past m), 16 x 16 at a time
        int valid = (int)(m - j0 < 16 ? m - j0 : 16);
        for (int i = 0; i < valid; i++) src[i] = J.x + J.xrow(x0 + j0 + i) * D;
        for (int l = 0; l < 16; l++) dst[l] = xt + l * P + j0;
        for (long d0 = 0; d0 < D; d0 += 16) tr16(src, valid, d0, dst, 16, d0 * P);
    }
    projT(J.gate_up + s * 2 * I * D, 2 * I, D, xt, P, n, gt);
    for (long v = 0; v < n; v += 8) {
        v8 wv;
        for (int l = 0; l < 8; l++) wv[l] = v + l < m ? (J.w ? J.w[J.orow(out0 + v + l)] : 1.f) : 0.f;
        for (long k = 0; k < I; k++) {
            v8 a = *(v8 *)(gt + k * P + v), u = *(v8 *)(gt + (I + k) * P + v);
            *(v8 *)(gt + k * P + v) = a / (1.f + vexp8(-a)) * u * wv;
        }
    }
    projT(J.down + s * D * I, D, I, gt, P, n, ot);
    for (long j0 = 0; j0 < m; j0 += 16) {              // ot's first m columns into out's rows
        int valid = (int)(m - j0 < 16 ? m - j0 : 16);
        for (int i = 0; i < 16; i++) src[i] = ot + i * P + j0;
        for (int l = 0; l < valid; l++) dst[l] = J.out + J.orow(out0 + j0 + l) * D;
        for (long d0 = 0; d0 < D; d0 += 16) tr16(src, 16, d0 * P, dst, valid, d0);
    }
}

// m <= SMALL_ROWS rows through the dot products (proj), in groups of 8; rows gathered into / scattered
// from xs when the positions are mapped.
static void small_span(const Job &J, long s, long x0, long out0, long m, float *g, float *h, float *xs) {
    long D = J.D, I = J.I;
    for (long j0 = 0; j0 < m; j0 += 8) {
        int mm = (int)(m - j0 > 8 ? 8 : m - j0);
        const float *xin = J.x + (x0 + j0) * D;
        if (J.xmap) {
            for (int j = 0; j < mm; j++)
                for (long d = 0; d < D; d++) xs[j * D + d] = J.x[J.xrow(x0 + j0 + j) * D + d];
            xin = xs;
        }
        proj(xin, D, mm, J.gate_up + s * 2 * I * D, 2 * I, D, g, 2 * I);
        for (int j = 0; j < mm; j++) {
            float wj = J.w ? J.w[J.orow(out0 + j0 + j)] : 1.f;
            const float *gj = g + j * 2 * I;
            for (long k = 0; k < I; k++) {
                float a = gj[k];
                h[j * I + k] = a / (1.f + expf(-a)) * gj[I + k] * wj;
            }
        }
        float *y = J.omap ? xs : J.out + (out0 + j0) * D;
        proj(h, I, mm, J.down + s * D * I, D, I, y, D);
        if (J.omap)
            for (int j = 0; j < mm; j++)
                for (long d = 0; d < D; d++) J.out[J.orow(out0 + j0 + j) * D + d] = xs[j * D + d];
    }
}

// Work items a span of m rows is split into: at most MAX_P rows each (the last part, which takes the rows
// past a multiple of 16, gets the fewest blocks of 16: at most MAX_P - 16 + 15 rows).
static long n_parts(long m) { return !TILES || m <= SMALL_ROWS ? 1 : (m + MAX_P - 1) / MAX_P; }

// The most rows per expert this build computes well; -1: any.
extern "C" long lp_expert_max_rows(void) { return TILES ? -1 : 2; }

// For each span (slot, first x position, first out position, rows) and each row j of it:
// out[orow(o0 + j)] = down_s(silu(gate_s(x[xrow(x0 + j)])) * up_s(...)) * w[orow(o0 + j)].
// Spans split into work items (n_parts), handed out one at a time to `threads` threads: a thread
// descheduled by another process (the cores are shared) leaves its remaining items to the others instead
// of holding up the layer. Returns nonzero when out of memory.
extern "C" int lp_expert_spans(const float *x, const float *gate_up, const float *down, const float *w,
                               float *out, const int64_t *xmap, const int64_t *omap, long D, long I,
                               const int64_t *spans, long n, int threads) {
    const Job J{x, gate_up, down, w, out, xmap, omap, D, I};
    long items = 0;
    for (long i = 0; i < n; i++) items += n_parts(spans[4 * i + 3]);
    int64_t *it = (int64_t *)malloc(sizeof(int64_t) * 4 * (items ? items : 1));
    if (!it) return 1;
    long k = 0;
    for (long i = 0; i < n; i++) {
        const int64_t *sp = spans + 4 * i;
        long m = sp[3], parts = n_parts(m), blocks = m / 16, done = 0;
        for (long p = 0; p < parts; p++, k++) {      // whole blocks of 16 rows, the fewest and the rest last
            long b = (blocks + parts - p - 1) / (parts - p), mm = p == parts - 1 ? m - done : 16 * b;
            blocks -= b;
            it[4 * k] = sp[0], it[4 * k + 1] = sp[1] + done, it[4 * k + 2] = sp[2] + done, it[4 * k + 3] = mm;
            done += mm;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1) reduction(| : failed)
    {
        size_t small = 8 * (3 * I + D), big = (size_t)MAX_P * (2 * D + 2 * I);
        float *g = (float *)aligned_alloc(64, sizeof(float) * (small + big));
        float *xt = g + small, *gt = xt + MAX_P * D, *ot = gt + MAX_P * 2 * I;
        if (!g) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < items; i++) {
            const int64_t *t = it + 4 * i;
            if (!g) continue;
            if (TILES && t[3] > SMALL_ROWS) big_span(J, t[0], t[1], t[2], t[3], xt, gt, ot);
            else small_span(J, t[0], t[1], t[2], t[3], g, g + 16 * I, g + 24 * I);
        }
        free(g);
    }
    free(it);
    return failed;
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (Path(base) / "loadplan", Path(tempfile.gettempdir()) / f"loadplan-{os.getuid()}"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache directory for the expert kernel")


def _compile(cxx: str, flags: list[str], so: Path) -> None:
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        src, out = Path(tmp) / "expert_native.cpp", Path(tmp) / so.name
        src.write_text(SOURCE)
        subprocess.run([cxx, *flags, str(src), "-o", str(out), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(out, so)                                    # atomic: concurrent builders race harmlessly


def _build() -> ctypes.CDLL:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise OSError("no C++ compiler")
    d = _cache_dir()
    errors = []
    for flags in (_FLAGS + ["-fopenmp"], _FLAGS):             # without OpenMP: one thread
        key = hashlib.sha256("\0".join([SOURCE, cxx, *flags, _cpu_key()]).encode()).hexdigest()[:20]
        so = d / f"expert_native_{key}.so"
        try:
            if not so.exists():
                _compile(cxx, flags, so)
            lib = ctypes.CDLL(str(so))
        except (OSError, subprocess.SubprocessError) as e:
            stderr = getattr(e, "stderr", None)
            errors.append(f"{' '.join(flags)}: {stderr.decode(errors='replace').strip() if stderr else e}")
            continue
        lib.lp_expert_max_rows.restype = ctypes.c_long
        lib.lp_expert_max_rows.argtypes = []
        f = lib.lp_expert_spans
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                              ctypes.c_int]
        return lib
    raise OSError("; ".join(errors))


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on the first call; None (and one warning) if it cannot be built."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    with _LOCK:
        if not _TRIED:
            try:
                _LIB = _build()
            except Exception as e:  # any failure: the torch path computes the same
                warnings.warn(f"expert kernel: compiled kernel unavailable, using torch matmuls ({e})",
                              RuntimeWarning, stacklevel=2)
            _TRIED = True
    return _LIB


def max_rows() -> int | None:
    """The most rows of one expert the compiled kernel computes well (None: any, with AVX-512; else 2, see
    TILES in SOURCE); experts with more are left to torch's matmuls. 0 without the kernel."""
    lib = library()
    if lib is None:
        return 0
    n = lib.lp_expert_max_rows()
    return None if n < 0 else n


def applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether run_spans can compute these tensors (float32, contiguous, on the CPU, sizes multiples of 16,
    nothing to differentiate)."""
    D, I = down.shape[1], down.shape[2]
    return (x.dtype == gate_up.dtype == down.dtype == torch.float32
            and x.device.type == gate_up.device.type == down.device.type == "cpu"
            and gate_up.is_contiguous() and down.is_contiguous()
            and gate_up.shape[1:] == (2 * I, D) and x.shape[-1] == D and D % 16 == 0 and I % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad or down.requires_grad))
            and library() is not None)


def run_spans(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, w: torch.Tensor | None,
              out: torch.Tensor, spans: list[tuple[int, int, int, int]], x_rows: torch.Tensor | None = None,
              out_rows: torch.Tensor | None = None) -> None:
    """out[o(r0 + j)] = down_s(silu(gate_s(x[i(x0 + j)])) * up_s(x[i(x0 + j)])) * w[o(r0 + j)] for (s, x0, r0, m)
    in spans, j < m, where i(p) = x_rows[p] (p if None) and o(p) = out_rows[p] (p if None); on torch's intra-op
    threads. x and out contiguous [*, D]; w float32 contiguous [*] or None; x_rows, out_rows int64 [*]."""
    if not spans:
        return
    assert x.is_contiguous() and out.is_contiguous() and out.dtype == torch.float32
    assert w is None or (w.is_contiguous() and w.dtype == torch.float32)
    maps = []
    for m in (x_rows, out_rows):
        assert m is None or (m.dtype == torch.int64 and m.is_contiguous())
        maps.append(None if m is None else m.data_ptr())
    t = torch.tensor(spans, dtype=torch.int64)                 # [n, 4]
    D, I = down.shape[1], down.shape[2]
    rc = library().lp_expert_spans(x.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                                   None if w is None else w.data_ptr(), out.data_ptr(), *maps, D, I, t.data_ptr(),
                                   len(spans), torch.get_num_threads())
    if rc:
        raise MemoryError("expert kernel: out of memory for its scratch rows")
