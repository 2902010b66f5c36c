// The compiled routed-experts kernel (engine/expert_native.py builds it with torch.utils.cpp_extension and
// calls it as torch.ops.loadplan_experts.spans / max_rows). Why it is shaped like this: expert_native.py.
//
// Layout it expects (all float32, contiguous): x [*, D], gate_up [S, 2I, D], down [S, D, I], w [out rows] or
// none, out [*, D]; spans int64 [n, 4] = (slot, first x position, first out position, rows); x_rows /
// out_rows int64 [positions] or none (position p is row p).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int vi8 __attribute__((vector_size(32)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define LD(p) (*(const v16u *)(p))
typedef uint16_t bf16;                                   // bfloat16: the upper half of a float32
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// 16 weights (or rows of x) as float32: float32 as they are, bfloat16 widened (exact: shifted into the upper half).
static inline v16 load16(const float *p) { return LD(p); }
static inline v16 load16(const bf16 *p) {
    return (v16)(__builtin_convertvector(*(const u16x16u *)p, u32x16) << 16);
}
static inline float load1(const float *p) { return *p; }
static inline float load1(const bf16 *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
// float32 -> bfloat16, rounded to the nearest even (as torch's .to(torch.bfloat16)); nan stays nan.
static inline bf16 to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// The transposed tiles (projT) come in two shapes: with AVX-512's 32 registers of 16 floats, 8 rows of W x 3
// vectors of 16 rows of x (tileT); with AVX2's 16 registers of 8 floats, 4 rows of W x 3 vectors of 8 rows
// (tile8; the AVX-512 tiles built for AVX2 spill their accumulators: 9-30x slower than the BLAS).
#if defined(__AVX512F__)
#define AVX512_TILES 1
#else
#define AVX512_TILES 0
#endif
#define TILES 1
// Rows of one expert up to which the dot products (proj) run, and above which the transposed tiles (projT):
// with 1-4 rows both are memory bound and the dot products read faster; from 5 rows the tiles win (AVX-512). On
// AVX2 (an EPYC 7003, one thread, 8 experts from memory, fastest of 40, ms float32 / bfloat16): the dot products
// m=1 1.46 / 1.00, m=4 1.97 / 1.04, m=5 2.79 / 1.53, m=8 3.05 / 1.97 (rows 5-8: two passes over the weights, the
// second from L3); the tiles m=5 3.21 / 3.31, m=8 3.29 / 3.32: there the dot products take up to 8 rows.
#ifndef SMALL_ROWS
#if defined(__AVX512F__)
#define SMALL_ROWS 4
#else
#define SMALL_ROWS 8
#endif
#endif
// Rows in one work item of the tiles: its transposed rows [D, MAX_P] and activations [2I, MAX_P] stay in L2.
#define MAX_P 96
// Rows of W per tile: 8 x (3 vectors of 16 rows) = 24 accumulators + 3 + 1 of the 32 vector registers.
#define RB 8
// The dot products' software prefetch of the weight rows SMALL_PF bytes ahead (0: none), with locality
// SMALL_PF_LOC (0: prefetchnta ... 3: prefetcht0). Measured on a 2-core Sapphire Rapids VM (one thread, T=1 from
// memory, 8 experts of 3 MB): prefetchnta 9.1-10.0 ms (it starves the L2 streamer), none 1.96-2.1, prefetcht2 8 KiB
// ahead 2.1-2.2, prefetcht0 16 KiB ahead 1.93-2.5; at T=16 prefetcht0 13.3, t2 13.8, none 19.7 ms.
#ifndef SMALL_PF
#define SMALL_PF 16384
#endif
#ifndef SMALL_PF_LOC
#define SMALL_PF_LOC 3
#endif
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
template <int R, int M, typename WT>
static void proj_rm(const float *x, long ldx, const WT *W, long O, long Din, float *y, long ldy, long pf) {
    for (long o = 0; o < O; o += R) {
        v16 acc[R][M];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) acc[r][j] = v16{};
        const WT *w0 = W + o * Din;
        for (long d = 0; d < Din; d += 16) {
            // one prefetch per cache line: every 16 floats, every 32 bfloat16s
            if (SMALL_PF && (sizeof(WT) == 4 || d % 32 == 0))
                for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (pf + r) * Din + d, 0, SMALL_PF_LOC);
            v16 xv[M];
            for (int j = 0; j < M; j++) xv[j] = LD(x + j * ldx + d);
            for (int r = 0; r < R; r++) {
                v16 wv = load16(w0 + r * Din + d);
                for (int j = 0; j < M; j++) acc[r][j] += wv * xv[j];
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) y[j * ldy + o + r] = hsum(acc[r][j]);
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define AVX2_BF16_DOTS 1
// bfloat16 weights on AVX2, written out: the vector extension's 16-wide widening (above) compiles to spills there
// (bfloat16 read at half the float32 rate). 16 weights widen with one unpack per 8 (zeros as the low halves): the
// 8 of the low unpack are weights 0-3 and 8-11 of the 16, the high 4-7 and 12-15, so x comes in that order (xp:
// each block of 16 permuted alike, see proj). R rows of W x M rows of x, low and high halves summed apart.
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <int R, int M, typename WT>
static void proj_avx2(const float *xp, long ldx, const WT *W, long O, long Din, float *y, long ldy, long pf) {
    const __m256i zero = _mm256_setzero_si256();
    (void)zero;
    for (long o = 0; o < O; o += R) {
        __m256 lo[R][M], hi[R][M];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) lo[r][j] = hi[r][j] = _mm256_setzero_ps();
        const WT *w0 = W + o * Din;
        for (long d = 0; d < Din; d += 16) {
            if (SMALL_PF && (sizeof(WT) == 4 || d % 32 == 0))
                for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (pf + r) * Din + d, 0, SMALL_PF_LOC);
            __m256 xl[M], xh[M];
            for (int j = 0; j < M; j++) {
                xl[j] = _mm256_loadu_ps(xp + j * ldx + d);
                xh[j] = _mm256_loadu_ps(xp + j * ldx + d + 8);
            }
            for (int r = 0; r < R; r++) {
                __m256 wl, wh;
                if constexpr (sizeof(WT) == 2) {
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(w0 + r * Din + d));
                    wl = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, wv));
                    wh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, wv));
                } else {
                    wl = _mm256_loadu_ps((const float *)w0 + r * Din + d);
                    wh = _mm256_loadu_ps((const float *)w0 + r * Din + d + 8);
                }
                for (int j = 0; j < M; j++) {
                    lo[r][j] = _mm256_fmadd_ps(wl, xl[j], lo[r][j]);
                    if (M <= 2) hi[r][j] = _mm256_fmadd_ps(wh, xh[j], hi[r][j]);
                    else lo[r][j] = _mm256_fmadd_ps(wh, xh[j], lo[r][j]);      // 3-4 rows: registers for 6-8 sums
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) y[j * ldy + o + r] = hsum8(_mm256_add_ps(lo[r][j], hi[r][j]));
    }
}

#ifndef DOT_R1
#define DOT_R1 4                           // rows of W per pass for one row of x
#endif
// m rows of x (up to 8) in groups of 4, 3, 2 or 1.
template <typename WT>
static void proj_avx2_rows(const float *x, long ldx, int m, const WT *W, long O, long Din, float *y, long ldy,
                           long pf) {
    for (int j0 = 0; j0 < m;) {
        int left = m - j0;
        const float *xj = x + j0 * ldx;
        float *yj = y + j0 * ldy;
        if (left >= 4) proj_avx2<2, 4>(xj, ldx, W, O, Din, yj, ldy, pf), j0 += 4;
        else if (left == 3) proj_avx2<2, 3>(xj, ldx, W, O, Din, yj, ldy, pf), j0 += 3;
        else if (left == 2) proj_avx2<2, 2>(xj, ldx, W, O, Din, yj, ldy, pf), j0 += 2;
        else proj_avx2<DOT_R1, 1>(xj, ldx, W, O, Din, yj, ldy, pf), j0 += 1;
    }
}
#else
#define AVX2_BF16_DOTS 0
#endif

// Up to 8 rows of x against all of W (O a multiple of 4, Din of 16).
template <typename WT>
static void proj(const float *x, long ldx, int m, const WT *W, long O, long Din, float *y, long ldy) {
    long pf = SMALL_PF / (Din * (long)sizeof(WT));
    if (pf < 4) pf = 4;
#if AVX2_BF16_DOTS
    if constexpr (sizeof(WT) == 2) {
        // x's rows in the order of the widened weights: per block of 16, elements 0-3, 8-11, then 4-7, 12-15
        float *xp = (float *)__builtin_alloca(sizeof(float) * 8 * Din + 64);
        xp = (float *)(((uintptr_t)xp + 63) & ~(uintptr_t)63);
        for (int j = 0; j < m; j++)
            for (long d = 0; d < Din; d += 16)
                for (int q = 0; q < 4; q++) {
                    xp[j * Din + d + q] = x[j * ldx + d + q], xp[j * Din + d + 4 + q] = x[j * ldx + d + 8 + q];
                    xp[j * Din + d + 8 + q] = x[j * ldx + d + 4 + q];
                    xp[j * Din + d + 12 + q] = x[j * ldx + d + 12 + q];
                }
        proj_avx2_rows(xp, Din, m, W, O, Din, y, ldy, pf);
        return;
    } else {
        // float32 weights: the same loop, x as it is (the vector extension's 16-wide version reads at half the rate)
        proj_avx2_rows(x, ldx, m, W, O, Din, y, ldy, pf);
        return;
    }
#endif
    switch (m) {
    case 1: proj_rm<4, 1>(x, ldx, W, O, Din, y, ldy, pf); break;
#if defined(__AVX512F__)
    case 2: proj_rm<4, 2>(x, ldx, W, O, Din, y, ldy, pf); break;
#else
    case 2: proj_rm<2, 2>(x, ldx, W, O, Din, y, ldy, pf); break;      // 4 x 2 accumulators of 16: registers spill
#endif
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

// AVX2's tile: yt[r, :8 NV] = sum_d w0[r, d] xt[d, :8 NV] for r < R (R = 4, NV <= 3: 12 accumulators, 3 rows of
// x and the broadcast weight in the 16 registers).
template <int R, int NV>
static inline void tile8(const float *w0, long Din, const float *xt, long P, float *yt, bool pf) {
    v8 acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = v8{};
    for (long d0 = 0; d0 < Din; d0 += 16) {
        if (pf)
            for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (R + r) * Din + d0, 0, PF_LOC);
        for (int dd = 0; dd < 16; dd++) {
            const float *xr = xt + (d0 + dd) * P;
            v8 xv[NV];
            for (int v = 0; v < NV; v++) xv[v] = *(const v8 *)(xr + 8 * v);
            for (int r = 0; r < R; r++) {
                float b = w0[r * Din + d0 + dd];
                for (int v = 0; v < NV; v++) acc[r][v] += b * xv[v];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) *(v8 *)(yt + r * P + 8 * v) = acc[r][v];
}

// Rows of W per block of the tiles: AVX-512 8 x (3 vectors of 16 rows) = 24 accumulators + 3 + 1 of the 32
// registers; AVX2 4 x (3 vectors of 8) = 12 + 3 + 1 of the 16.
#define RB8 4
#if AVX512_TILES
#define RBT RB
#else
#define RBT RB8
#endif

// One block of RBT rows of W (w0, float32: in W itself, or widened from bfloat16 into scratch) against n columns
// of xt, into y0 [RBT, P]; the columns in chunks of up to 3 vectors (+ one of 8 on AVX-512); the block's weights
// come from memory in the first chunk (prefetched a block ahead when pf) and from the cache in the others.
static inline void tiles_block(const float *w0, long Din, const float *xt, long P, long n, float *y0, bool pf) {
    constexpr int R = RBT;
#if AVX512_TILES
    long v = 0, nv = n / 16;
    for (; nv - v > 4; v += 3) tileT<R, 3, 0>(w0, Din, xt + 16 * v, P, y0 + 16 * v, pf && v == 0);
    const float *x1 = xt + 16 * v;
    float *y1 = y0 + 16 * v;
    pf = pf && v == 0;
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
#else
    long v = 0, nv = n / 8;
    for (; nv - v >= 3; v += 3) tile8<R, 3>(w0, Din, xt + 8 * v, P, y0 + 8 * v, pf && v == 0);
    if (nv - v == 2) tile8<R, 2>(w0, Din, xt + 8 * v, P, y0 + 8 * v, pf && v == 0);
    else if (nv - v == 1) tile8<R, 1>(w0, Din, xt + 8 * v, P, y0 + 8 * v, pf && v == 0);
#endif
}

// dst[0 : cnt] = src[0 : cnt] as float32 (cnt a multiple of 32), prefetching the line `ahead` elements on.
static inline void widen(const bf16 *src, long cnt, float *dst, long ahead) {
    for (long i = 0; i < cnt; i += 32) {
        __builtin_prefetch(src + ahead + i, 0, PF_LOC);
        *(v16u *)(dst + i) = load16(src + i);
        *(v16u *)(dst + i + 16) = load16(src + i + 16);
    }
}

// yt[o, :n] = sum_d W[o, d] xt[d, :n] for o < O (a multiple of 16, so of RBT), n a multiple of 8 <= P (P a
// multiple of 16). bfloat16 weights are widened one block of rows at a time into wscr [RBT, Din] (in L1/L2),
// prefetching the next block meanwhile; float32 weights are read where they are.
template <typename WT>
static void projT(const WT *W, long O, long Din, const float *xt, long P, long n, float *yt, float *wscr) {
    for (long o = 0; o + RBT <= O; o += RBT) {
        if constexpr (sizeof(WT) == 4) {
            tiles_block((const float *)W + o * Din, Din, xt, P, n, yt + o * P, true);
        } else {
            widen(W + o * Din, RBT * Din, wscr, RBT * Din);
            tiles_block(wscr, Din, xt, P, n, yt + o * P, false);
        }
    }
}

template <typename T>
struct Job {
    const T *x, *gate_up, *down;           // float32 or bfloat16, alike
    const float *w;                        // [out rows] or NULL
    float *out;                            // float32 always: the caller sums and rounds
    const int64_t *xmap, *omap;            // row of x / of out for position p: map[p], or p when NULL
    long D, I;
    long xrow(long p) const { return xmap ? xmap[p] : p; }
    long orow(long p) const { return omap ? omap[p] : p; }
};

// dst[l][doff + i] = src[i][soff + l] for l < ndst, i < 16, where rows i >= nsrc of src read as zeros: one
// 16 x 16 block transposed in registers (bfloat16 sources widened).
template <typename ST>
static inline void tr16(const ST *const *src, int nsrc, long soff, float *const *dst, int ndst, long doff) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = i < nsrc ? (__m512)load16(src[i] + soff) : _mm512_setzero_ps();
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
        for (int i = 0; i < 16; i++) dst[l][doff + i] = i < nsrc ? load1(src[i] + soff + l) : 0.f;
#endif
}

// m rows of one expert s at positions x0.., out0.. (SMALL_ROWS < m <= MAX_P): x's rows transposed into
// xt [D, P] (zero past m), G^T = Wgu xt [2I, n], H^T = silu(G^T gate) * G^T up * w [I, n] in place, out^T =
// Wdown H^T [D, n] into ot, then transposed into out's rows; n = m rounded up to 8, P to 16.
template <typename T>
static void big_span(const Job<T> &J, long s, long x0, long out0, long m, float *xt, float *gt, float *ot,
                     float *wscr) {
    long D = J.D, I = J.I, P = (m + 15) / 16 * 16, n = (m + 7) / 8 * 8;
    const T *src[16];
    const float *srcf[16];
    float *dst[16];
    for (long j0 = 0; j0 < P; j0 += 16) {              // xt: x's rows (zeros past m), 16 x 16 at a time
        int valid = (int)(m - j0 < 16 ? m - j0 : 16);
        for (int i = 0; i < valid; i++) src[i] = J.x + J.xrow(x0 + j0 + i) * D;
        for (int l = 0; l < 16; l++) dst[l] = xt + l * P + j0;
        for (long d0 = 0; d0 < D; d0 += 16) tr16(src, valid, d0, dst, 16, d0 * P);
    }
    projT(J.gate_up + s * 2 * I * D, 2 * I, D, xt, P, n, gt, wscr);
    for (long v = 0; v < n; v += 8) {
        v8 wv;
        for (int l = 0; l < 8; l++) wv[l] = v + l < m ? (J.w ? J.w[J.orow(out0 + v + l)] : 1.f) : 0.f;
        for (long k = 0; k < I; k++) {
            v8 a = *(v8 *)(gt + k * P + v), u = *(v8 *)(gt + (I + k) * P + v);
            *(v8 *)(gt + k * P + v) = a / (1.f + vexp8(-a)) * u * wv;
        }
    }
    projT(J.down + s * D * I, D, I, gt, P, n, ot, wscr);
    for (long j0 = 0; j0 < m; j0 += 16) {              // ot's first m columns into out's rows
        int valid = (int)(m - j0 < 16 ? m - j0 : 16);
        for (int i = 0; i < 16; i++) srcf[i] = ot + i * P + j0;
        for (int l = 0; l < valid; l++) dst[l] = J.out + J.orow(out0 + j0 + l) * D;
        for (long d0 = 0; d0 < D; d0 += 16) tr16(srcf, 16, d0 * P, dst, valid, d0);
    }
}

// ---- bfloat16 dot products on AVX-512 BF16 (vdpbf16ps), chosen at run time ----------------------------------
// Built for every x86-64 target (the function's own target attribute), run only where the CPU has AVX-512 BF16
// (checked when the library loads, then checked against the widening dot products on a small product: any
// difference and they are not used), unless LOADPLAN_EXPERTS_NO_DPBF16 is set. x and W both bfloat16, summed in
// float32: each vdpbf16ps adds a[2i] b[2i] + a[2i+1] b[2i+1] into lane i; the activations h are rounded to
// bfloat16 for the down projection (as transformers' bfloat16 experts compute them).
#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>
#define DP_TARGET __attribute__((target("avx512f,avx512bf16")))
template <int R, int M>
DP_TARGET static void proj_dp_rm(const bf16 *x, long ldx, const bf16 *W, long O, long Din, float *y, long ldy,
                                 long pf) {
    for (long o = 0; o < O; o += R) {
        __m512 acc[R][M];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) acc[r][j] = _mm512_setzero_ps();
        const bf16 *w0 = W + o * Din;
        for (long d = 0; d < Din; d += 32) {
            if (SMALL_PF)
                for (int r = 0; r < R; r++) __builtin_prefetch(w0 + (pf + r) * Din + d, 0, SMALL_PF_LOC);
            __m512bh xv[M];
            for (int j = 0; j < M; j++) xv[j] = (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + d));
            for (int r = 0; r < R; r++) {
                __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w0 + r * Din + d));
                for (int j = 0; j < M; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, xv[j]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int j = 0; j < M; j++) y[j * ldy + o + r] = _mm512_reduce_add_ps(acc[r][j]);
    }
}

DP_TARGET static void proj_dp(const bf16 *x, long ldx, int m, const bf16 *W, long O, long Din, float *y, long ldy) {
    long pf = SMALL_PF / (Din * 2);
    if (pf < 4) pf = 4;
    switch (m) {
    case 1: proj_dp_rm<4, 1>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 2: proj_dp_rm<4, 2>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 3: proj_dp_rm<4, 3>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 4: proj_dp_rm<4, 4>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 5: proj_dp_rm<2, 5>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 6: proj_dp_rm<2, 6>(x, ldx, W, O, Din, y, ldy, pf); break;
    case 7: proj_dp_rm<2, 7>(x, ldx, W, O, Din, y, ldy, pf); break;
    default: proj_dp_rm<2, 8>(x, ldx, W, O, Din, y, ldy, pf); break;
    }
}

static bool dp_bf16_check() {
    // 2 rows of x [2, 64] against W [8, 64]: the dot products of bfloat16 values of few bits are exact in float32
    // both ways, so any difference is a wrong result.
    bf16 x[2 * 64], W[8 * 64];
    float xf[2 * 64], y1[2 * 8], y2[2 * 8];
    for (int i = 0; i < 2 * 64; i++) x[i] = to_bf16((float)((i * 7) % 13 - 6) * 0.25f), xf[i] = load1(x + i);
    for (int i = 0; i < 8 * 64; i++) W[i] = to_bf16((float)((i * 5) % 11 - 5) * 0.5f);
    proj_dp(x, 64, 2, W, 8, 64, y1, 8);
    proj(xf, 64, 2, W, 8, 64, y2, 8);
    return memcmp(y1, y2, sizeof y1) == 0;
}

static int dp_bf16_state() {
    static int state = -1;                 // -1 unknown, 0 not used, 1 used
    if (state < 0) {
        __builtin_cpu_init();
        const char *off = getenv("LOADPLAN_EXPERTS_NO_DPBF16");
        state = __builtin_cpu_supports("avx512bf16") && !(off && *off) && dp_bf16_check() ? 1 : 0;
    }
    return state;
}
#else
static int dp_bf16_state() { return 0; }
static void proj_dp(const bf16 *, long, int, const bf16 *, long, long, float *, long) {}
#endif

// m <= SMALL_ROWS rows through the dot products (proj), in groups of 8; rows gathered into / scattered
// from xs when the positions are mapped (and widened to float32 when bfloat16, or kept bfloat16 in xb for the
// AVX-512 BF16 dot products).
template <typename T>
static void small_span(const Job<T> &J, long s, long x0, long out0, long m, float *g, float *h, float *xs, bf16 *xb,
                       bf16 *hb) {
    long D = J.D, I = J.I;
    constexpr bool BF = sizeof(T) == 2;
    const bool dp = BF && dp_bf16_state() == 1 && D % 32 == 0 && I % 32 == 0;
    for (long j0 = 0; j0 < m; j0 += 8) {
        int mm = (int)(m - j0 > 8 ? 8 : m - j0);
        const float *xin = (const float *)(J.x + (x0 + j0) * D);
        if (dp) {
            for (int j = 0; j < mm; j++)
                memcpy(xb + j * D, J.x + J.xrow(x0 + j0 + j) * D, sizeof(bf16) * D);
            proj_dp(xb, D, mm, (const bf16 *)J.gate_up + s * 2 * I * D, 2 * I, D, g, 2 * I);
        } else {
            if (BF || J.xmap) {
                for (int j = 0; j < mm; j++) {
                    const T *src = J.x + J.xrow(x0 + j0 + j) * D;
                    for (long d = 0; d < D; d += 16) *(v16u *)(xs + j * D + d) = load16(src + d);
                }
                xin = xs;
            }
            proj(xin, D, mm, J.gate_up + s * 2 * I * D, 2 * I, D, g, 2 * I);
        }
        for (int j = 0; j < mm; j++) {
            float wj = J.w ? J.w[J.orow(out0 + j0 + j)] : 1.f;
            const float *gj = g + j * 2 * I;
            for (long k = 0; k < I; k++) {
                float a = gj[k];
                h[j * I + k] = a / (1.f + expf(-a)) * gj[I + k] * wj;
            }
        }
        float *y = J.omap ? xs : J.out + (out0 + j0) * D;
        if (dp) {
            for (long k = 0; k < mm * I; k++) hb[k] = to_bf16(h[k]);
            proj_dp(hb, I, mm, (const bf16 *)J.down + s * D * I, D, I, y, D);
        } else {
            proj(h, I, mm, J.down + s * D * I, D, I, y, D);
        }
        if (J.omap)
            for (int j = 0; j < mm; j++)
                for (long d = 0; d < D; d++) J.out[J.orow(out0 + j0 + j) * D + d] = xs[j * D + d];
    }
}

// Work items a span of m rows is split into: at most MAX_P rows each (the last part, which takes the rows
// past a multiple of 16, gets the fewest blocks of 16: at most MAX_P - 16 + 15 rows).
static long n_parts(long m) { return !TILES || m <= SMALL_ROWS ? 1 : (m + MAX_P - 1) / MAX_P; }

// The most rows per expert this build computes well; -1: any.
static long lp_expert_max_rows(void) { return TILES ? -1 : 2; }

// For each span (slot, first x position, first out position, rows) and each row j of it:
// out[orow(o0 + j)] = down_s(silu(gate_s(x[xrow(x0 + j)])) * up_s(...)) * w[orow(o0 + j)].
// Spans split into work items (n_parts), handed out one at a time to `threads` threads: a thread
// descheduled by another process (the cores are shared) leaves its remaining items to the others instead
// of holding up the layer. Returns nonzero when out of memory.
template <typename T>
static int lp_expert_spans(const T *x, const T *gate_up, const T *down, const float *w, float *out,
                           const int64_t *xmap, const int64_t *omap, long D, long I, const int64_t *spans, long n,
                           int threads) {
    const Job<T> J{x, gate_up, down, w, out, xmap, omap, D, I};
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
    if (sizeof(T) == 2) dp_bf16_state();           // decided once, before the threads ask
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1) reduction(| : failed)
    {
        long DI = D > I ? D : I;
        size_t small = 8 * (3 * I + D), big = (size_t)MAX_P * (2 * D + 2 * I), wsz = (size_t)RBT * DI,
               bsz = (size_t)8 * (D + I);          // bfloat16 rows of x and h: half this many floats suffice
        float *g = (float *)aligned_alloc(64, sizeof(float) * ((small + big + wsz + bsz + 15) / 16 * 16));
        float *xt = g + small, *gt = xt + MAX_P * D, *ot = gt + MAX_P * 2 * I, *ws = ot + MAX_P * D;
        bf16 *xb = (bf16 *)(ws + wsz), *hb = xb + 8 * D;
        if (!g) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < items; i++) {
            const int64_t *t = it + 4 * i;
            if (!g) continue;
            if (TILES && t[3] > SMALL_ROWS) big_span(J, t[0], t[1], t[2], t[3], xt, gt, ot, ws);
            else small_span(J, t[0], t[1], t[2], t[3], g, g + 16 * I, g + 24 * I, xb, hb);
        }
        free(g);
    }
    free(it);
    return failed;
}

// ---- the torch operators --------------------------------------------------------------------------

static int64_t max_rows_op() { return lp_expert_max_rows(); }

static std::string features_op() {
    return std::string("tiles=") + (AVX512_TILES ? "avx512" : "avx2") + " dpbf16=" + (dp_bf16_state() ? "1" : "0");
}

static const int64_t *map_ptr(const std::optional<at::Tensor> &m) {
    if (!m) return nullptr;
    TORCH_CHECK(m->scalar_type() == at::kLong && m->is_contiguous(), "expert kernel: row maps are contiguous int64");
    return m->const_data_ptr<int64_t>();
}

static void spans_op(const at::Tensor &x, const at::Tensor &gate_up, const at::Tensor &down,
                     const std::optional<at::Tensor> &w, const at::Tensor &out, const std::optional<at::Tensor> &x_rows,
                     const std::optional<at::Tensor> &out_rows, const at::Tensor &spans, int64_t threads) {
    const auto dt = x.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "expert kernel: x is float32 or bfloat16");
    for (const at::Tensor *t : {&x, &gate_up, &down})
        TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->device().is_cpu(),
                    "expert kernel: x, gate_up and down are contiguous CPU tensors of one dtype");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
                "expert kernel: out is a contiguous float32 CPU tensor");
    TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(1) == 2 * down.size(2) &&
                    gate_up.size(2) == down.size(1) && down.size(1) % 16 == 0 && down.size(2) % 16 == 0,
                "expert kernel: gate_up [S, 2I, D], down [S, D, I], D and I multiples of 16");
    TORCH_CHECK(!w || (w->scalar_type() == at::kFloat && w->is_contiguous()), "expert kernel: w is contiguous float32");
    TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 4,
                "expert kernel: spans int64 [n, 4]");
    const float *wp = w ? w->const_data_ptr<float>() : nullptr;
    int failed;
    if (dt == at::kFloat)
        failed = lp_expert_spans(x.const_data_ptr<float>(), gate_up.const_data_ptr<float>(),
                                 down.const_data_ptr<float>(), wp, out.mutable_data_ptr<float>(), map_ptr(x_rows),
                                 map_ptr(out_rows), down.size(1), down.size(2), spans.const_data_ptr<int64_t>(),
                                 spans.size(0), (int)threads);
    else
        failed = lp_expert_spans((const bf16 *)x.const_data_ptr(), (const bf16 *)gate_up.const_data_ptr(),
                                 (const bf16 *)down.const_data_ptr(), wp, out.mutable_data_ptr<float>(),
                                 map_ptr(x_rows), map_ptr(out_rows), down.size(1), down.size(2),
                                 spans.const_data_ptr<int64_t>(), spans.size(0), (int)threads);
    TORCH_CHECK(!failed, "expert kernel: out of memory for its scratch rows");
}

TORCH_LIBRARY(loadplan_experts, m) {
    m.def("max_rows() -> int", &max_rows_op);
    m.def("features() -> str", &features_op);
    m.def("spans(Tensor x, Tensor gate_up, Tensor down, Tensor? w, Tensor(a!) out, Tensor? x_rows, "
          "Tensor? out_rows, Tensor spans, int threads) -> ()", &spans_op);
}
