/* Native CPU kernels for the executor's forward (fp32 activations; fp32, int8 or int4 weights; an fp32 or int8 KV
 * cache), built at first use by executor/model/native.py. C++ for GCC's vector extensions, whose ?: works on vectors
 * only in C++.
 *
 * Why: at the few rows of a decode step a projection is a weight stream, and oneDNN streams weights at about
 * half the machine's read bandwidth below ~8 rows; and torch has no attention that reads a paged pool, so a
 * decode step copies every sequence's K/V out of it (index_select) before SDPA reads them again, three
 * passes over memory where one is needed. Threads: OpenMP, the same libgomp runtime torch loaded.
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 88 on a vector V of floats, VI its int32 lanes (Cephes expf: x = n ln2 + r, a degree-5
   polynomial for e^r, 2^n in the exponent bits); relative error ~1e-7. Below -87 it returns 0. */
template <typename V, typename VI>
static inline V vexp(V x) {
  const V zero = {}, lo = zero - 87.0f;
  const VI under = x < lo;
  x = x < lo ? lo : x;
  V fx = x * 1.44269504088896341f + 0.5f;
  VI n = __builtin_convertvector(fx, VI);
  V fn = __builtin_convertvector(n, V);
  fn = fn > fx ? fn - 1.0f : fn;  /* floor */
  n = __builtin_convertvector(fn, VI);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  V y = zero + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  VI bits = (n + 127) << 23;
  V pow2n;
  memcpy(&pow2n, &bits, sizeof pow2n);
  y = y * pow2n;
  return under ? zero : y;
}

static inline float dot(const float *a, const float *b, int64_t n) {
  v8 acc0 = {0}, acc1 = {0};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    acc0 += load8(a + k) * load8(b + k);
    acc1 += load8(a + k + 8) * load8(b + k + 8);
  }
  for (; k + 8 <= n; k += 8) acc0 += load8(a + k) * load8(b + k);
  float s = hsum8(acc0 + acc1);
  for (; k < n; k++) s += a[k] * b[k];
  return s;
}

/* Projections of a few rows (decodes, verify rows, small prompt chunks): y = x wᵀ with the weight [N, K]
   repacked once into column panels [ceil(N / NR)][K][NR] (NR = two vector registers of columns, zero-padded).
   A tile of up to MR_MAX rows keeps its MR x NR outputs in registers while the panel streams past once, in
   order: each k costs two vector loads and one broadcast per row, no horizontal sums, and the panel's next
   lines are asked for PREFETCH floats ahead. Against the dot-product kernel it replaced (4 weight rows x 3 x
   rows, 8 lanes) on the Xeon with AVX-512: 0.86x the time at 1 row, 0.69x at 11, 0.58x at 32; and below
   oneDNN's prepacked GEMM up to ~100 rows. More rows than MR_MAX: balanced tiles, the panel re-read from L2.
   Rows K floats apart share L1 sets where 4 KB divides K * 4 (K = 1024: a 12-row tile's rows in one 8-way set),
   so there a tile of more than PACKED_ROWS rows reads them from a copy packed k-major ([K][MR]): a 0.5B model's
   projections ran 0.75-0.93x the time at 12-32 rows; at K = 576 the copy cost 4-6%, at 8-row tiles 2-4%. */
#ifdef __AVX512F__
typedef float vw __attribute__((vector_size(64)));
static const int VL = 16, MR_MAX = 12;  /* 24 accumulators + 2 weights + 1 broadcast of 32 zmm registers */
#else
typedef float vw __attribute__((vector_size(32)));
static const int VL = 8, MR_MAX = 6;  /* 12 accumulators + 2 weights + 1 broadcast of 16 ymm registers */
#endif
static const int NR = 2 * VL;
static const int64_t PREFETCH = 1024;  /* floats ahead in the panel (4 KB; 1 KB and 8 KB measured slower) */
/* ... where the rows fit one tile (a decode of a few rows, a batch-1 verify row): 32 KB ahead into L2, where more
   lines can be in flight than in L1, while the tile's FMAs run (0.95-0.96x the time at 4-11 rows; at 32-48
   rows, whose later tiles prefetch the next panel, 1.04-1.07x, so not there) */
static const int64_t PREFETCH_ALONE = 8192;
static const int PACKED_ROWS = 8;

/* Row i's x at k in a tile of MR rows: packed k-major (PK), or x's own rows, K apart. */
template <int MR, bool PK>
static inline float x_at(const float *x, int64_t K, int64_t k, int i) {
  return PK ? x[k * MR + i] : x[i * K + k];
}

typedef int32_t vwi __attribute__((vector_size(sizeof(vw))));

static inline vw loadw(const float *p) { vw v; memcpy(&v, p, sizeof v); return v; }
static inline void storew(float *p, vw v) { memcpy(p, &v, sizeof v); }
static inline vw splatw(float x) { return x - (vw){}; }  /* a broadcast (a lane loop compiles to inserts) */

/* Columns per panel, for the caller's allocation (ceil(N / NR) * K * NR floats). */
extern "C" int64_t panel_width() { return NR; }

extern "C" void pack_panels(const float *w, int64_t N, int64_t K, float *panels) {
  const int64_t np = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < np; b++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < NR; j++) {
        const int64_t n = b * NR + j;
        panels[(b * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
      }
}

template <int MR, bool PK>
static void tile(const float *x, int64_t K, const float *panel, float *y, int64_t ldy, int64_t nn, const float *pf,
                 int64_t pf_step, bool alone) {
  vw acc[MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = splatw(0.0f);
  for (int64_t k = 0; k < K; k++) {
    const float *pk = panel + k * NR;
    if (pf) {  /* a later tile of the panel: bring a share of the next panel into L2 meanwhile */
      __builtin_prefetch(pf + k * pf_step, 0, 2);
      if (pf_step > 16) __builtin_prefetch(pf + k * pf_step + 16, 0, 2);
    } else if (alone) {
      __builtin_prefetch(pk + PREFETCH_ALONE, 0, 1);
      if (NR * 4 > 64) __builtin_prefetch(pk + PREFETCH_ALONE + 16, 0, 1);
    } else {
      __builtin_prefetch(pk + PREFETCH);
      if (NR * 4 > 64) __builtin_prefetch(pk + PREFETCH + 16);
    }
    const vw w0 = loadw(pk), w1 = loadw(pk + VL);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      const vw b = splatw(x_at<MR, PK>(x, K, k, i));
      acc[i][0] += b * w0;
      acc[i][1] += b * w1;
    }
  }
  for (int i = 0; i < MR; i++) {
    if (nn == NR) {
      storew(y + i * ldy, acc[i][0]);
      storew(y + i * ldy + VL, acc[i][1]);
    } else {  /* the last panel of an N that NR does not divide */
      float t[NR];
      storew(t, acc[i][0]);
      storew(t + VL, acc[i][1]);
      memcpy(y + i * ldy, t, nn * sizeof(float));
    }
  }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, const float *, int64_t, bool);
#ifdef __AVX512F__
#define TILE_ROW(T, PK) {nullptr, T<1, PK>, T<2, PK>, T<3, PK>, T<4, PK>, T<5, PK>, T<6, PK>, T<7, PK>, T<8, PK>, \
                         T<9, PK>, T<10, PK>, T<11, PK>, T<12, PK>}
#else
#define TILE_ROW(T, PK) {nullptr, T<1, PK>, T<2, PK>, T<3, PK>, T<4, PK>, T<5, PK>, T<6, PK>}
#endif
/* [whether the tile's rows are packed][rows] */
static const tile_fn TILES[2][MR_MAX + 1] = {TILE_ROW(tile, false), TILE_ROW(tile, true)};

/* x [M, K] as the tiles read it, tile after tile, where K * 4 is a multiple of 4 KB: the rows of a tile of more than
   PACKED_ROWS k-major ([K][mr]), the others as they are; empty elsewhere (the tiles read x itself). */
static std::vector<float> pack_tiles(const float *x, int64_t M, int64_t K, int64_t tiles) {
  std::vector<float> packed;
  if (K * sizeof(float) % 4096 != 0 || (M + tiles - 1) / tiles <= PACKED_ROWS) return packed;
  packed.resize(M * K);
  for (int64_t j = 0, m0 = 0; j < tiles; j++) {
    const int64_t mr = (M - m0) / (tiles - j);
    float *xp = packed.data() + m0 * K;
    if (mr > PACKED_ROWS)
      for (int64_t i = 0; i < mr; i++)
        for (int64_t k = 0; k < K; k++) xp[k * mr + i] = x[(m0 + i) * K + k];
    else
      memcpy(xp, x + m0 * K, mr * K * sizeof(float));
    m0 += mr;
  }
  return packed;
}

/* y[m, n] = sum_k x[m, k] w[n, k] for m < M, n < N; x [M, K], y [M, ldy]; `panels` from pack_panels. */
extern "C" void linear_small(const float *x, int64_t M, int64_t K, const float *panels, int64_t N, float *y,
                             int64_t ldy) {
  const int64_t np = (N + NR - 1) / NR, tiles = (M + MR_MAX - 1) / MR_MAX;
  const std::vector<float> packed = pack_tiles(x, M, K, tiles);
  const float *xs = packed.empty() ? x : packed.data();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < np; b++) {
    const float *panel = panels + b * K * NR;
    const int64_t nn = N - b * NR < NR ? N - b * NR : NR;
    /* the first tile streams the panel from memory (prefetching ahead in it); the others re-read it from L2 and
       meanwhile prefetch the next panel, a 1 / (tiles - 1) share each, so its first tile finds it in L2 */
    const float *next = b + 1 < np ? panel + K * NR : nullptr;
    const int64_t pf_step = tiles > 1 ? (NR + tiles - 2) / (tiles - 1) : 0;
    for (int64_t j = 0, m0 = 0; j < tiles; j++) {
      const int64_t mr = (M - m0) / (tiles - j);
      const float *pf = j > 0 && next ? next + (j - 1) * K * pf_step : nullptr;
      TILES[!packed.empty() && mr > PACKED_ROWS][mr](xs + m0 * K, K, panel, y + m0 * ldy + b * NR, ldy, nn, pf, pf_step, tiles == 1);
      m0 += mr;
    }
  }
}

/* Weight-only quantized projections: the same panels and register tiles as linear_small, the weight dequantized
   in registers as it streams past (at a decode's few rows a projection is a weight stream, so int8 reads a quarter
   of fp32's bytes and int4 an eighth).
   int8: panels [ceil(N / NR)][K][NR] int8, symmetric, one fp32 scale per column, applied after the K loop.
   int4: panels [ceil(N / NR)][K][VL] bytes, byte j of row k holding column j in its low nibble and column j + VL
   in its high one; groups of `gs` rows of K share a (scale, min) per column, fp16, [ceil(N / NR)][ceil(K / gs)]
   [2][NR]: w = q * scale + min (asymmetric, llama.cpp's Q4_1). */

/* VL bytes at p, signed (s8) or unsigned (u8), widened to int32 lanes: one vpmovsxbd / vpmovzxbd (GCC's
   __builtin_convertvector of byte vectors compiles to scalar extracts and inserts). */
template <bool is_signed>
static inline vwi widen8(const uint8_t *p) {
  vwi r;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128((const __m128i *)p);
  const __m512i v = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  memcpy(&r, &v, sizeof r);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64((const __m128i *)p);
  const __m256i v = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  memcpy(&r, &v, sizeof r);
#else
  for (int j = 0; j < VL; j++) r[j] = is_signed ? (int32_t)(int8_t)p[j] : (int32_t)p[j];
#endif
  return r;
}

static inline vw s8_to_float(const uint8_t *p) { return __builtin_convertvector(widen8<true>(p), vw); }
static const int64_t QPREFETCH = 4096, QPREFETCH_ALONE = 32768;  /* bytes ahead, as linear_small's */

/* NR fp16 values (a group's scales or mins of one panel) as two vectors of floats. */
static inline void load_halves(const uint16_t *h, vw &a, vw &b) {
#if defined(__AVX512F__)
  __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
  __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + VL)));
  memcpy(&a, &lo, sizeof a);
  memcpy(&b, &hi, sizeof b);
#elif defined(__F16C__)
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + VL)));
  memcpy(&a, &lo, sizeof a);
  memcpy(&b, &hi, sizeof b);
#else
  float t[NR];
  for (int j = 0; j < NR; j++) {  /* IEEE half to float, normals and zero (scales are never subnormal or inf) */
    const uint32_t x = h[j], e = (x >> 10) & 31, m = x & 1023, sgn = (x & 0x8000) << 16;
    const uint32_t bits = e == 0 ? sgn : sgn | ((e + 112) << 23) | (m << 13);
    memcpy(t + j, &bits, 4);
  }
  a = loadw(t);
  b = loadw(t + VL);
#endif
}

/* Row k of a quantized panel of `bytes_per_k` bytes a k, its stream ahead asked for on the way. always_inline:
   GCC's IPA took a function of nothing but prefetches for a const one and deleted every call of it before
   inlining, so no tile or attention task asked for its stream ahead (the int8 / int4 tiles at one row: 0.63-0.67x
   the time once they do, outputs unchanged) */
__attribute__((always_inline)) static inline const uint8_t *panel_row(const uint8_t *panel, int64_t k,
                                                                      int64_t bytes_per_k, const uint8_t *pf,
                                                                      int64_t pf_step, bool alone) {
  const uint8_t *p = panel + k * bytes_per_k;
  if (pf) {
    __builtin_prefetch(pf + k * pf_step, 0, 2);
  } else if ((k * bytes_per_k) % 64 < bytes_per_k) {  /* once per cache line of the panel */
    if (alone) __builtin_prefetch(p + QPREFETCH_ALONE, 0, 1);
    else __builtin_prefetch(p + QPREFETCH);
  }
  return p;
}

template <int MR>
static inline void store_tile(vw (&acc)[MR][2], float *y, int64_t ldy, int64_t nn) {
  for (int i = 0; i < MR; i++) {
    if (nn == NR) {
      storew(y + i * ldy, acc[i][0]);
      storew(y + i * ldy + VL, acc[i][1]);
    } else {
      float t[NR];
      storew(t, acc[i][0]);
      storew(t + VL, acc[i][1]);
      memcpy(y + i * ldy, t, nn * sizeof(float));
    }
  }
}

/* Independent sums per output vector of a tile of MR rows: an FMA waits ~4 cycles for the one before it into the
   same register, so a one-row tile (2 accumulators, 8 lanes each with AVX2) ran at a quarter of the FMA units'
   rate; four sums over alternating k keep 8 FMAs in flight, added in a fixed order at the end (int8 at one row,
   SmolLM2's projections on the Xeon forced to AVX2, one thread: 0.88-0.89x the time; at two rows, 4 accumulators
   already, no change). AVX-512's tiles (twice the columns per FMA) keep one. */
template <int MR>
static constexpr int k_chains() {
#ifdef __AVX512F__
  return 1;
#else
  return MR == 1 ? 4 : 1;
#endif
}

/* acc[0] = Σ acc[c] over the KS chains (a power of two), pairwise: ((a0 + a1) + (a2 + a3)). */
template <int KS, int MR>
static inline void fold_chains(vw (&acc)[KS][MR][2], float (&xs)[KS][MR]) {
  for (int step = 1; step < KS; step *= 2)
    for (int c = 0; c + step < KS; c += 2 * step)
      for (int i = 0; i < MR; i++) {
        acc[c][i][0] += acc[c + step][i][0];
        acc[c][i][1] += acc[c + step][i][1];
        xs[c][i] += xs[c + step][i];
      }
}

template <int MR, bool PK>
static void tile_q8(const float *x, int64_t K, const uint8_t *panel, const void *scales, int64_t, float *y,
                    int64_t ldy, int64_t nn, const uint8_t *pf, int64_t pf_step, bool alone) {
  constexpr int KS = k_chains<MR>();
  vw acc[KS][MR][2];
  for (int c = 0; c < KS; c++)
    for (int i = 0; i < MR; i++) acc[c][i][0] = acc[c][i][1] = splatw(0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += KS) {
#pragma GCC unroll 4
    for (int c = 0; c < KS; c++) {
      const int64_t k = k0 + c;
      if (KS > 1 && k >= K) break;
      const uint8_t *pk = panel_row(panel, k, NR, pf, pf_step, alone);
      const vw w0 = s8_to_float(pk), w1 = s8_to_float(pk + VL);
#pragma GCC unroll 16
      for (int i = 0; i < MR; i++) {
        const vw b = splatw(x_at<MR, PK>(x, K, k, i));
        acc[c][i][0] += b * w0;
        acc[c][i][1] += b * w1;
      }
    }
  }
  float no_sums[KS][MR] = {};  /* (int8 needs no sums of x) */
  fold_chains<KS, MR>(acc, no_sums);
  const float *s = (const float *)scales;
  const vw s0 = loadw(s), s1 = loadw(s + VL);
  for (int i = 0; i < MR; i++) acc[0][i][0] *= s0, acc[0][i][1] *= s1;
  store_tile<MR>(acc[0], y, ldy, nn);
}

/* Σ p[0..n), for a group's sum of x. */
static inline float sum_floats(const float *p, int64_t n) {
  v8 a = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) a += load8(p + i);
  float t = hsum8(a);
  for (; i < n; i++) t += p[i];
  return t;
}

/* Rows up to which tile_q4 sums a group's products of the raw 4-bit values and scales once at the group's end:
   x·w = s Σ x q + m Σ x, two FMAs a k fewer than dequantizing every weight, for 2·MR more accumulators. */
static const int Q4_GROUPED_ROWS = 4;

template <int MR, bool PK>
static void tile_q4(const float *x, int64_t K, const uint8_t *panel, const void *scales, int64_t gs, float *y,
                    int64_t ldy, int64_t nn, const uint8_t *pf, int64_t pf_step, bool alone) {
  constexpr int KS = k_chains<MR>();
  vw acc[MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = splatw(0.0f);
  const uint16_t *sm = (const uint16_t *)scales;
  for (int64_t k0 = 0; k0 < K; k0 += gs, sm += 2 * NR) {
    vw s0, s1, m0, m1;
    load_halves(sm, s0, s1);
    load_halves(sm + NR, m0, m1);
    const int64_t k1 = k0 + gs < K ? k0 + gs : K;
    if (MR <= Q4_GROUPED_ROWS) {
      vw ga[KS][MR][2];
      float xs[KS][MR];
      for (int c = 0; c < KS; c++)
        for (int i = 0; i < MR; i++) ga[c][i][0] = ga[c][i][1] = splatw(0.0f), xs[c][i] = 0.0f;
      for (int64_t kc = k0; kc < k1; kc += KS) {
#pragma GCC unroll 4
        for (int c = 0; c < KS; c++) {
          const int64_t k = kc + c;
          if (KS > 1 && k >= k1) break;
          const uint8_t *pk = panel_row(panel, k, VL, pf, pf_step, alone);
          const vwi v = widen8<false>(pk);
          const vw q0 = __builtin_convertvector(v & 15, vw), q1 = __builtin_convertvector(v >> 4, vw);
#pragma GCC unroll 4
          for (int i = 0; i < MR; i++) {
            const float xv = x_at<MR, PK>(x, K, k, i);
            const vw xb = splatw(xv);
            ga[c][i][0] += xb * q0;
            ga[c][i][1] += xb * q1;
            xs[c][i] += xv;
          }
        }
      }
      fold_chains<KS, MR>(ga, xs);
      for (int i = 0; i < MR; i++) {
        const vw xb = splatw(xs[0][i]);
        acc[i][0] += ga[0][i][0] * s0 + xb * m0;
        acc[i][1] += ga[0][i][1] * s1 + xb * m1;
      }
      continue;
    }
    for (int64_t k = k0; k < k1; k++) {
      const uint8_t *pk = panel_row(panel, k, VL, pf, pf_step, alone);
      const vwi v = widen8<false>(pk);
      const vw w0 = __builtin_convertvector(v & 15, vw) * s0 + m0;
      const vw w1 = __builtin_convertvector(v >> 4, vw) * s1 + m1;
#pragma GCC unroll 16
      for (int i = 0; i < MR; i++) {
        const vw xb = splatw(x_at<MR, PK>(x, K, k, i));
        acc[i][0] += xb * w0;
        acc[i][1] += xb * w1;
      }
    }
  }
  store_tile<MR>(acc, y, ldy, nn);
}

typedef void (*qtile_fn)(const float *, int64_t, const uint8_t *, const void *, int64_t, float *, int64_t, int64_t,
                         const uint8_t *, int64_t, bool);
static const qtile_fn Q8_TILES[2][MR_MAX + 1] = {TILE_ROW(tile_q8, false), TILE_ROW(tile_q8, true)},
                      Q4_TILES[2][MR_MAX + 1] = {TILE_ROW(tile_q4, false), TILE_ROW(tile_q4, true)};

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define Q4_VNNI 1
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define Q4_AVX2 1
#endif
#if defined(Q4_VNNI) || defined(Q4_AVX2)
/* int4 at one or two rows, with integer dot products (vpdpbusd: 64 byte products a call) instead of turning every
   weight into a float: at one row the float tile spends ~6 cycles per k of a panel (32 columns) on Zen 4's
   double-pumped AVX-512 converting nibbles and multiplying, as long as int8's tile takes for twice the bytes, so
   int4 was no faster than int8. x is split into three int8 planes, x ≈ xs · (p0 + p1 / 254 + p2 / 254²), xs =
   max |x| / 127 over the weight's group of K, to about 1e-5 · xs (the size of fp32's own rounding of the products),
   so the result matches the float tile to fp32 rounding; the sums per group are exact int32s, scaled once per
   group. All of SmolLM2's decoder projections at one row, 2 threads: 3.26 ms against 3.72 (two rows: 4.00 against
   4.86), at the machine's memory stream (~24 GB/s). AVX2 builds take the same planes to vpmaddubsw (below). */
static const int64_t Q4_PLANES = 3;
static const double Q4_PLANE_STEP = 254.0;

/* One plane of x_planes, vectorized: out[k] = the nearest integer q to r[k] (within ±127), r[k] = (r[k] - q) · step
   (r - q is exact, and so the planes' sum up to the last one's rounding); returns where the scalar tail starts. */
static inline int64_t plane_bytes(float *r, int64_t K, int8_t *out) {
  int64_t k = 0;
#ifdef Q4_VNNI
  const __m512 step = _mm512_set1_ps((float)Q4_PLANE_STEP), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(r + k);
    const __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT |
                                                                                  _MM_FROUND_NO_EXC)));
    _mm_storeu_si128((__m128i *)(out + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
    _mm512_storeu_ps(r + k, _mm512_mul_ps(_mm512_sub_ps(v, q), step));
  }
#else
  const __m256 step = _mm256_set1_ps((float)Q4_PLANE_STEP), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* undoes the packs' lane interleave */
  for (; k + 32 <= K; k += 32) {
    __m256i n[4];
    for (int j = 0; j < 4; j++) {
      const __m256 v = _mm256_loadu_ps(r + k + 8 * j);
      const __m256 q = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT |
                                                                               _MM_FROUND_NO_EXC)));
      n[j] = _mm256_cvtps_epi32(q);
      _mm256_storeu_ps(r + k + 8 * j, _mm256_mul_ps(_mm256_sub_ps(v, q), step));
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)(out + k), _mm256_permutevar8x32_epi32(b, order));
  }
#endif
  return k;
}

/* Row i of x [M, K] as Q4_PLANES int8 planes ([M][planes][K]) and a scale per group of gs along K ([M][groups]; see
   above: per group, so a few outlier features cost precision in their own groups only); r: room for K floats.
   Vectorized: it runs before each projection's threads start, ~120 times a decode step. */
static void x_planes(const float *x, int64_t M, int64_t K, int64_t gs, int8_t *planes, float *scale, float *r) {
  const int64_t groups = (K + gs - 1) / gs;
  for (int64_t i = 0; i < M; i++) {
    const float *xr = x + i * K;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t k0 = g * gs, k1 = std::min(K, k0 + gs);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; k++) amax = fabsf(xr[k]) > amax ? fabsf(xr[k]) : amax;
      scale[i * groups + g] = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = k0; k < k1; k++) r[k] = xr[k] * inv;
    }
    for (int64_t p = 0; p < Q4_PLANES; p++) {
      int8_t *out = planes + (i * Q4_PLANES + p) * K;
      const int64_t k = plane_bytes(r, K, out);
      for (int64_t j = k; j < K; j++) {
        const float q = std::min(127.0f, std::max(-127.0f, __builtin_rintf(r[j])));
        out[j] = (int8_t)q;
        r[j] = (r[j] - q) * (float)Q4_PLANE_STEP;
      }
    }
  }
}

#ifdef Q4_VNNI
static const int64_t Q4_INT_ROWS = 2;

template <int MR>
static void tile_q4_int(const int8_t *planes, const float *xscale, const float *xsums, int64_t K,
                         const uint8_t *panel, const uint16_t *sm, int64_t gs, float *y, int64_t ldy, int64_t nn) {
  /* byte 4j + r of a line's transpose is column j's byte of row k + r: each int32 lane then holds one column's
     four k, as vpdpbusd multiplies them */
  alignas(64) static const uint8_t order[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
      7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61,
      14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i idx = _mm512_load_si512((const void *)order), low = _mm512_set1_epi8(0x0F);
  const vw step1 = splatw((float)(1.0 / Q4_PLANE_STEP));
  const vw step2 = splatw((float)(1.0 / (Q4_PLANE_STEP * Q4_PLANE_STEP)));
  vw acc[MR][2];
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = splatw(0.0f);
  const int64_t groups = (K + gs - 1) / gs;
  for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += gs, sm += 2 * NR) {
    const int64_t k1 = k0 + gs < K ? k0 + gs : K;
    __m512i ia[MR][Q4_PLANES][2];
    for (int i = 0; i < MR; i++)
      for (int p = 0; p < Q4_PLANES; p++) ia[i][p][0] = ia[i][p][1] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 4) {
      const uint8_t *pk = panel + k * VL;
      __builtin_prefetch(pk + QPREFETCH_ALONE, 0, 1);  /* one tile streams each panel once: far ahead, into L2 */
      const __m512i t = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)pk));
      const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
#pragma GCC unroll 2
      for (int i = 0; i < MR; i++)
#pragma GCC unroll 3
        for (int p = 0; p < Q4_PLANES; p++) {
          int32_t four;
          memcpy(&four, planes + (i * Q4_PLANES + p) * K + k, 4);
          const __m512i xb = _mm512_set1_epi32(four);
          ia[i][p][0] = _mm512_dpbusd_epi32(ia[i][p][0], lo, xb);
          ia[i][p][1] = _mm512_dpbusd_epi32(ia[i][p][1], hi, xb);
        }
    }
    vw s0, s1, m0, m1;
    load_halves(sm, s0, s1);
    load_halves(sm + NR, m0, m1);
    for (int i = 0; i < MR; i++) {
      vw d[2];
      for (int h = 0; h < 2; h++) {
        vw c[Q4_PLANES];
        for (int p = 0; p < Q4_PLANES; p++) {
          const __m512 f = _mm512_cvtepi32_ps(ia[i][p][h]);
          memcpy(&c[p], &f, sizeof c[p]);
        }
        d[h] = (c[0] + c[1] * step1 + c[2] * step2) * splatw(xscale[i * groups + g]);  /* Σ x q over the group */
      }
      const vw xsum = splatw(xsums[i * groups + g]);
      acc[i][0] += d[0] * s0 + xsum * m0;
      acc[i][1] += d[1] * s1 + xsum * m1;
    }
  }
  store_tile<MR>(acc, y, ldy, nn);
}

#else
/* On AVX2, without VNNI, as llama.cpp's AVX2 Q4 dot products multiply: vpmaddubsw multiplies the weight's unsigned
   bytes (q, 0..15) by x's signed ones and adds neighbours into int16, vpmaddwd adds those pairs into int32. A pair
   is at most 2 · 15 · 127 = 3810, so Q4_AVX2_SPAN k (8 steps of 4) add up in int16 before one vpmaddwd widens
   them. Per 4 k of a panel (32 bytes): a dword permute and a byte shuffle put each column's four k in one int32
   lane (the panel's rows k..k+3 hold them 8 bytes apart), two masks part the nibbles, and each plane costs two
   vpmaddubsw and two int16 adds: 17 operations where the float tile spends 28 (widen, mask, convert, FMA per k).
   SmolLM2's projections at one row (int4, the LM head int8), forced AVX2 on the Xeon, one thread: 0.60x the time
   of the float tile (CPU time; 0.68x wall at two threads). Up to three rows, one after another over the panel (in L1
   after the first): the float tile's conversions serve all its rows, but its FMAs and sums of x cost a row more
   than the planes do up to there (2 rows 0.80-0.82x the time, 3 rows 0.94-0.96x, 4 rows even). */
static const int64_t Q4_INT_ROWS = 3, Q4_AVX2_SPAN = 32;

/* Σ q · p over k in [c0, c1) (at most Q4_AVX2_SPAN) per column and plane, int32: [plane][low / high nibbles]. */
static inline void q4_avx2_span(const int8_t *planes, int64_t K, const uint8_t *panel, int64_t c0, int64_t c1,
                                __m256i (&out)[Q4_PLANES][2]) {
  const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i shuf = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i i16[Q4_PLANES][2];
  for (int p = 0; p < Q4_PLANES; p++) i16[p][0] = i16[p][1] = _mm256_setzero_si256();
  for (int64_t k = c0; k < c1; k += 4) {
    const uint8_t *pk = panel + k * VL;
    if (!(k & 4)) __builtin_prefetch(pk + QPREFETCH_ALONE, 0, 1);  /* once per 64-byte line */
    const __m256i t = _mm256_shuffle_epi8(
        _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)pk), perm), shuf);
    const __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
#pragma GCC unroll 3
    for (int p = 0; p < Q4_PLANES; p++) {
      int32_t four;
      memcpy(&four, planes + p * K + k, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      i16[p][0] = _mm256_add_epi16(i16[p][0], _mm256_maddubs_epi16(lo, xb));
      i16[p][1] = _mm256_add_epi16(i16[p][1], _mm256_maddubs_epi16(hi, xb));
    }
  }
  for (int p = 0; p < Q4_PLANES; p++)
    for (int h = 0; h < 2; h++) out[p][h] = _mm256_madd_epi16(i16[p][h], ones);
}

template <int MR>
static void tile_q4_int(const int8_t *planes, const float *xscale, const float *xsums, int64_t K,
                        const uint8_t *panel, const uint16_t *sm, int64_t gs, float *y, int64_t ldy, int64_t nn) {
  static_assert(MR == 1, "one row");
  const vw step1 = splatw((float)(1.0 / Q4_PLANE_STEP));
  const vw step2 = splatw((float)(1.0 / (Q4_PLANE_STEP * Q4_PLANE_STEP)));
  vw acc[1][2] = {{splatw(0.0f), splatw(0.0f)}};
  for (int64_t g = 0, k0 = 0; k0 < K; g++, k0 += gs, sm += 2 * NR) {
    const int64_t k1 = k0 + gs < K ? k0 + gs : K;
    __m256i i32[Q4_PLANES][2];
    q4_avx2_span(planes, K, panel, k0, std::min(k1, k0 + Q4_AVX2_SPAN), i32);
    for (int64_t c0 = k0 + Q4_AVX2_SPAN; c0 < k1; c0 += Q4_AVX2_SPAN) {  /* groups of more than 32 */
      __m256i more[Q4_PLANES][2];
      q4_avx2_span(planes, K, panel, c0, std::min(k1, c0 + Q4_AVX2_SPAN), more);
      for (int p = 0; p < Q4_PLANES; p++)
        for (int h = 0; h < 2; h++) i32[p][h] = _mm256_add_epi32(i32[p][h], more[p][h]);
    }
    vw s0, s1, m0, m1;
    load_halves(sm, s0, s1);
    load_halves(sm + NR, m0, m1);
    vw d[2];
    for (int h = 0; h < 2; h++) {
      vw c[Q4_PLANES];
      for (int p = 0; p < Q4_PLANES; p++) {
        const __m256 f = _mm256_cvtepi32_ps(i32[p][h]);
        memcpy(&c[p], &f, sizeof c[p]);
      }
      d[h] = (c[0] + c[1] * step1 + c[2] * step2) * splatw(xscale[g]);  /* Σ x q over the group */
    }
    const vw xsum = splatw(xsums[g]);
    acc[0][0] += d[0] * s0 + xsum * m0;
    acc[0][1] += d[1] * s1 + xsum * m1;
  }
  store_tile<1>(acc, y, ldy, nn);
}
#endif

/* linear_quantized's int4 projection of M <= Q4_INT_ROWS rows, K a multiple of 4, through tile_q4_int. */
static void linear_q4_int(const float *x, int64_t M, int64_t K, const uint8_t *panels, const void *scales,
                           int64_t gs, int64_t N, float *y, int64_t ldy, float *y2, int64_t split) {
  const int64_t np = (N + NR - 1) / NR, groups = (K + gs - 1) / gs;
  std::vector<int8_t> planes(M * Q4_PLANES * K);
  std::vector<float> xscale(M * groups), xsums(M * groups), r(K);
  x_planes(x, M, K, gs, planes.data(), xscale.data(), r.data());
  for (int64_t i = 0; i < M; i++)
    for (int64_t g = 0; g < groups; g++)
      xsums[i * groups + g] = sum_floats(x + i * K + g * gs, std::min(gs, K - g * gs));
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < np; b++) {
    const uint8_t *panel = panels + b * K * VL;
    const uint16_t *sc = (const uint16_t *)scales + b * groups * 2 * NR;
    const int64_t nn = N - b * NR < NR ? N - b * NR : NR;
    const bool second = y2 && b * NR >= split;
    float *out = second ? y2 + (b * NR - split) : y + b * NR;
    const int64_t ld = second ? N - split : ldy;
#ifdef Q4_VNNI
    if (M == 1) tile_q4_int<1>(planes.data(), xscale.data(), xsums.data(), K, panel, sc, gs, out, ld, nn);
    else tile_q4_int<2>(planes.data(), xscale.data(), xsums.data(), K, panel, sc, gs, out, ld, nn);
#else
    for (int64_t i = 0; i < M; i++)  /* a row at a time, the panel read again from L1 */
      tile_q4_int<1>(planes.data() + i * Q4_PLANES * K, xscale.data() + i * groups, xsums.data() + i * groups, K,
                     panel, sc, gs, out + i * ld, ld, nn);
#endif
  }
}
#endif

/* y [M, ldy] = x [M, K] wᵀ for a quantized weight of N columns: bits 8 (scales: fp32 [ceil(N / NR) * NR]) or 4
   (scales: fp16 (scale, min) pairs per group of gs rows of K, as above). Tiles as in linear_small. With y2, the
   columns from `split` (a multiple of NR) on go to y2 [M, N - split] instead: a fused gate|up weight gives its two
   halves as two contiguous outputs in one call. */
extern "C" void linear_quantized(const float *x, int64_t M, int64_t K, const uint8_t *panels, const void *scales,
                                 int64_t bits, int64_t gs, int64_t N, float *y, int64_t ldy, float *y2,
                                 int64_t split) {
#if defined(Q4_VNNI) || defined(Q4_AVX2)
  if (bits == 4 && M >= 1 && M <= Q4_INT_ROWS && K % 4 == 0 && gs % 4 == 0) {
    linear_q4_int(x, M, K, panels, scales, gs, N, y, ldy, y2, split);
    return;
  }
#endif
  const int64_t np = (N + NR - 1) / NR, tiles = (M + MR_MAX - 1) / MR_MAX;
  const int64_t panel_bytes = bits == 8 ? K * NR : K * VL, groups = bits == 8 ? 0 : (K + gs - 1) / gs;
  const qtile_fn (*fns)[MR_MAX + 1] = bits == 8 ? Q8_TILES : Q4_TILES;
  const std::vector<float> packed = pack_tiles(x, M, K, tiles);
  const float *xs = packed.empty() ? x : packed.data();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < np; b++) {
    const uint8_t *panel = panels + b * panel_bytes;
    const void *sc = bits == 8 ? (const void *)((const float *)scales + b * NR)
                               : (const void *)((const uint16_t *)scales + b * groups * 2 * NR);
    const int64_t nn = N - b * NR < NR ? N - b * NR : NR;
    const uint8_t *next = b + 1 < np ? panel + panel_bytes : nullptr;
    const int64_t per_k = panel_bytes / K, pf_step = tiles > 1 ? (per_k + tiles - 2) / (tiles - 1) : 0;
    for (int64_t j = 0, m0 = 0; j < tiles; j++) {
      const int64_t mr = (M - m0) / (tiles - j);
      const uint8_t *pf = j > 0 && next ? next + (j - 1) * K * pf_step : nullptr;
      float *out = y2 && b * NR >= split ? y2 + m0 * (N - split) + (b * NR - split) : y + m0 * ldy + b * NR;
      fns[!packed.empty() && mr > PACKED_ROWS][mr](xs + m0 * K, K, panel, sc, gs, out, y2 && b * NR >= split ? N - split : ldy, nn, pf, pf_step,
              tiles == 1);
      m0 += mr;
    }
  }
}

/* The weight of linear_quantized dequantized to fp32 [K][N] (k-major: a panel row is NR contiguous floats), for
   steps of many rows, which multiply it with oneDNN / MKL. */
extern "C" void dequantize_panels(const uint8_t *panels, const void *scales, int64_t bits, int64_t gs, int64_t N,
                                  int64_t K, float *out) {
  const int64_t np = (N + NR - 1) / NR, panel_bytes = bits == 8 ? K * NR : K * VL;
  const int64_t groups = bits == 8 ? 0 : (K + gs - 1) / gs;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < np; b++) {
    const uint8_t *panel = panels + b * panel_bytes;
    const int64_t nn = N - b * NR < NR ? N - b * NR : NR;
    float t[NR];
    if (bits == 8) {
      const vw s0 = loadw((const float *)scales + b * NR), s1 = loadw((const float *)scales + b * NR + VL);
      for (int64_t k = 0; k < K; k++) {
        storew(t, s8_to_float(panel + k * NR) * s0);
        storew(t + VL, s8_to_float(panel + k * NR + VL) * s1);
        memcpy(out + k * N + b * NR, t, nn * sizeof(float));
      }
      continue;
    }
    const uint16_t *sm = (const uint16_t *)scales + b * groups * 2 * NR;
    for (int64_t k0 = 0; k0 < K; k0 += gs, sm += 2 * NR) {
      vw s0, s1, m0, m1;
      load_halves(sm, s0, s1);
      load_halves(sm + NR, m0, m1);
      for (int64_t k = k0; k < (k0 + gs < K ? k0 + gs : K); k++) {
        const vwi v = widen8<false>(panel + k * VL);
        storew(t, __builtin_convertvector(v & 15, vw) * s0 + m0);
        storew(t + VL, __builtin_convertvector(v >> 4, vw) * s1 + m1);
        memcpy(out + k * N + b * NR, t, nn * sizeof(float));
      }
    }
  }
}

/* A layer's K or V block pool [num_blocks, bs, kvh, row]: fp32 rows of D (row = D floats), or int8 ones (row = D
   bytes, then the fp32 scale of that token and head: x = q * scale), the KV cache's int8 format. */
struct Pool {
  const uint8_t *base;
  int64_t bs, kvh, D;
  bool q8;
  int64_t row() const { return q8 ? D + 4 : D * 4; }  /* bytes of one (token, head) row */
  int64_t tok() const { return kvh * row(); }
  int64_t blk() const { return bs * tok(); }
  const uint8_t *at(int64_t block, int64_t off, int64_t h) const { return base + block * blk() + off * tok() + h * row(); }
};

/* One (token, head) row of an int8 pool as D floats. */
static inline void dequantize_row(const uint8_t *r, int64_t D, float *out) {
  float s;
  memcpy(&s, r + D, 4);
  const vw sv = splatw(s);
  int64_t d = 0;
  for (; d + VL <= D; d += VL) storew(out + d, s8_to_float(r + d) * sv);
  for (; d < D; d++) out[d] = (float)(int8_t)r[d] * s;
}

/* Rows [0, jn) x heads [h0, h0 + per) of a block as fp32 with token stride `tok` (floats) and head h0 + hh at
   hh * D: in place for an fp32 pool, dequantized into buf ([bs][per][D]) for an int8 one. */
static inline const float *block_rows(const Pool &p, int64_t block, int64_t jn, int64_t h0, int64_t per, float *buf,
                                      int64_t &tok) {
  if (!p.q8) {
    tok = p.kvh * p.D;
    return (const float *)p.at(block, 0, h0);
  }
  tok = per * p.D;
  for (int64_t j = 0; j < jn; j++)
    for (int64_t hh = 0; hh < per; hh++) dequantize_row(p.at(block, j, h0 + hh), p.D, buf + j * tok + hh * p.D);
  return buf;
}

/* Ask for heads [h0, h0 + per) of every token row of a block ahead of use: a sequence's blocks are scattered over
   the pool, so the hardware prefetcher cannot see the next one coming. always_inline: see panel_row. */
__attribute__((always_inline)) static inline void prefetch_block(const Pool &p, int64_t block, int64_t h0,
                                                                int64_t per) {
  const int64_t len = per * p.row();
  for (int64_t j = 0; j < p.bs; j++) {
    const uint8_t *r = p.at(block, j, h0);
    for (int64_t d = 0; d < len; d += 64) __builtin_prefetch(r + d);
  }
}

#ifdef __AVX2__
/* The in-lane shuffles of a transpose in registers, at either vector width (overloads: __m256, __m512). */
static inline __m256 unpacklo(__m256 a, __m256 b) { return _mm256_unpacklo_ps(a, b); }
static inline __m256 unpackhi(__m256 a, __m256 b) { return _mm256_unpackhi_ps(a, b); }
template <int IMM> static inline __m256 shuffle(__m256 a, __m256 b) { return _mm256_shuffle_ps(a, b, IMM); }
#ifdef __AVX512F__
static inline __m512 unpacklo(__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }
static inline __m512 unpackhi(__m512 a, __m512 b) { return _mm512_unpackhi_ps(a, b); }
template <int IMM> static inline __m512 shuffle(__m512 a, __m512 b) { return _mm512_shuffle_ps(a, b, IMM); }
#endif

/* The first two rounds of transposing N rows in registers, alike at both widths: every 128-bit lane of each four
   rows r[j..j+3] becomes its 4 x 4 transpose, in r (t: scratch). Moving whole lanes, the rest, is each width's own. */
template <int N, typename V>
__attribute__((always_inline)) static inline void transpose_in_lanes(V *r, V *t) {
  for (int j = 0; j < N; j += 2) {
    t[j] = unpacklo(r[j], r[j + 1]);
    t[j + 1] = unpackhi(r[j], r[j + 1]);
  }
  for (int j = 0; j < N; j += 4) {
    r[j] = shuffle<0x44>(t[j], t[j + 2]);
    r[j + 1] = shuffle<0xEE>(t[j], t[j + 2]);
    r[j + 2] = shuffle<0x44>(t[j + 1], t[j + 3]);
    r[j + 3] = shuffle<0xEE>(t[j + 1], t[j + 3]);
  }
}
#endif

/* kt[d][16] = the block's keys [jn][D] (row stride tok) transposed, keys past jn zero. With AVX-512 in 16 x 16
   squares in registers (64 shuffles each instead of 256 scalar loads and stores, which cost more than the
   scores themselves at a decode's 3 query rows per kv head), with AVX2 in 8 x 8 ones. */
static inline void transpose_keys(const float *kb, int64_t tok, int64_t jn, int64_t D, float *kt) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    for (int64_t c = 0; c < D; c += 16) {
      __m512 r[16], t[16];
      for (int j = 0; j < 16; j++) r[j] = j < jn ? _mm512_loadu_ps(kb + j * tok + c) : _mm512_setzero_ps();
      transpose_in_lanes<16>(r, t);
      for (int j = 0; j < 16; j += 8)
        for (int i = 0; i < 4; i++) {
          t[j + i] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0x88);
          t[j + i + 4] = _mm512_shuffle_f32x4(r[j + i], r[j + i + 4], 0xDD);
        }
      for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
      }
      for (int i = 0; i < 16; i++) _mm512_storeu_ps(kt + (c + i) * 16, r[i]);
    }
    return;
  }
#elif defined(__AVX2__)
  if (D % 8 == 0) {  /* AVX2: two 8 x 8 squares (keys 0-7, 8-15) per 8 columns, 24 shuffles each */
    for (int64_t c = 0; c < D; c += 8)
      for (int half = 0; half < 2; half++) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; j++)
          r[j] = 8 * half + j < jn ? _mm256_loadu_ps(kb + (8 * half + j) * tok + c) : _mm256_setzero_ps();
        transpose_in_lanes<8>(r, t);
        for (int i = 0; i < 4; i++) {  /* row i: columns c + i (low lanes) and c + i + 4 (high lanes) */
          _mm256_storeu_ps(kt + (c + i) * 16 + 8 * half, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
          _mm256_storeu_ps(kt + (c + i + 4) * 16 + 8 * half, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
      }
    return;
  }
#endif
  for (int64_t jj = 0; jj < 16; jj++)
    for (int64_t d = 0; d < D; d++) kt[d * 16 + jj] = jj < jn ? kb[jj * tok + d] : 0.0f;
}

/* Query rows per task from which a key block is transposed for the scores (see below): from a decode's 3
   rows up it is as fast or faster (1.8x at a lone 11-slot verify row, 1.5x at 6); a lone row under MHA keeps
   the horizontal sums. */
static const int64_t WIDE_ROWS = 3;

/* Fewest key blocks a part of a split decode row gets (below that the merge costs more than the balance wins). */
static const int64_t KSPLIT_MIN_BLOCKS = 4;

/* Whether query slot i of a row (n slots, the first at position first_new) sees key position j: causal, or
   among the row's own slots only where its candidate tree says (vis: [n, n], or NULL). */
static inline bool sees(int64_t j, int64_t i, int64_t first_new, const uint8_t *vis, int64_t n) {
  if (vis && j >= first_new) return vis[i * n + (j - first_new)];
  return j <= first_new + i;
}

/* Attention of B rows of n query slots each over a paged KV pool, read in place through the block tables.
 *
 * q, out: [B, n, H, D]. k_pool, v_pool: [num_blocks, bs, kvh, D] fp32, or with kv_int8 the int8 rows of Pool.
 * block_tables: [B, max_blocks].
 * context_lens: [B], cached tokens of each row including its new ones. Slot i of a row sits at position
 * ctx - n + i and sees keys up to it (a decode: n = 1); with `visible` ([B, n, n] bytes, or NULL), it sees
 * key position ctx - n + c of the row's last n only where visible[b, i, c] (candidate trees), earlier keys
 * always. A slot that sees no key (padding in front of a short row) gets zeros. The G = H / kvh query heads
 * sharing a kv head are computed together, so each K and V row is read once per row and kv head. */
extern "C" void paged_attention(const float *q, float *out, int64_t B, int64_t n, int64_t H, int64_t D,
                     const void *k_pool, const void *v_pool, int64_t bs, int64_t kvh,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                     const uint8_t *visible, float scale, bool kv_int8) {
  const int64_t G = H / kvh;
  const Pool kp{(const uint8_t *)k_pool, bs, kvh, D, kv_int8}, vp{(const uint8_t *)v_pool, bs, kvh, D, kv_int8};
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; b++) max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
  /* a task is one row, a range of kv heads and a range of its query slots: all heads and slots (each token's K
     and V rows read whole, in order) unless the rows would leave threads idle (fewer rows than threads, or a
     count that does not divide among them); then a row's heads, and if still too few (a verify row at batch
     1), its slots are split. Whole rows read each token's K and V lines together: 5-9% faster at 2-6 rows. */
  const int64_t threads = omp_get_max_threads();
  const int64_t split = B >= 4 * threads || B % threads == 0 ? 1 : kvh, per = kvh / split;
  int64_t nsplit = B * split >= 2 * threads ? 1 : (2 * threads + B * split - 1) / (B * split);
  nsplit = nsplit < n ? nsplit : n;
  const int64_t chunk = (n + nsplit - 1) / nsplit;
  nsplit = (n + chunk - 1) / chunk;
  /* still too few tasks (a lone decode row over 3 kv heads on 2 threads: one thread does two heads): decode rows
     also split their keys, in whole blocks of at least KSPLIT_MIN_BLOCKS, each part's softmax partial (max, sum,
     unnormalized P·V) merged after (flash-decoding) */
  const int64_t base = B * split * nsplit, max_blocks_used = (max_ctx + bs - 1) / bs;
  int64_t ksplit = n == 1 && !visible && base < 2 * threads ? (2 * threads + base - 1) / base : 1;
  const int64_t kcap = max_blocks_used / KSPLIT_MIN_BLOCKS;
  ksplit = ksplit < kcap ? ksplit : kcap;
  ksplit = ksplit > 1 ? ksplit : 1;
  std::vector<float> part_m(ksplit > 1 ? B * H * ksplit : 0), part_l(part_m.size()), part_acc(part_m.size() * D);
#pragma omp parallel
  {
    const int64_t Rmax = chunk * G * per;  /* query rows of a task: (head, slot, group) */
    std::vector<float> s_buf(Rmax * (max_ctx + 8)), acc_buf(Rmax * D), inv(Rmax), kt_buf(16 * D);
    std::vector<float> rmax(ksplit > 1 ? Rmax : 0), rsum(rmax.size());  /* each row's max and sum, for a merge */
    std::vector<float> rows_buf(kv_int8 ? bs * kvh * D : 0);  /* a block's rows dequantized */
    float *s = s_buf.data(), *acc = acc_buf.data(), *kt = kt_buf.data(), *rbuf = rows_buf.data();
#pragma omp for schedule(dynamic, 1)
    for (int64_t tk = 0; tk < base * ksplit; tk++) {
      const int64_t t = tk / ksplit, kpart = tk % ksplit;
      const int64_t b = t / (split * nsplit), h0 = (t / nsplit % split) * per, L = context_lens[b], first_new = L - n;
      /* this task's keys [ja, jb): whole blocks, all of them unless split */
      const int64_t cb = ((L + bs - 1) / bs + ksplit - 1) / ksplit * bs;
      const int64_t ja = ksplit > 1 ? (kpart * cb < L ? kpart * cb : L) : 0;
      const int64_t jb = ksplit > 1 ? (ja + cb < L ? ja + cb : L) : L;
      const int64_t i0 = t % nsplit * chunk, nl = n - i0 < chunk ? n - i0 : chunk, R = nl * G * per;
      const int64_t *table = block_tables + b * max_blocks;
      const uint8_t *vis = visible ? visible + b * n * n : NULL;
      /* scores s[r, j] for r = (hh * nl + i - i0) * G + g; keys a slot does not see are -inf */
      const bool wide = R >= WIDE_ROWS && bs <= 16 && D % 8 == 0;
      for (int64_t j0 = ja; j0 < jb; j0 += bs) {
        const int64_t jn = jb - j0 < bs ? jb - j0 : bs;
        int64_t tok;
        const float *kb = block_rows(kp, table[j0 / bs], jn, h0, per, rbuf, tok);  /* head h0 + hh at hh * D */
        if (j0 + bs < jb) prefetch_block(kp, table[j0 / bs + 1], h0, per);
        if (wide) {
          for (int64_t hh = 0; hh < per; hh++) {
            /* the block's keys of this head, transposed to kt[d][key]: each query row then takes 16 scores with
               plain FMAs (no horizontal sums), four rows at a time sharing every load of kt */
            transpose_keys(kb + hh * D, tok, jn, D, kt);
            const int64_t rows = nl * G;
            for (int64_t q0 = 0; q0 < rows; q0 += 4) {
              const int64_t qn = rows - q0 < 4 ? rows - q0 : 4;
              const float *qr[4];
              for (int64_t u = 0; u < 4; u++) {
                const int64_t rr = q0 + (u < qn ? u : qn - 1), i = i0 + rr / G, g = rr % G;
                qr[u] = q + ((b * n + i) * H + (h0 + hh) * G + g) * D;
              }
              /* 16 keys are 16 / VL vectors: with AVX-512 one, so each d costs a row one FMA (two with AVX2);
                 lane j of every vector sums key j's products in d order either way */
              constexpr int KV = 16 / VL;
              vw acc4[4][KV];
              for (int u = 0; u < 4; u++)
                for (int c = 0; c < KV; c++) acc4[u][c] = splatw(0.0f);
              for (int64_t d = 0; d < D; d++) {
                vw kd[KV];
                for (int c = 0; c < KV; c++) kd[c] = loadw(kt + d * 16 + c * VL);
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                  const vw x = splatw(qr[u][d]);
                  for (int c = 0; c < KV; c++) acc4[u][c] += x * kd[c];
                }
              }
              alignas(64) float sc[4][16];
              for (int u = 0; u < 4; u++)
                for (int c = 0; c < KV; c++) storew(sc[u] + c * VL, acc4[u][c]);
              for (int64_t u = 0; u < qn; u++) {
                const int64_t rr = q0 + u, i = i0 + rr / G;
                float *sr = s + (hh * nl * G + rr) * L + j0;
                if (!vis && j0 + jn - 1 <= first_new + i) {  /* the slot sees the whole block (every decode row) */
                  for (int64_t jj = 0; jj < jn; jj++) sr[jj] = sc[u][jj] * scale;
                  continue;
                }
                for (int64_t jj = 0; jj < jn; jj++)
                  sr[jj] = sees(j0 + jj, i, first_new, vis, n) ? sc[u][jj] * scale : -INFINITY;
              }
            }
          }
          continue;
        }
        for (int64_t jj = 0; jj < jn; jj++) {
          const int64_t j = j0 + jj;
          for (int64_t hh = 0; hh < per; hh++) {
            const float *kr = kb + jj * tok + hh * D;
            for (int64_t i = i0; i < i0 + nl; i++) {
              const bool see = sees(j, i, first_new, vis, n);
              const float *qr = q + ((b * n + i) * H + (h0 + hh) * G) * D;
              float *sr = s + ((hh * nl + i - i0) * G) * L + j;
              for (int64_t g = 0; g < G; g++) sr[g * L] = see ? dot(qr + g * D, kr, D) * scale : -INFINITY;
            }
          }
        }
      }
      /* softmax per query row over [ja, jb) (the -inf entries become 0) */
      for (int64_t r = 0; r < R; r++) {
        float *sr = s + r * L;
        float mx = -INFINITY;
        for (int64_t j = ja; j < jb; j++) mx = sr[j] > mx ? sr[j] : mx;
        if (ksplit > 1) { rmax[r] = mx; rsum[r] = 0.0f; }
        if (mx == -INFINITY) { inv[r] = 0.0f; memset(sr + ja, 0, sizeof(float) * (size_t)(jb - ja)); continue; }
        v8 sum8 = {0};
        int64_t j = ja;
        for (; j + 8 <= jb; j += 8) {
          const v8 e = vexp<v8, v8i>(load8(sr + j) - splat8(mx));
          store8(sr + j, e);
          sum8 += e;
        }
        float sum = hsum8(sum8);
        for (; j < jb; j++) { sr[j] = expf(sr[j] - mx); sum += sr[j]; }
        inv[r] = 1.0f / sum;
        if (ksplit > 1) rsum[r] = sum;
      }
      /* out = P V */
      memset(acc, 0, sizeof(float) * (size_t)R * D);
      if (jb > ja) prefetch_block(vp, table[ja / bs], h0, per);
      for (int64_t j0 = ja; j0 < jb; j0 += bs) {
        const int64_t jn = jb - j0 < bs ? jb - j0 : bs;
        int64_t tok;
        const float *vb = block_rows(vp, table[j0 / bs], jn, h0, per, rbuf, tok);
        if (j0 + bs < jb) prefetch_block(vp, table[j0 / bs + 1], h0, per);
        if (wide && D == 64) {
          /* each query row's 64 accumulators stay in registers across the block's keys */
          for (int64_t hh = 0; hh < per; hh++) {
            const float *vh = vb + hh * D;
            for (int64_t rr = 0; rr < nl * G; rr++) {
              const int64_t r = hh * nl * G + rr;
              const float *pr = s + r * L + j0;
              float *a = acc + r * D;
              constexpr int DV = 64 / VL;  /* the row's 64 accumulators: 4 vectors with AVX-512, 8 with AVX2 */
              vw x[DV];
              for (int c = 0; c < DV; c++) x[c] = loadw(a + c * VL);
              for (int64_t jj = 0; jj < jn; jj++) {
                const float p = pr[jj];
                if (p == 0.0f) continue;
                const vw pv = splatw(p);
                const float *vr = vh + jj * tok;
                for (int c = 0; c < DV; c++) x[c] += pv * loadw(vr + c * VL);
              }
              for (int c = 0; c < DV; c++) storew(a + c * VL, x[c]);
            }
          }
          continue;
        }
        for (int64_t jj = 0; jj < jn; jj++) {
          for (int64_t hh = 0; hh < per; hh++) {
            const float *vr = vb + jj * tok + hh * D;
            for (int64_t rr = 0; rr < nl * G; rr++) {
              const int64_t r = hh * nl * G + rr;
              const float p = s[r * L + j0 + jj];
              if (p == 0.0f) continue;
              float *a = acc + r * D;
              const v8 pv = splat8(p);
              int64_t d = 0;
              for (; d + 8 <= D; d += 8) store8(a + d, load8(a + d) + pv * load8(vr + d));
              for (; d < D; d++) a[d] += p * vr[d];
            }
          }
        }
      }
      for (int64_t hh = 0; hh < per; hh++)
        for (int64_t i = i0; i < i0 + nl; i++)
          for (int64_t g = 0; g < G; g++) {
            const int64_t r = (hh * nl + i - i0) * G + g;
            if (ksplit > 1) {  /* n == 1: one partial per (row, query head, part) */
              const int64_t e = (b * H + (h0 + hh) * G + g) * ksplit + kpart;
              part_m[e] = rmax[r];
              part_l[e] = rsum[r];
              memcpy(part_acc.data() + e * D, acc + r * D, sizeof(float) * (size_t)D);
              continue;
            }
            float *o = out + ((b * n + i) * H + (h0 + hh) * G + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv[r];
          }
    }
    if (ksplit > 1) {  /* after the loop's barrier: merge each (row, query head)'s parts */
#pragma omp for schedule(static)
      for (int64_t rh = 0; rh < B * H; rh++) {
        const float *m = part_m.data() + rh * ksplit, *l = part_l.data() + rh * ksplit;
        float mx = -INFINITY;
        for (int64_t k = 0; k < ksplit; k++) mx = m[k] > mx ? m[k] : mx;
        float *o = out + rh * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        if (mx == -INFINITY) continue;
        float sum = 0.0f;
        for (int64_t k = 0; k < ksplit; k++) {
          if (m[k] == -INFINITY) continue;
          const float w = expf(m[k] - mx);
          sum += w * l[k];
          const float *a = part_acc.data() + (rh * ksplit + k) * D;
          for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
        }
        const float is = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= is;
      }
    }
  }
}

/* Keys per chunk and output columns per register group of prefill_attention: KC score registers (or DG
   accumulators) plus a few operands fill the register file (32 zmm, 16 ymm). */
#ifdef __AVX512F__
static const int KC = 16, DG = 16;
#else
static const int KC = 8, DG = 8;
#endif

/* Most query tiles (VL rows each) per task of prefill_attention: the task's K/V are gathered once for them all,
   so the more tiles share a gather the better (32 against 8: 1.04-1.2x on 100-1000-token prompts), as long as
   there are tasks enough to keep the threads busy to the end (at least 4 per thread where the rows allow). */
static const int64_t PREFILL_TILES = 32, PREFILL_TASKS_PER_THREAD = 4;

struct PrefillTask { int64_t s, h, r0, r1, keys; };

/* One task of prefill_attention (below): rows [r0, r1) of one sequence and kv head, which see its first `keys`
   keys; kbuf, vbuf: room for them, rounded up to KC rows. */
template <int D>
static void prefill_task(const PrefillTask &tk, const float *q, float *out, int64_t H, int64_t G, int64_t n,
                         int64_t first, int64_t q0, const Pool &kp, const Pool &vp, const int64_t *table,
                         float scale, float *kbuf, float *vbuf) {
  const int64_t bs = kp.bs;
  alignas(64) float qt[D * VL], ot[D * VL], pb[KC * VL], posf[VL], inv[VL];
  /* the keys side by side, so every broadcast below is at a constant offset from one pointer; rows past the
     last key are zero (their scores are masked) */
  const int64_t padded = (tk.keys + KC - 1) / KC * KC;
  for (int64_t key = 0, b = 0, off = 0; key < tk.keys; key++) {
    const uint8_t *kr = kp.at(table[b], off, tk.h), *vr = vp.at(table[b], off, tk.h);
    if (kp.q8) {
      dequantize_row(kr, D, kbuf + key * D);
      dequantize_row(vr, D, vbuf + key * D);
    } else {
      memcpy(kbuf + key * D, kr, sizeof(float) * D);
      memcpy(vbuf + key * D, vr, sizeof(float) * D);
    }
    if (++off == bs) off = 0, b++;
  }
  memset(kbuf + tk.keys * D, 0, sizeof(float) * D * (padded - tk.keys));
  memset(vbuf + tk.keys * D, 0, sizeof(float) * D * (padded - tk.keys));
  const int64_t rows = n * G;
  for (int64_t r0 = tk.r0; r0 < tk.r1; r0 += VL) {
    for (int64_t u = 0; u < VL; u++) {  /* lanes past the last row repeat it and are not written */
      const int64_t r = r0 + u < rows ? r0 + u : rows - 1, i = r / G, g = r % G;
      const float *qr = q + (q0 + i) * H * D + (tk.h * G + g) * D;
      for (int d = 0; d < D; d++) qt[d * VL + u] = qr[d] * scale;
      posf[u] = (float)(first + i);
    }
    const vw pos = loadw(posf);
    const int64_t last = (r0 + VL < rows ? r0 + VL : rows) - 1;
    const int64_t min_pos = first + r0 / G, max_pos = first + last / G;
    vw m = splatw(-INFINITY), l = splatw(0.0f);
    memset(ot, 0, sizeof ot);
    for (int64_t j0 = 0; j0 <= max_pos; j0 += KC) {
      const float *kc = kbuf + j0 * D, *vc = vbuf + j0 * D;
      vw sc[KC];
      for (int j = 0; j < KC; j++) sc[j] = splatw(0.0f);
      for (int d = 0; d < D; d++) {
        const vw qd = loadw(qt + d * VL);
#pragma GCC unroll 16
        for (int j = 0; j < KC; j++) sc[j] += qd * splatw(kc[j * D + d]);
      }
      if (j0 + KC - 1 > min_pos)  /* the diagonal: a row sees keys up to its own position */
        for (int j = 0; j < KC; j++) sc[j] = pos >= splatw((float)(j0 + j)) ? sc[j] : splatw(-INFINITY);
      vw mx = m;
      for (int j = 0; j < KC; j++) mx = sc[j] > mx ? sc[j] : mx;
      const vw corr = vexp<vw, vwi>(m - mx);  /* key 0 is seen by every row, so mx is finite from the first chunk on */
      l *= corr;
      for (int j = 0; j < KC; j++) {
        const vw e = vexp<vw, vwi>(sc[j] - mx);
        l += e;
        storew(pb + j * VL, e);
      }
      m = mx;
      for (int d0 = 0; d0 < D; d0 += DG) {
        vw acc[DG];
#pragma GCC unroll 16
        for (int dd = 0; dd < DG; dd++) acc[dd] = loadw(ot + (d0 + dd) * VL) * corr;
#pragma GCC unroll 4
        for (int j = 0; j < KC; j++) {
          const vw pj = loadw(pb + j * VL);
#pragma GCC unroll 16
          for (int dd = 0; dd < DG; dd++) acc[dd] += pj * splatw(vc[j * D + d0 + dd]);
        }
#pragma GCC unroll 16
        for (int dd = 0; dd < DG; dd++) storew(ot + (d0 + dd) * VL, acc[dd]);
      }
    }
    storew(inv, splatw(1.0f) / l);
    for (int64_t u = 0; u < VL && r0 + u < rows; u++) {
      const int64_t r = r0 + u, i = r / G, g = r % G;
      float *o = out + (q0 + i) * H * D + (tk.h * G + g) * D;
      for (int d = 0; d < D; d++) o[d] = ot[d * VL + u] * inv[u];
    }
  }
}

/* Causal attention of prompt rows (whole prefills and chunks of them) over the paged pool, flash-style.
 * Query rows are (position, query head) pairs of one kv head, VL of them to a tile, one per vector lane.
 * Scores of KC keys sit in KC registers, one key each with the rows across the lanes, so the online softmax's
 * maxima and sums are lane-wise (no horizontal reductions) and K enters as broadcasts (no transpose); P·V
 * accumulates Oᵀ [D][lanes] DG columns at a time in registers. A task gathers its keys out of the pool once for
 * PREFILL_TILES tiles. torch's flash SDPA, which needs the kv heads repeated and K/V gathered per sequence,
 * reaches 50-120 GFLOP/s on SmolLM2's 1-1000-token prompts here.
 *
 * q, out: [T, H, D] (the step's packed tokens); sequence s's n = q_len[s] rows start at token q_start[s]
 * and sit at positions context_lens[s] - n + i. D: 16, 32, 64, 128 or 256 (returns false otherwise). The pools
 * are fp32, or with kv_int8 int8 rows (see Pool), dequantized as the task gathers its keys. */
extern "C" bool prefill_attention(const float *q, float *out, int64_t S, const int64_t *q_start,
                                  const int64_t *q_len, const int64_t *context_lens, int64_t H, int64_t D,
                                  const void *k_pool, const void *v_pool, int64_t bs, int64_t kvh,
                                  const int64_t *block_tables, int64_t max_blocks, float scale, bool kv_int8) {
  decltype(&prefill_task<64>) task;
  switch (D) {
    case 16: task = prefill_task<16>; break;
    case 32: task = prefill_task<32>; break;
    case 64: task = prefill_task<64>; break;
    case 128: task = prefill_task<128>; break;
    case 256: task = prefill_task<256>; break;
    default: return false;
  }
  const int64_t G = H / kvh;
  const Pool kp{(const uint8_t *)k_pool, bs, kvh, D, kv_int8}, vp{(const uint8_t *)v_pool, bs, kvh, D, kv_int8};
  int64_t all_tiles = 0;
  for (int64_t s = 0; s < S; s++) all_tiles += (q_len[s] * G + VL - 1) / VL * kvh;
  int64_t per_task = all_tiles / (PREFILL_TASKS_PER_THREAD * omp_get_max_threads());
  per_task = per_task < 1 ? 1 : per_task > PREFILL_TILES ? PREFILL_TILES : per_task;
  const int64_t span = per_task * VL;
  std::vector<PrefillTask> tasks;
  int64_t max_ctx = 0;
  for (int64_t s = 0; s < S; s++) {
    const int64_t rows = q_len[s] * G, first = context_lens[s] - q_len[s];
    max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    for (int64_t h = 0; h < kvh; h++)
      for (int64_t r0 = 0; r0 < rows; r0 += span) {
        const int64_t r1 = r0 + span < rows ? r0 + span : rows;
        tasks.push_back({s, h, r0, r1, first + (r1 - 1) / G + 1});
      }
  }
  /* longest first, so the threads finish together */
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask &a, const PrefillTask &b) { return a.keys > b.keys; });
  const int64_t nt = (int64_t)tasks.size(), room = (max_ctx + KC - 1) / KC * KC * D;
#pragma omp parallel if (nt > 1)
  {
    std::vector<float> kbuf(room), vbuf(room);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < nt; t++) {
      const PrefillTask &tk = tasks[t];
      task(tk, q, out, H, G, q_len[tk.s], context_lens[tk.s] - q_len[tk.s], q_start[tk.s], kp, vp,
           block_tables + tk.s * max_blocks, scale, kbuf.data(), vbuf.data());
    }
  }
  return true;
}

/* Elementwise work of a layer, fused into one pass each: in the torch path these are 3-8 kernels apiece
   (pow, mean, rsqrt, mul, ...), each a full read and write of the activations, and at a few rows each
   kernel's fixed cost (~20-90 us) outweighs its work. */

/* x[t] += delta[t] (delta may be NULL), then out[t] = x[t] / rms(x[t]) * w, for T rows of C. */
extern "C" void add_rms_norm(float *x, const float *delta, const float *w, float *out, int64_t T, int64_t C,
                             float eps) {
#pragma omp parallel for schedule(static) if (T * C >= 32768)
  for (int64_t t = 0; t < T; t++) {
    float *xr = x + t * C, *o = out + t * C;
    v8 ss8 = {0};
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
      v8 v = load8(xr + c);
      if (delta) { v += load8(delta + t * C + c); store8(xr + c, v); }
      ss8 += v * v;
    }
    float ss = hsum8(ss8);
    for (; c < C; c++) {
      if (delta) xr[c] += delta[t * C + c];
      ss += xr[c] * xr[c];
    }
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (c = 0; c + 8 <= C; c += 8) store8(o + c, load8(xr + c) * splat8(r) * load8(w + c));
    for (; c < C; c++) o[c] = xr[c] * r * w[c];
  }
}

static const int64_t KV_MAX_HEAD_DIM = 1024;  /* rope_write_kv's int8 path (the caller checks) */

/* x [D] as an int8 (token, head) row of Pool: q = round(x / s), s = max |x| / 127 (0 for a zero row), the
   same float operations as the torch path's quantize_kv, so both store the same bytes. */
static inline void quantize_row(const float *x, int64_t D, uint8_t *r) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
  const float s = amax / 127.0f;
  for (int64_t d = 0; d < D; d++) r[d] = (uint8_t)(int8_t)(s > 0.0f ? nearbyintf(x[d] / s) : 0.0f);
  memcpy(r + D, &s, 4);
}

/* Rotary embedding of q and k from the fused qkv rows ([T, (H + 2 kvh) D]), rotate-half layout, angles of
   each token's position from the cos/sin tables [max_pos, D/2]: q goes to q_out [T, H, D], k and v straight
   to their cache slots (pools [.., kvh, D] flat over slots: fp32, or with kv_int8 quantized into Pool's rows). */
extern "C" void rope_write_kv(const float *qkv, int64_t T, int64_t H, int64_t kvh, int64_t D,
                              const float *cos_table, const float *sin_table, const int64_t *positions,
                              float *q_out, void *k_pool, void *v_pool, const int64_t *slots, bool kv_int8) {
  const int64_t half = D / 2, row = (H + 2 * kvh) * D, kv_row = kv_int8 ? D + 4 : D * 4;
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; t++) {
    const float *cs = cos_table + positions[t] * half, *sn = sin_table + positions[t] * half;
    const float *src = qkv + t * row;
    uint8_t *k_slot = (uint8_t *)k_pool + slots[t] * kvh * kv_row, *v_slot = (uint8_t *)v_pool + slots[t] * kvh * kv_row;
    float kt[KV_MAX_HEAD_DIM];  /* a rotated key before it is quantized */
    for (int64_t h = 0; h < H + kvh; h++) {
      const float *x = src + h * D;
      float *o = h < H ? q_out + (t * H + h) * D : kv_int8 ? kt : (float *)(k_slot + (h - H) * kv_row);
      for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        o[i] = x1 * cs[i] - x2 * sn[i];
        o[i + half] = x2 * cs[i] + x1 * sn[i];
      }
      if (h >= H && kv_int8) quantize_row(o, D, k_slot + (h - H) * kv_row);
    }
    const float *v = src + (H + kvh) * D;
    if (!kv_int8) memcpy(v_slot, v, sizeof(float) * (size_t)(kvh * D));
    else
      for (int64_t h = 0; h < kvh; h++) quantize_row(v + h * D, D, v_slot + h * kv_row);
  }
}

/* out = silu(gate) * up = gate / (1 + e^-gate) * up, n elements. */
extern "C" void silu_mul(const float *gate, const float *up, float *out, int64_t n) {
  const int64_t chunks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t ch = 0; ch < chunks; ch++) {
    const int64_t e = (ch + 1) * 4096 < n ? (ch + 1) * 4096 : n;
    int64_t i = ch * 4096;
    for (; i + 8 <= e; i += 8) {
      const v8 g = load8(gate + i);
      const v8 neg = -g;
      const v8 ex = vexp<v8, v8i>(neg > splat8(88.0f) ? splat8(88.0f) : neg);
      store8(out + i, g / (splat8(1.0f) + ex) * load8(up + i));
    }
    for (; i < e; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
  }
}

/* out[m] = the first index of row m's largest value in x [M, V], NaN counting as largest (torch.argmax's
   answer): greedy sampling over the vocabulary, where torch's reduction reads at ~3 GB/s (4 ms at 64 rows). */
extern "C" void argmax_rows(const float *x, int64_t M, int64_t V, int64_t *out) {
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; m++) {
    const float *r = x + m * V;
    int64_t best = 0;
    float bv = r[0];
    for (int64_t j = 1; j < V && bv == bv; j++)
      if (r[j] > bv || r[j] != r[j]) { bv = r[j]; best = j; }
    out[m] = best;
  }
}

/* A decode step's decoder layers in one call (executor/model/llama.py's native decode loop): per layer the same kernels,
   in the same order, as the layer-by-layer native path, without Python's dispatch between them (~3 ms of a 30-layer
   batch-1 step). Every row is a sequence's one new token.
 *
 * desc: DECODE_LAYER_FIELDS int64 per layer: the two norms' weights, then the qkv, o, gate|up and down
 * projections, DECODE_PARTS parts of DECODE_PART_FIELDS each: (kind, weight, scales, n, k, group size, split);
 * kind 0: no part, 32: fp32 panels of pack_panels, 8 / 4: linear_quantized's int8 / int4 panels. Part j of a
 * projection writes its output j; a quantized part with a split writes both outputs.
 * x [T, C]: the residual stream, updated in place; delta [T, C]: the last layer's output, still to be added
 * (the first layer has none). pools: each layer's k and v pool. Attention: paged_attention over block_tables
 * [T, max_blocks] and context_lens [T]. */
static const int64_t DECODE_PARTS = 2, DECODE_PART_FIELDS = 7;
static const int64_t DECODE_LAYER_FIELDS = 2 + 4 * DECODE_PARTS * DECODE_PART_FIELDS;

extern "C" int64_t decode_layer_fields() { return DECODE_LAYER_FIELDS; }

/* One projection of the descriptor: y0 (and y1 for a second part or a split) = x [T, k] wᵀ. */
static void decode_project(const int64_t *p, const float *x, int64_t T, float *y0, float *y1) {
  for (int64_t j = 0; j < DECODE_PARTS; j++, p += DECODE_PART_FIELDS) {
    const int64_t kind = p[0], n = p[3], k = p[4], gs = p[5], split = p[6];
    float *y = j == 0 ? y0 : y1;
    if (kind == 0) return;
    const uint8_t *w = (const uint8_t *)p[1];
    if (kind == 32) linear_small(x, T, k, (const float *)w, n, y, n);
    else if (split) linear_quantized(x, T, k, w, (const void *)p[2], kind, gs, n, y, split, y1, split);
    else linear_quantized(x, T, k, w, (const void *)p[2], kind, gs, n, y, n, nullptr, n);
  }
}

extern "C" void decode_layers(const int64_t *desc, int64_t L, float *x, float *delta, int64_t T, int64_t C,
                              int64_t H, int64_t kvh, int64_t D, int64_t I, float eps, const float *cos_table,
                              const float *sin_table, const int64_t *positions, const int64_t *slots,
                              const int64_t *pools, bool kv_int8, int64_t bs, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *context_lens, float scale) {
  const int64_t proj = DECODE_PARTS * DECODE_PART_FIELDS;
  std::vector<float> h(T * C), qkv(T * (H + 2 * kvh) * D), q(T * H * D), att(T * H * D), a(T * C), gate(T * I),
      up(T * I), act(T * I);
  for (int64_t l = 0; l < L; l++) {
    const int64_t *d = desc + l * DECODE_LAYER_FIELDS;
    void *k_pool = (void *)pools[2 * l], *v_pool = (void *)pools[2 * l + 1];
    add_rms_norm(x, l ? delta : nullptr, (const float *)d[0], h.data(), T, C, eps);
    decode_project(d + 2, h.data(), T, qkv.data(), nullptr);
    rope_write_kv(qkv.data(), T, H, kvh, D, cos_table, sin_table, positions, q.data(), k_pool, v_pool, slots,
                  kv_int8);
    paged_attention(q.data(), att.data(), T, 1, H, D, k_pool, v_pool, bs, kvh, block_tables, max_blocks,
                    context_lens, nullptr, scale, kv_int8);
    decode_project(d + 2 + proj, att.data(), T, a.data(), nullptr);
    add_rms_norm(x, a.data(), (const float *)d[1], h.data(), T, C, eps);
    decode_project(d + 2 + 2 * proj, h.data(), T, gate.data(), up.data());
    silu_mul(gate.data(), up.data(), act.data(), T * I);
    decode_project(d + 2 + 3 * proj, act.data(), T, delta, nullptr);
  }
}
