// The multi-LoRA delta on the CPU in one call per projection (built and loaded by
// kernels/cpu_fused.py; kernels/lora_ops.add_lora_cpu calls it):
//
//   out[t, off_i + j] += sum_r (x[t] . A_s[slot, r]) * B_s[slot, j, r]     s = slices[i]
//
// for every token t of every segment (tokens of one adapter slot, at its rank), reading the
// stacks in the CPU layout of kernels/cpu_stacks.py:
//
//   a_t  [L, in, R*S]      rank-major columns: column r*S + s is row r of slice s's A
//   b_t  S x [L, R, n_s]   each slice's B transposed
//
// Work item: up to MB tokens of one segment. Its shrink h [MB, r*S] (every slice at once) is
// accumulated in registers, V columns at a time; then each slice's expand, V output columns at
// a time, is accumulated in registers and added into out (rounded once). Items run in parallel
// (at::parallel_for). The vector types are GCC's, lowered by -march=native to this CPU's
// AVX-512 or AVX2 (or whatever it has). Where the CPU has AVX512-BF16, bf16 activations on bf16
// stacks take the vdpbf16ps path instead (item_dp, below): same loops, bf16 pair dot products.
// Stacks made for that path keep their rows paired (`paired`, kernels/cpu_stacks.py):
//
//   a_t  [L, in/2, 2*R*S]      pair row k: rows 2k and 2k+1 of a_t above, interleaved
//   b_t  S x [L, R/2, 2*n_s]   (element 2c + p of pair row k is row 2k+p's column c)
//
// so a step of a pass loads 16 columns' pairs as they lie, one 512-bit load, where unpaired rows
// take two 256-bit loads, an insert and a permute. That is also how an AMX tile multiply takes
// its second operand: where the CPU has AMX-BF16, a call with tile_rows > 0 takes items of up to
// 16 tokens and multiplies those of at least tile_rows tokens on tiles (item_tiles, below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace loraplex_vec;

// With 32 (AVX-512) registers a pass takes NC = 2 vectors of columns for MB tokens (16
// accumulators); with 16 (AVX2) one (8 accumulators), or they spill.
#if defined(__AVX512F__)
constexpr int NC = 2;
#else
constexpr int NC = 1;
#endif
constexpr int MB = 8;  // tokens per work item: MB vector accumulators stay in registers

// Rows [0, m) in blocks of up to MB: CALL(M) for each block of M rows, its first row r0 in scope
// (the loops take M as a template argument: their accumulators are registers)
#define LORAPLEX_ROWS(m, CALL)                                       \
  for (int r0 = 0; r0 < static_cast<int>(m); r0 += MB) {             \
    switch (std::min<int>(MB, static_cast<int>(m) - r0)) {           \
      case 1: CALL(1); break; case 2: CALL(2); break;                \
      case 3: CALL(3); break; case 4: CALL(4); break;                \
      case 5: CALL(5); break; case 6: CALL(6); break;                \
      case 7: CALL(7); break; case 8: CALL(8); break;                \
    }                                                                \
  }

// o[0:V] = round(o[0:V] + acc): fp32 rows add and store; bf16 ones round to nearest even (NaN
// stays NaN), as c10::BFloat16 does element by element; others element by element.
template <typename O>
inline void add_store(O* o, vf acc) {
  for (int i = 0; i < V; ++i) o[i] = static_cast<O>(to_f(o[i]) + acc[i]);
}

template <>
inline void add_store<float>(float* o, vf acc) {
  vf v = load_v(o) + acc;
  __builtin_memcpy(o, &v, sizeof(vf));
}

template <>
inline void add_store<c10::BFloat16>(c10::BFloat16* o, vf acc) {
  vh out = round_bf16(load_v(o) + acc);
  __builtin_memcpy(o, &out, sizeof(vh));
}

// In a decode step the stacks come from memory (8 adapters' r16 stacks: 75 MiB, past the
// caches), in short streams the hardware prefetcher barely ramps up on: so each step of a pass
// asks for the rows PREFETCH_ROWS ahead, or, near its last rows, the same rows' next columns
// (the next pass's; an expand's pass reads only `rank` rows). 2-core Xeon (AVX512-BF16, AMX),
// 64 decode tokens over 8 adapters through the model's 120 projections: bf16 stacks 11.4-11.9 ->
// 8.1-8.8 ms a step, fp32 13.5-14.0 -> 11.6-12.2 ms; in the engine's mixed-adapter benchmark the
// kernel's share 0.95 -> 0.59 s. With the stacks already in cache it costs 10-15% (a 64-token
// prefill: unchanged in the engine). 8 and 16 rows ahead measured alike; 32 and 64 less well.
// Paired stacks' steps take a pair row each: they ask PREFETCH_ROWS / 2 pair rows ahead, the
// same rows (16 ahead: 4.0-4.6 ms a step in the measure above on a 2-core Zen 4 where 32 ahead
// took 3.8-5.9, the VM's noise).
constexpr int64_t PREFETCH_ROWS = 16;

template <typename W>
inline void prefetch_ahead(const W* w, int64_t k, int64_t rows, int64_t ldw, int64_t next_c0, int64_t width,
                           int step_rows, int64_t ahead = PREFETCH_ROWS) {
  // in integers: the address may lie past the stacks (a prefetch never faults)
  const int64_t at = k + ahead + 1 < rows ? (k + ahead) * ldw + next_c0 - width : k * ldw + next_c0;
  const uintptr_t base = reinterpret_cast<uintptr_t>(w) + static_cast<uintptr_t>(at) * sizeof(W);
  const uintptr_t span = static_cast<uintptr_t>(width) * sizeof(W);  // a row's part in this pass
  for (int i = 0; i < step_rows; ++i) {  // row k (+ ahead), and k + 1 where a step takes two
    const uintptr_t row = base + static_cast<uintptr_t>(i * ldw) * sizeof(W);
    __builtin_prefetch(reinterpret_cast<const void*>(row));
    __builtin_prefetch(reinterpret_cast<const void*>(row + span - 1));
  }
}

// h[t, c] = sum_k x_t[k] * a[k, c] for c < cols (a's rows lda apart); h rows `cols` apart.
// NC vectors of columns per pass: each x_t[k] is broadcast once for all NC.
template <int M, int NC, typename X, typename W>
inline void shrink_cols(const X* const* xrows, int64_t in, const W* a, int64_t lda, int64_t c0, int64_t cols,
                        float* h) {
  vf acc[M][NC];
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NC; ++c) acc[t][c] = vf{};
  for (int64_t k = 0; k < in; ++k) {
    prefetch_ahead(a, k, in, lda, c0 + NC * V, NC * V, 1);
    vf w[NC];
    for (int c = 0; c < NC; ++c) w[c] = load_v(a + k * lda + c0 + c * V);
    for (int t = 0; t < M; ++t) {
      const float xv = to_f(xrows[t][k]);
      for (int c = 0; c < NC; ++c) acc[t][c] += xv * w[c];
    }
  }
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NC; ++c) __builtin_memcpy(h + t * cols + c0 + c * V, &acc[t][c], sizeof(vf));
}

template <int M, typename X, typename W>
void shrink(const X* const* xrows, int64_t in, const W* a, int64_t lda, int64_t cols, float* h) {
  int64_t c0 = 0;
  for (; c0 + NC * V <= cols; c0 += NC * V) shrink_cols<M, NC>(xrows, in, a, lda, c0, cols, h);
  for (; c0 + V <= cols; c0 += V) shrink_cols<M, 1>(xrows, in, a, lda, c0, cols, h);
  for (; c0 < cols; ++c0) {  // the columns past the last whole vector
    for (int t = 0; t < M; ++t) {
      float sum = 0.f;
      for (int64_t k = 0; k < in; ++k) sum += to_f(xrows[t][k]) * to_f(a[k * lda + c0]);
      h[t * cols + c0] = sum;
    }
  }
}

// o_t[j] += sum_r h[t, r*S + s] * b[r, j] for j < n (b's rows n apart); h rows hcols apart.
// NC vectors of output columns per pass: each h value is broadcast once for all NC.
template <int M, int NC, typename O, typename W>
inline void expand_cols(O* const* orows, const float* h, int64_t hcols, int64_t S, int64_t s, int64_t rank,
                        const W* b, int64_t n, int64_t j0) {
  vf acc[M][NC];
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NC; ++c) acc[t][c] = vf{};
  for (int64_t r = 0; r < rank; ++r) {
    prefetch_ahead(b, r, rank, n, j0 + NC * V, NC * V, 1);
    vf w[NC];
    for (int c = 0; c < NC; ++c) w[c] = load_v(b + r * n + j0 + c * V);
    for (int t = 0; t < M; ++t) {
      const float hv = h[t * hcols + r * S + s];
      for (int c = 0; c < NC; ++c) acc[t][c] += hv * w[c];
    }
  }
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NC; ++c) add_store(orows[t] + j0 + c * V, acc[t][c]);
}

template <int M, typename O, typename W>
void expand(O* const* orows, const float* h, int64_t hcols, int64_t S, int64_t s, int64_t rank,
            const W* b, int64_t n) {
  int64_t j0 = 0;
  for (; j0 + NC * V <= n; j0 += NC * V) expand_cols<M, NC>(orows, h, hcols, S, s, rank, b, n, j0);
  for (; j0 + V <= n; j0 += V) expand_cols<M, 1>(orows, h, hcols, S, s, rank, b, n, j0);
  for (; j0 < n; ++j0) {
    for (int t = 0; t < M; ++t) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r) sum += h[t * hcols + r * S + s] * to_f(b[r * n + j0]);
      orows[t][j0] = static_cast<O>(to_f(orows[t][j0]) + sum);
    }
  }
}

// lda: the columns of a_t's rows (R*S); widths: each added slice's columns. Paired stacks have
// the same slot pitches (in * lda, max_rank * width) as unpaired ones.
struct Args {
  int64_t in, x_pitch, out_pitch, lda, max_rank, num_slices;
  std::vector<int64_t> slices, offsets, widths;
  bool paired;
  int64_t tile_rows;  // items of at least this many tokens multiply on AMX tiles (0: none)
};

template <int M, typename X, typename W>
void item(const Args& g, const X* x, X* out, const int64_t* ids, const W* a_slot,
          const std::vector<const W*>& b_slot, int64_t rank, float* h) {
  const X* xrows[M];
  X* orows[M];
  for (int t = 0; t < M; ++t) {
    xrows[t] = x + ids[t] * g.x_pitch;
    orows[t] = out + ids[t] * g.out_pitch;
  }
  const int64_t cols = rank * g.num_slices;  // rank-major: rank r's columns are a prefix
  shrink<M>(xrows, g.in, a_slot, g.lda, cols, h);
  for (size_t i = 0; i < g.slices.size(); ++i) {
    X* o[M];
    for (int t = 0; t < M; ++t) o[t] = orows[t] + g.offsets[i];
    expand<M>(o, h, cols, g.num_slices, g.slices[i], rank, b_slot[i], g.widths[i]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// bf16 activations on bf16 stacks where the CPU has AVX512-BF16 (Zen 4, Cooper Lake, Sapphire
// Rapids and later): vdpbf16ps multiplies pairs of bf16 and adds both products into one fp32
// lane, twice the multiply-adds of an fp32 FMA per instruction, and the activations need no
// widening (a pair is broadcast as it is). The pairs run along the reduction: rows k and k+1 of
// a_t for the shrink, rows r and r+1 of b_t for the expand: stored so (paired stacks, what the
// engine makes for this path), or interleaved as they load. Paired, a projection's delta took
// 4-15% less time (2-core AMD EPYC, Zen 4: 64 decode tokens over 8 adapters through the model's
// 120 projections, 2.92 -> 2.80 ms with the stacks in cache, 4.28 -> 3.87 ms streaming; a 512-token
// prefill 0.61 -> 0.55 ms a layer). The shrink's h is rounded to bf16 before the expand, as
// torch's and PEFT's bf16 products round it.
#define LORAPLEX_DPBF16 1
constexpr int DP = 16;  // output columns per vector: 16 fp32 lanes, each fed one bf16 pair

// 16 columns of two rows interleaved into pairs: element 2j = row0[j], 2j+1 = row1[j]; columns at
// or past the mask's end read as zero, and so does row1 unless PAIR (an odd row count's end: row1
// is not read).
template <bool PAIR>
inline __m512i pair_rows(const c10::BFloat16* row0, const c10::BFloat16* row1, __mmask16 m, __m512i order) {
  const __m256i lo = _mm256_maskz_loadu_epi16(m, row0);
  const __m256i hi = PAIR ? _mm256_maskz_loadu_epi16(m, row1) : _mm256_setzero_si256();
  return _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

inline __m512i pair_order() {  // output element 2j <- input j, 2j+1 <- input 16 + j
  alignas(64) int16_t idx[32];
  for (int j = 0; j < 16; ++j) idx[2 * j] = static_cast<int16_t>(j), idx[2 * j + 1] = static_cast<int16_t>(16 + j);
  return _mm512_load_si512(idx);
}

inline __m512i broadcast_pair(const c10::BFloat16* p, bool has_second) {  // (p[0], p[1] or 0)
  if (has_second) {  // straight from memory: a load-port broadcast, not a shuffle-port one
    float v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_castps_si512(_mm512_set1_ps(v));
  }
  uint32_t v = 0;
  __builtin_memcpy(&v, p, 2);
  return _mm512_set1_epi32(static_cast<int>(v));
}

inline __mmask16 cols_mask(int64_t cols_left) {
  return cols_left >= DP ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols_left) - 1);
}

// The mask of a paired row's 32 bf16 for the columns of column mask m: both of each pair, or
// (ODD: an odd row count's last row, whose partner is past the rank) the first alone
template <bool ODD>
inline __mmask32 pair_mask(__mmask16 m) {
  const uint32_t both = static_cast<uint32_t>(_pdep_u32(m, 0x55555555u)) * 3u;
  return static_cast<__mmask32>(ODD ? both & 0x55555555u : both);
}

// acc[t][c] += src_t[k] * w[k, ...] + src_t[k+1] * w[k+1, ...] for the NB column vectors at c0
// (masks m): one step of a pass (k even). PAIR false: row k alone, paired with zero (an odd row
// count's last row). PAIRED: w's rows are paired (ldw: the columns of one row; a pair row holds
// 2*ldw), so rows k and k+1 of 16 columns are one load.
template <int M, int NB, bool PAIR, bool PAIRED>
__attribute__((always_inline)) inline void dp_step(__m512 (&acc)[M][NB], const c10::BFloat16* const* src,
                                                   int64_t k, int64_t rows, const c10::BFloat16* w, int64_t ldw,
                                                   int64_t c0, const __mmask16 (&m)[NB], __m512i order) {
  __m512i wp[NB];
  if constexpr (PAIRED) {
    prefetch_ahead(w, k / 2, (rows + 1) / 2, 2 * ldw, 2 * (c0 + NB * DP), 2 * NB * DP, 1, PREFETCH_ROWS / 2);
    for (int c = 0; c < NB; ++c)  // pair row k/2 starts at (k/2) * 2*ldw = k*ldw
      wp[c] = _mm512_maskz_loadu_epi16(pair_mask<!PAIR>(m[c]), w + k * ldw + 2 * (c0 + c * DP));
  } else {
    prefetch_ahead(w, k, rows, ldw, c0 + NB * DP, NB * DP, 2);
    for (int c = 0; c < NB; ++c)
      wp[c] = pair_rows<PAIR>(w + k * ldw + c0 + c * DP, w + (k + 1) * ldw + c0 + c * DP, m[c], order);
  }
  for (int t = 0; t < M; ++t) {
    const __m512i xp = broadcast_pair(src[t] + k, PAIR);
    for (int c = 0; c < NB; ++c) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], (__m512bh)xp, (__m512bh)wp[c]);
  }
}

// One pass over `rows` rows (src_t[k] * w[k, c] summed over k, rows ldw apart, src_t the t-th
// row's bf16 values, contiguous in k) for the output columns [c0, c0 + NB*DP) (fewer at the
// edge), the accumulators then handed to `store(t, c, acc, mask)`. The accumulators stay in
// registers for the whole pass and go through memory once, after it: GCC 12 otherwise kept a
// stack copy of each one up to date inside the loop, 24 zmm stores per 24 vdpbf16ps (with them
// in an array a lambda captured by reference, and with `store` reading them straight from the
// registers), and the loops ran store-bound at about half the dot products' rate. Without them
// (2-core AMD EPYC, Zen 4, one decoder block's deltas): a 1024-token prefill over 4 adapters
// 3.05-3.09 -> 2.09-2.15 ms, 64 decode tokens over 8 adapters 0.25-0.29 -> 0.18-0.23 ms.
template <int M, int NB, bool PAIRED, typename Store>
inline void dp_pass(const c10::BFloat16* const* src, int64_t rows, const c10::BFloat16* w, int64_t ldw, int64_t c0,
                    int64_t cols, __m512i order, Store store) {
  __mmask16 m[NB];
  for (int c = 0; c < NB; ++c) m[c] = cols_mask(cols - c0 - c * DP);
  __m512 acc[M][NB];
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NB; ++c) acc[t][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < rows; k += 2) dp_step<M, NB, true, PAIRED>(acc, src, k, rows, w, ldw, c0, m, order);
  if (k < rows) dp_step<M, NB, false, PAIRED>(acc, src, k, rows, w, ldw, c0, m, order);
  alignas(64) float sums[M][NB][DP];
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NB; ++c) _mm512_store_ps(sums[t][c], acc[t][c]);
  for (int t = 0; t < M; ++t)
    for (int c = 0; c < NB; ++c) store(t, c0 + c * DP, _mm512_load_ps(sums[t][c]), m[c]);
}

// Every output column of w (rows x cols, rows ldw apart; PAIRED: in pairs of rows 2*ldw apart) in
// passes of up to 3 vectors: M x 3 accumulators, 3 weight pairs and a broadcast fit AVX-512's 32
// registers.
constexpr int64_t PASS = 3 * DP;
template <int M, bool PAIRED, typename Store>
inline void dp_columns(const c10::BFloat16* const* src, int64_t rows, const c10::BFloat16* w, int64_t ldw,
                       int64_t cols, __m512i order, Store store) {
  for (int64_t c0 = 0; c0 < cols; c0 += PASS) {
    const int64_t left = cols - c0;
    if (left > 2 * DP)
      dp_pass<M, 3, PAIRED>(src, rows, w, ldw, c0, cols, order, store);
    else if (left > DP)
      dp_pass<M, 2, PAIRED>(src, rows, w, ldw, c0, cols, order, store);
    else
      dp_pass<M, 1, PAIRED>(src, rows, w, ldw, c0, cols, order, store);
  }
}

// h[t, c] = bf16(x_t . a[:, c]) for c < cols (h rows `cols` apart): shrink() rounded to bf16
// as it leaves the registers, as torch's and PEFT's bf16 products round it
template <int M, bool PAIRED>
void shrink_dp(const c10::BFloat16* const* xrows, int64_t in, const c10::BFloat16* a, int64_t lda, int64_t cols,
               c10::BFloat16* h, __m512i order) {
  const auto store = [&](int t, int64_t c, __m512 acc, __mmask16 m) {
    _mm256_mask_storeu_epi16(h + t * cols + c, m, (__m256i)_mm512_cvtneps_pbh(acc));
  };
  dp_columns<M, PAIRED>(xrows, in, a, lda, cols, order, store);
}

// o[j] = bf16(o[j] + acc[j]) for the 16 columns of mask m (a prefix): vcvtneps2bf16 rounds to
// nearest even and keeps NaN, as c10::BFloat16 does (fp32 denormals, below 1.2e-38, become 0).
inline void add_store_dp(c10::BFloat16* o, __m512 acc, __mmask16 m) {
  const __m512i old = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, o)), 16);
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(old), acc);
  _mm256_mask_storeu_epi16(o, m, (__m256i)_mm512_cvtneps_pbh(sum));
}

// o_t[j] += sum_r hb_t[r] * b[r, j] for j < n (b's rows n apart); hb_t: the slice's h, bf16
template <int M, bool PAIRED>
void expand_dp(c10::BFloat16* const* orows, const c10::BFloat16* const* hb, int64_t rank, const c10::BFloat16* b,
               int64_t n, __m512i order) {
  const auto store = [&](int t, int64_t j, __m512 acc, __mmask16 m) { add_store_dp(orows[t] + j, acc, m); };
  dp_columns<M, PAIRED>(hb, rank, b, n, n, order, store);
}

// item() for bf16 on bf16. hb: scratch for M rows of h in bf16 [M, rank*S], then one slice's
// values made adjacent [M, rank] (h is rank-major: slice s of rank r is column r*S + s)
template <int M, bool PAIRED>
void item_dp(const Args& g, const c10::BFloat16* x, c10::BFloat16* out, const int64_t* ids, const c10::BFloat16* a_slot,
             const std::vector<const c10::BFloat16*>& b_slot, int64_t rank, c10::BFloat16* hb) {
  static const __m512i order = pair_order();
  const int64_t S = g.num_slices, cols = rank * S;
  c10::BFloat16* h = hb;
  c10::BFloat16* slice_h = hb + M * cols;
  const c10::BFloat16* xrows[M];
  c10::BFloat16* orows[M];
  const c10::BFloat16* hrows[M];
  for (int t = 0; t < M; ++t) {
    xrows[t] = x + ids[t] * g.x_pitch;
    orows[t] = out + ids[t] * g.out_pitch;
    hrows[t] = S == 1 ? h + t * cols : slice_h + t * rank;
  }
  shrink_dp<M, PAIRED>(xrows, g.in, a_slot, g.lda, cols, h, order);
  for (size_t i = 0; i < g.slices.size(); ++i) {
    const int64_t s = g.slices[i];
    if (S > 1)
      for (int t = 0; t < M; ++t)
        for (int64_t r = 0; r < rank; ++r) slice_h[t * rank + r] = h[t * cols + r * S + s];
    c10::BFloat16* o[M];
    for (int t = 0; t < M; ++t) o[t] = orows[t] + g.offsets[i];
    expand_dp<M, PAIRED>(o, hrows, rank, b_slot[i], g.widths[i], order);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tile products (Sapphire Rapids and later) on paired stacks: their pair rows are the layout
// a tile multiply takes its second operand in (16 pair rows of 16 columns: 16 rows of 64 bytes),
// so a K step of 16 pairs is one tile load of the stacks as they lie. Items of up to TM tokens;
// tmm0-2 accumulate 3 column blocks of 16 (m rows of fp32), tmm3 holds the activations (m rows
// of 16 pairs), tmm4 and tmm5 the stacks' blocks, alternating; tmm6 and tmm7 the reduction's last
// kr < 16 pairs. Columns past the last whole block of 16 take the vdpbf16ps passes above.
#define LORAPLEX_TILES 1
constexpr int TM = 16;  // tokens per tile item: a tile's rows
constexpr int TK = 16;  // pairs of the reduction per step: 64 bytes of a tile row
constexpr int TN = 16;  // fp32 columns of a C tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig tile_config(int m, int kr) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = static_cast<uint8_t>(m), c.colsb[i] = 64;  // C, A
  c.rows[4] = c.rows[5] = TK, c.colsb[4] = c.colsb[5] = 64;                         // B
  if (kr) {
    c.rows[6] = static_cast<uint8_t>(m), c.colsb[6] = static_cast<uint16_t>(4 * kr);
    c.rows[7] = static_cast<uint8_t>(kr), c.colsb[7] = 64;
  }
  return c;
}

// The configuration loaded on this thread, reloaded only when another is asked for. oneDNN's
// AMX kernels load their own and release the tiles when they end; so does a call of ours
// (tiles_end), and the next one starts with none loaded.
thread_local TileConfig tile_loaded;
thread_local bool tile_is_loaded = false;

inline void use_tiles(int m, int kr) {
  const TileConfig c = tile_config(m, kr);
  if (tile_is_loaded && std::memcmp(&c, &tile_loaded, sizeof c) == 0) return;
  _tile_loadconfig(&c);
  tile_loaded = c;
  tile_is_loaded = true;
}

inline void tiles_end() {
  if (tile_is_loaded) _tile_release();
  tile_is_loaded = false;
}

// Asks for the NB blocks of `rows` pair rows at b (ldb bytes apart): a step's stacks, one step
// ahead (in integers: the address may lie past the stacks; a prefetch never faults)
template <int NB>
inline void tile_prefetch(const char* b, int64_t ldb, int64_t rows) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(b);
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < NB; ++c) __builtin_prefetch(reinterpret_cast<const void*>(at + r * ldb + 64 * c));
}

// One step of a pass in tile_pass: the activations' tile TA from a, then each column block's
// stacks into TB0 and TB1 in turn, multiplied into C tiles 0..NB-1. A macro: GCC's tile
// intrinsics paste the tile's number into the instruction's text, so it must be a literal.
#define LORAPLEX_TILE_STEP(TA, TB0, TB1, a, b)       \
  do {                                               \
    _tile_loadd(TA, a, a_stride);                    \
    _tile_loadd(TB0, b, ldb);                        \
    _tile_dpbf16ps(0, TA, TB0);                      \
    if constexpr (NB > 1) {                          \
      _tile_loadd(TB1, (b) + 64, ldb);               \
      _tile_dpbf16ps(1, TA, TB1);                    \
    }                                                \
    if constexpr (NB > 2) {                          \
      _tile_loadd(TB0, (b) + 128, ldb);              \
      _tile_dpbf16ps(2, TA, TB0);                    \
    }                                                \
  } while (0)

// c[t, 0:NB*16] = sum over K of a_t[k] * w[k, c0:...] for m rows: `pairs` pair rows of w (4*ldw
// bytes apart, ldw: the columns of an unpaired row), a's rows `a_stride` bytes apart; then stored
// into c (rows c_stride bytes apart). A configuration with tiles 6 and 7 for pairs % TK must be
// loaded (use_tiles).
template <int NB>
inline void tile_pass(const c10::BFloat16* a, int64_t a_stride, int64_t pairs, const c10::BFloat16* w, int64_t ldw,
                      int64_t c0, float* c, int64_t c_stride) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  const int64_t ldb = 4 * ldw, full = pairs / TK * TK;
  const char* b = reinterpret_cast<const char*>(w + 2 * c0);
  // the next pass's first step: the same rows' next columns
  const char* next_pass = b + 64 * NB;
  for (int64_t k = 0; k < full; k += TK, b += TK * ldb) {
    if (k + TK < pairs)
      tile_prefetch<NB>(b + TK * ldb, ldb, std::min<int64_t>(TK, pairs - k - TK));
    else
      tile_prefetch<3>(next_pass, ldb, std::min<int64_t>(TK, pairs));
    LORAPLEX_TILE_STEP(3, 4, 5, a + 2 * k, b);
  }
  if (full < pairs) {  // the last kr pairs: tiles 6 and 7, configured for them
    tile_prefetch<3>(next_pass, ldb, std::min<int64_t>(TK, pairs));
    LORAPLEX_TILE_STEP(6, 7, 7, a + 2 * full, b);
  }
  _tile_stored(0, c, c_stride);
  if constexpr (NB > 1) _tile_stored(1, c + TN, c_stride);
  if constexpr (NB > 2) _tile_stored(2, c + 2 * TN, c_stride);
}
#undef LORAPLEX_TILE_STEP

// Every whole block of 16 columns of w in passes of up to 3 blocks; `store(c0, acc, width)`
// then takes acc [m rows of `width` columns, TN*3 floats apart]. Returns the columns done.
template <typename Store>
inline int64_t tile_columns(const c10::BFloat16* a, int64_t a_stride, int64_t pairs, const c10::BFloat16* w,
                            int64_t ldw, int64_t cols, float* acc, Store store) {
  const int64_t whole = cols / TN * TN;
  for (int64_t c0 = 0; c0 < whole; c0 += 3 * TN) {
    const int64_t width = std::min<int64_t>(3 * TN, whole - c0);
    if (width == 3 * TN)
      tile_pass<3>(a, a_stride, pairs, w, ldw, c0, acc, 3 * TN * 4);
    else if (width == 2 * TN)
      tile_pass<2>(a, a_stride, pairs, w, ldw, c0, acc, 3 * TN * 4);
    else
      tile_pass<1>(a, a_stride, pairs, w, ldw, c0, acc, 3 * TN * 4);
    store(c0, acc, width);
  }
  return whole;
}

// item_dp() for up to TM tokens on paired stacks, on tiles. xs: scratch [TM, in] for scattered
// tokens' rows; hb: [TM, lda + max_rank] bf16; acc: [TM, 3*TN] fp32.
inline void item_tiles(const Args& g, const c10::BFloat16* x, c10::BFloat16* out, const int64_t* ids, int m,
                       const c10::BFloat16* a_slot, const std::vector<const c10::BFloat16*>& b_slot, int64_t rank,
                       c10::BFloat16* xs, c10::BFloat16* hb, float* acc) {
  static const __m512i order = pair_order();
  const int64_t S = g.num_slices, cols = rank * S, in = g.in;
  // the tokens' rows: in place where they are consecutive, else gathered
  bool consecutive = true;
  for (int t = 1; t < m; ++t) consecutive = consecutive && ids[t] == ids[0] + t;
  const c10::BFloat16* xa = x + ids[0] * g.x_pitch;
  int64_t xa_stride = g.x_pitch * 2;
  if (!consecutive) {
    for (int t = 0; t < m; ++t) std::memcpy(xs + t * in, x + ids[t] * g.x_pitch, in * 2);
    xa = xs, xa_stride = in * 2;
  }
  // shrink: h [m, cols] bf16, rank-major. One configuration serves both phases where at most one
  // has a reduction's end past its last whole step (loading one costs as much as a few products)
  const int64_t hp = (rank + 1) / 2 * 2;  // h's row length as the expand reads it (even)
  const int kr_shrink = static_cast<int>((in / 2) % TK), kr_expand = static_cast<int>((hp / 2) % TK);
  c10::BFloat16* h = hb;
  use_tiles(m, kr_shrink ? kr_shrink : kr_expand);
  const int64_t done = tile_columns(xa, xa_stride, in / 2, a_slot, g.lda, cols, acc,
                                    [&](int64_t c0, const float* a, int64_t width) {
    for (int t = 0; t < m; ++t)
      for (int64_t c = 0; c < width; c += TN)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + t * cols + c0 + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + t * 3 * TN + c)));
  });
  if (done < cols) {  // the last columns, on vdpbf16ps
    const c10::BFloat16* xrows[TM];
    for (int t = 0; t < m; ++t) xrows[t] = xa + t * (xa_stride / 2);
#define LORAPLEX_SHRINK_TAIL(M)                                                                        \
  dp_pass<M, 1, true>(xrows + r0, in, a_slot, g.lda, done, cols, order,                               \
                      [&](int t, int64_t c, __m512 v, __mmask16 mk) {                                 \
                        _mm256_mask_storeu_epi16(h + (r0 + t) * cols + c, mk, (__m256i)_mm512_cvtneps_pbh(v)); \
                      })
    LORAPLEX_ROWS(m, LORAPLEX_SHRINK_TAIL)
#undef LORAPLEX_SHRINK_TAIL
  }
  // each slice's expand: its h [m, rank] (even: an odd rank's last pair with a zero), added into out
  c10::BFloat16* slice_h = hb + TM * cols;
  use_tiles(m, kr_expand ? kr_expand : kr_shrink);
  for (size_t i = 0; i < g.slices.size(); ++i) {
    const int64_t s = g.slices[i], n = g.widths[i];
    for (int t = 0; t < m; ++t) {
      for (int64_t r = 0; r < rank; ++r) slice_h[t * hp + r] = h[t * cols + r * S + s];
      if (hp > rank) slice_h[t * hp + rank] = c10::BFloat16(0.f);
    }
    c10::BFloat16* o = out + g.offsets[i];
    const int64_t whole = tile_columns(slice_h, hp * 2, hp / 2, b_slot[i], n, n, acc,
                                       [&](int64_t j0, const float* a, int64_t width) {
      for (int t = 0; t < m; ++t)
        for (int64_t c = 0; c < width; c += TN)
          add_store_dp(o + ids[t] * g.out_pitch + j0 + c, _mm512_loadu_ps(a + t * 3 * TN + c), 0xffff);
    });
    if (whole < n) {
      const c10::BFloat16* hrows[TM];
      c10::BFloat16* orows[TM];
      for (int t = 0; t < m; ++t) hrows[t] = slice_h + t * hp, orows[t] = o + ids[t] * g.out_pitch;
#define LORAPLEX_EXPAND_TAIL(M)                                                         \
  dp_pass<M, 1, true>(hrows + r0, rank, b_slot[i], n, whole, n, order,                 \
                      [&](int t, int64_t j, __m512 v, __mmask16 mk) { add_store_dp(orows[r0 + t] + j, v, mk); })
      LORAPLEX_ROWS(m, LORAPLEX_EXPAND_TAIL)
#undef LORAPLEX_EXPAND_TAIL
    }
  }
}
#endif
#endif

// This thread's scratch of at least n elements (contents undefined), kept from call to call: a
// decode step makes 120 calls, each on both threads, and fresh zeroed buffers (up to 49 KiB of
// gathered rows) cost more than a one-token item's products. `Which` tells two of one type apart.
template <typename T, int Which = 0>
T* scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

template <typename X, typename W>
void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t, const std::vector<at::Tensor>& b_t,
         Args g, const at::Tensor& token_ids, const at::Tensor& segments) {
  const X* xp = x.data_ptr<X>();
  X* op = out.data_ptr<X>();
  const W* ap = a_t.data_ptr<W>();
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int64_t* seg = segments.data_ptr<int64_t>();  // [G, 4]: start, length, slot, rank
  std::vector<std::pair<int64_t, int64_t>> items;     // (segment, its first token of the item)
#ifdef LORAPLEX_TILES
  const int64_t item_tokens = g.tile_rows > 0 ? TM : MB;
#else
  const int64_t item_tokens = MB;
#endif
  for (int64_t s = 0; s < segments.size(0); ++s)
    for (int64_t t0 = 0; t0 < seg[s * 4 + 1]; t0 += item_tokens) items.emplace_back(s, t0);
  std::vector<const W*> b_base;
  for (int64_t sl : g.slices) b_base.push_back(b_t[sl].data_ptr<W>());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    float* h = scratch<float>(MB * g.lda);
    c10::BFloat16* hb = scratch<c10::BFloat16>(item_tokens * (g.lda + g.max_rank));
    std::vector<const W*> b_slot(g.slices.size());
#ifdef LORAPLEX_TILES
    c10::BFloat16* xs = scratch<c10::BFloat16, 1>(g.tile_rows > 0 ? TM * g.in : 0);
    alignas(64) float acc[TM * 3 * TN];
#endif
    for (int64_t it = begin; it < end; ++it) {
      const int64_t* sg = seg + items[it].first * 4;
      const int64_t t0 = items[it].second, slot = sg[2], rank = sg[3];
      const int64_t m = std::min<int64_t>(item_tokens, sg[1] - t0);
      const W* a_slot = ap + slot * g.in * g.lda;
      for (size_t i = 0; i < g.slices.size(); ++i) b_slot[i] = b_base[i] + slot * g.max_rank * g.widths[i];
      const int64_t* item_ids = ids + sg[0] + t0;
#ifdef LORAPLEX_TILES
      if constexpr (std::is_same_v<X, c10::BFloat16> && std::is_same_v<W, c10::BFloat16>) {
        if (g.tile_rows > 0 && m >= g.tile_rows) {
          item_tiles(g, xp, op, item_ids, static_cast<int>(m), a_slot, b_slot, rank, xs, hb, acc);
          continue;
        }
      }
#endif
#ifdef LORAPLEX_DPBF16
#define LORAPLEX_ITEM(K)                                                                   \
  if constexpr (std::is_same_v<X, c10::BFloat16> && std::is_same_v<W, c10::BFloat16>) {   \
    if (g.paired)                                                                          \
      item_dp<K, true>(g, xp, op, item_ids + r0, a_slot, b_slot, rank, hb);                \
    else                                                                                   \
      item_dp<K, false>(g, xp, op, item_ids + r0, a_slot, b_slot, rank, hb);               \
  } else                                                                                   \
    item<K>(g, xp, op, item_ids + r0, a_slot, b_slot, rank, h)
#else
#define LORAPLEX_ITEM(K) item<K>(g, xp, op, item_ids + r0, a_slot, b_slot, rank, h)
#endif
      LORAPLEX_ROWS(m, LORAPLEX_ITEM)
#undef LORAPLEX_ITEM
    }
#ifdef LORAPLEX_TILES
    tiles_end();
#endif
  });
}

// Checks everything the loops rely on (the Python side checks too; this keeps a wrong call
// from reading or writing out of bounds).
Args check(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t, const std::vector<at::Tensor>& b_t,
           const std::vector<int64_t>& slices, const std::vector<int64_t>& offsets, const at::Tensor& token_ids,
           const at::Tensor& segments, bool paired, int64_t tile_rows) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && a_t.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "x [T, in] and out [T, n] expected");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out must share a dtype");
  const int64_t P = paired ? 2 : 1;  // rows per stored row
  if (paired)
    TORCH_CHECK(loraplex_ops::pairs_bf16() && x.scalar_type() == at::kBFloat16 && a_t.scalar_type() == at::kBFloat16,
                "paired stacks take bf16 activations on bf16 stacks, on a CPU with AVX512-BF16");
  TORCH_CHECK(tile_rows >= 0, "tile_rows must be >= 0");
  TORCH_CHECK(tile_rows == 0 || (paired && loraplex_ops::tiles_bf16()),
              "tile products take paired stacks, on a CPU with AMX-BF16 that the OS lets use it");
  TORCH_CHECK(a_t.dim() == 3 && a_t.is_contiguous() && a_t.size(1) * P == x.size(1),
              paired ? "a_t [L, in/2, 2*R*S] contiguous expected" : "a_t [L, in, R*S] contiguous expected");
  const int64_t S = static_cast<int64_t>(b_t.size());
  TORCH_CHECK(S >= 1 && a_t.size(2) % (S * P) == 0, "a_t's columns must be max_rank * len(b_t)", paired ? " * 2" : "");
  const int64_t lda = a_t.size(2) / P;
  Args g{x.size(1), x.stride(0), out.stride(0), lda, lda / S, S, slices, offsets, {}, paired, tile_rows};
  TORCH_CHECK(g.max_rank % P == 0, "paired stacks need an even max_rank");
  for (const auto& b : b_t) {
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.scalar_type() == a_t.scalar_type() &&
                    b.size(0) == a_t.size(0) && b.size(1) * P == g.max_rank && b.size(2) % P == 0 &&
                    b.device().is_cpu(),
                paired ? "each b_t must be [L, max_rank/2, 2*n_s], contiguous, in a_t's dtype"
                       : "each b_t must be [L, max_rank, n_s], contiguous, in a_t's dtype");
  }
  TORCH_CHECK(slices.size() == offsets.size() && !slices.empty(), "one offset per slice");
  for (size_t i = 0; i < slices.size(); ++i) {
    TORCH_CHECK(slices[i] >= 0 && slices[i] < S, "slice index out of range");
    g.widths.push_back(b_t[slices[i]].size(2) / P);
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + g.widths[i] <= out.size(1), "slice columns outside out");
  }
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.dim() == 1 && token_ids.is_contiguous(),
              "token_ids: contiguous int64 [n]");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 4 &&
                  segments.is_contiguous(),
              "segments: contiguous int64 [G, 4]");
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < token_ids.size(0); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < x.size(0), "token id out of range");
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t start = seg[s * 4], length = seg[s * 4 + 1], slot = seg[s * 4 + 2], rank = seg[s * 4 + 3];
    TORCH_CHECK(start >= 0 && length >= 1 && start + length <= token_ids.size(0), "segment outside token_ids");
    TORCH_CHECK(slot >= 0 && slot < a_t.size(0) && rank >= 1 && rank <= g.max_rank, "segment slot or rank out of range");
  }
  return g;
}

}  // namespace

void loraplex_ops::add_lora_fused(at::Tensor out, const at::Tensor& x, const at::Tensor& a_t,
                                  std::vector<at::Tensor> b_t, std::vector<int64_t> slices,
                                  std::vector<int64_t> offsets, const at::Tensor& token_ids,
                                  const at::Tensor& segments, bool paired, int64_t tile_rows) {
  Args g = check(out, x, a_t, b_t, slices, offsets, token_ids, segments, paired, tile_rows);
  const auto xs = x.scalar_type(), ws = a_t.scalar_type();
#define LORAPLEX_RUN(XT, WT, X, W) \
  if (xs == XT && ws == WT) return run<X, W>(out, x, a_t, b_t, std::move(g), token_ids, segments);
  LORAPLEX_RUN(at::kFloat, at::kFloat, float, float)
  LORAPLEX_RUN(at::kFloat, at::kBFloat16, float, c10::BFloat16)
  LORAPLEX_RUN(at::kBFloat16, at::kFloat, c10::BFloat16, float)
  LORAPLEX_RUN(at::kBFloat16, at::kBFloat16, c10::BFloat16, c10::BFloat16)
  LORAPLEX_RUN(at::kHalf, at::kFloat, c10::Half, float)
  LORAPLEX_RUN(at::kHalf, at::kHalf, c10::Half, c10::Half)
#undef LORAPLEX_RUN
  TORCH_CHECK(false, "unsupported dtypes: x ", xs, ", stacks ", ws);
}

bool loraplex_ops::pairs_bf16() {
#ifdef LORAPLEX_DPBF16
  return true;
#else
  return false;
#endif
}

// Linux hands a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM):
// a tile instruction before that faults. Asked once; oneDNN asks the same for its own kernels.
bool loraplex_ops::tiles_bf16() {
#ifdef LORAPLEX_TILES
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

TORCH_LIBRARY(loraplex_cpu, m) {
  m.def(
      "add_lora_fused(Tensor(a!) out, Tensor x, Tensor a_t, Tensor[] b_t, int[] slices, int[] offsets, "
      "Tensor token_ids, Tensor segments, bool paired=False, int tile_rows=0) -> ()");
  m.impl("add_lora_fused", c10::DispatchKey::CPU, &loraplex_ops::add_lora_fused);
}
