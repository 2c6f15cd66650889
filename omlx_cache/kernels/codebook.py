"""CUDA kernels for ``Codebook`` stores: encode, decode attention, prefill.

Three ``mx.fast.cuda_kernel``s (and a combine step) stand in for the MLX ops
of ``omlx_cache.codebook`` where they apply (CUDA, compute capability 8.0 or
later, 3- to 5-bit ``Codebook`` codecs with a Hadamard rotation or none, head
dims 64, 128 and 256); the ops path stays the fallback everywhere else and the
reference in the tests.

- ``encode``: a warp per vector rotates it (a fast Walsh-Hadamard transform in
  registers and shuffles), takes its length, finds each coordinate's
  Lloyd-Max cell, computes the stored norm (``dot``, ``length`` or ``plain``)
  and packs the indices with warp-wide ORs: one launch instead of about
  twenty MLX ops per tensor.
- ``decode_attention`` (one query token per sequence): patch 0011's
  structure (``affine_decode``) over codebook pages. A block
  takes a span of one page's keys; a warp scores 16 keys at a time against
  the KV head's query heads on tensor cores (``mma.sync`` m16n8k16, halves
  in, float32 out) and adds their values with a second ``mma``. Indices
  become halves in registers: the magnitudes of a pair of elements select
  their two halves from a table of the positive levels in two registers
  (one byte permute), the sign bits are XORed in (3-bit: ``codebook``'s
  sign-magnitude layout; 4-bit: two permutes and a select; 5-bit: the high
  bits of a pair from a fifth word (``codebook``'s ``split_5bit``), four
  permutes and three selects). The norms are not multiplied into the levels:
  a key's score is scaled by its norm, and a value's norm is folded into its
  probabilities. Queries are rotated in the kernel, scores and the online
  softmax are float32, and the combine kernel rotates the output back. Masks
  as in patch 0011 (one row of keys per sequence: batched decode with left
  padding).
- ``prefill_attention`` (more than one query): the cache's keys and values
  decoded to the queries' dtype by a kernel (a warp per vector: levels times
  norm, rotated back) and ``mx.fast.scaled_dot_product_attention`` over them.
  The decoded copy is transient (one layer's keys and values).
"""

import contextlib
import functools
import struct
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..kv.attention import tile_scores
from ..kv.codebook import NORM_BITS, Codebook, lloyd_max
from ..kv.rotation import rotate
from . import affine_decode as qd
from . import affine_prefill as qp

WARPS = 4
COMBINE_WARPS = 16
MAX_PAGES = 32
ENCODE_WARPS = 4


def _half_bits(x) -> int:
    return int(np.array(x, np.float16).view(np.uint16))


def _pairs(values) -> list[int]:
    """uint32 words of two halves each (low half first)."""
    return [
        _half_bits(values[i]) | (_half_bits(values[i + 1]) << 16)
        for i in range(0, len(values), 2)
    ]


def _floats(values) -> str:
    return ", ".join(f"{float(np.float32(v))!r}f" for v in values)


@functools.cache
def _header() -> str:
    lv3, lv4, lv5 = (np.array(lloyd_max(b)[0]) for b in (3, 4, 5))
    thr3, thr4, thr5 = ((lv[1:] + lv[:-1]) / 2 for lv in (lv3, lv4, lv5))
    # positive levels by magnitude: 0 next to zero
    t3, t4, t5 = _pairs(lv3[4:]), _pairs(lv4[8:]), _pairs(lv5[16:])
    cb5 = "\n".join(f"#define CB5_{i} {w}u" for i, w in enumerate(t5))
    return f"""
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
// Lloyd-Max levels of a unit Gaussian: positive ones as pairs of halves (a
// byte permute picks two of them), all of them and the cell edges in float
#define CB3_LO {t3[0]}u
#define CB3_HI {t3[1]}u
#define CB4_0 {t4[0]}u
#define CB4_1 {t4[1]}u
#define CB4_2 {t4[2]}u
#define CB4_3 {t4[3]}u
{cb5}
__constant__ float CB_LEVELS3[8] = {{{_floats(lv3)}}};
__constant__ float CB_LEVELS4[16] = {{{_floats(lv4)}}};
__constant__ float CB_LEVELS5[32] = {{{_floats(lv5)}}};
__constant__ float CB_EDGES3[7] = {{{_floats(thr3)}}};
__constant__ float CB_EDGES4[15] = {{{_floats(thr4)}}};
__constant__ float CB_EDGES5[31] = {{{_floats(thr5)}}};

__device__ __forceinline__ void mma_16x8x16(
    float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {{
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}

__device__ __forceinline__ uint32_t h2_bits(__half2 x) {{
  return *reinterpret_cast<uint32_t*>(&x);
}}

// PTX's prmt: __byte_perm masks its selector (bit 3 of a nibble is prmt's
// sign mode), an instruction per call that selectors of 0-7 do not need
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {{
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}}

// 3-bit: magnitudes of elements a and b at bits s to s + 1 and s + 8 to
// s + 9 of w, ones where the element is negative at bits 15 and 31 of neg:
// the pair of halves (the selector picks bytes 2 a, 2 a + 1, 2 b, 2 b + 1)
__device__ __forceinline__ uint32_t cb3_pair(uint32_t w, int s, uint32_t neg) {{
  return prmt(CB3_LO, CB3_HI, ((w >> s) & 0x0303u) * 0x22u + 0x1010u) ^ neg;
}}

// 4-bit: indices of elements a and b at bits 0-3 and 16-19 of t
__device__ __forceinline__ uint32_t cb4_pair(uint32_t t) {{
  const uint32_t flip = ((~t >> 3) & 0x00010001u) * 7u;
  const uint32_t mag = (t & 0x00070007u) ^ flip;
  const uint32_t low = mag & 0x00030003u;
  const uint32_t sel = ((low | (low >> 8)) & 0x0303u) * 0x22u + 0x1010u;
  const uint32_t lo = prmt(CB4_0, CB4_1, sel);
  const uint32_t hi = prmt(CB4_2, CB4_3, sel);
  const uint32_t mask = ((mag >> 2) & 0x00010001u) * 0xFFFFu;
  return ((lo & ~mask) | (hi & mask)) ^ ((~t << 12) & 0x80008000u);
}}

// 5-bit: indices of elements a and b at bits 0-4 and 16-20 of t; the
// magnitude's low bits pick a pair from each of four words of the positive
// levels, its high bits one of the four
__device__ __forceinline__ uint32_t cb5_pair(uint32_t t) {{
  const uint32_t flip = ((~t >> 4) & 0x00010001u) * 15u;
  const uint32_t mag = (t & 0x000F000Fu) ^ flip;
  const uint32_t low = mag & 0x00030003u;
  const uint32_t sel = ((low | (low >> 8)) & 0x0303u) * 0x22u + 0x1010u;
  const uint32_t odd = ((mag >> 2) & 0x00010001u) * 0xFFFFu;
  const uint32_t upper = ((mag >> 3) & 0x00010001u) * 0xFFFFu;
  const uint32_t l0 = prmt(CB5_0, CB5_1, sel);
  const uint32_t l1 = prmt(CB5_2, CB5_3, sel);
  const uint32_t l2 = prmt(CB5_4, CB5_5, sel);
  const uint32_t l3 = prmt(CB5_6, CB5_7, sel);
  const uint32_t lo = (l0 & ~odd) | (l1 & odd);
  const uint32_t hi = (l2 & ~odd) | (l3 & odd);
  return ((lo & ~upper) | (hi & upper)) ^ ((~t << 11) & 0x80008000u);
}}

// 5-bit rows: where element r of a 32-element block has its high bit in the
// block's fifth word (codebook.split_5bit)
__device__ __forceinline__ int high_bit5(int r) {{
  return 16 * ((r >> 2) & 1) + 4 * (r >> 3) + (r & 3);
}}

// 5-bit rows: a pair's two high bits (codebook.split_5bit) at bits 4 and 20,
// for the elements at nibble j and j + 4 of word w of a 32-element block
__device__ __forceinline__ uint32_t high_pair5(uint32_t high, int w, int j) {{
  return ((high >> (4 * w + j)) & 0x00010001u) << 4;
}}

// 2^x, subnormal results flushed to zero (no range fix-up around MUFU.EX2)
__device__ __forceinline__ float exp2_ftz(float x) {{
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}}

// the sign bit (1: negative) at bit 15 and 31 from sign words' bits
__device__ __forceinline__ uint32_t neg_bits(uint32_t z, int shift) {{
  return ~(z << shift) & 0x80008000u;
}}

// a fast Walsh-Hadamard transform (unnormalized, Sylvester order) of a
// warp's vector, element i * 32 + lane in v[i]
template <int E>
__device__ __forceinline__ void fwht_warp(float (&v)[E], int lane) {{
  #pragma unroll
  for (int h = 1; h < E; h <<= 1) {{
    #pragma unroll
    for (int i = 0; i < E; ++i) {{
      if ((i & h) == 0) {{
        const float a = v[i];
        const float b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }}
    }}
  }}
  #pragma unroll
  for (int m = 1; m < 32; m <<= 1) {{
    #pragma unroll
    for (int i = 0; i < E; ++i) {{
      const float o = __shfl_xor_sync(0xffffffff, v[i], m);
      v[i] = (lane & m) ? o - v[i] : v[i] + o;
    }}
  }}
}}

// 3-bit rows: the word with the magnitudes of half-block h (16 elements)
__device__ __forceinline__ int mag_word3(int h) {{
  return (h >> 1) * 3 + (h & 1);
}}
"""


_ENCODE_SOURCE = """
    // a warp per vector: element i * 32 + lane in v[i]
    constexpr int E = D / 32;
    constexpr int W = D * BITS / 32;
    const int lane = threadIdx.x & 31;
    const size_t n_vectors = x_shape[0] * x_shape[1] * x_shape[2];
    const size_t vec = (size_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (vec >= n_vectors) {
        return;
    }
    float v[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        v[i] = static_cast<float>(x[vec * D + i * 32 + lane]);
    }
    if (ROT) {
        fwht_warp<E>(v, lane);
        const float r = 1.f / sqrtf((float)D);
        #pragma unroll
        for (int i = 0; i < E; ++i) {
            v[i] *= r;
        }
    }
    float sq = 0.f;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        sq += v[i] * v[i];
    }
    #pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        sq += __shfl_xor_sync(0xffffffff, sq, m);
    }
    const float length = sqrtf(sq);
    const float sqrt_d = sqrtf((float)D);
    const float safe = fmaxf(length, 1e-30f);
    int idx[E];
    float dot = 0.f;
    float dec_sq = 0.f;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        const float unit = v[i] / safe;
        const float z = unit * sqrt_d;
        int c = 0;
        if (BITS == 3) {
            #pragma unroll
            for (int t = 0; t < 7; ++t) {
                c += z > CB_EDGES3[t];
            }
        } else if (BITS == 4) {
            #pragma unroll
            for (int t = 0; t < 15; ++t) {
                c += z > CB_EDGES4[t];
            }
        } else {
            #pragma unroll
            for (int t = 0; t < 31; ++t) {
                c += z > CB_EDGES5[t];
            }
        }
        idx[i] = c;
        const float level =
            (BITS == 3 ? CB_LEVELS3[c] : BITS == 4 ? CB_LEVELS4[c] : CB_LEVELS5[c]) / sqrt_d;
        dot += unit * level;
        dec_sq += level * level;
    }
    #pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        dot += __shfl_xor_sync(0xffffffff, dot, m);
        dec_sq += __shfl_xor_sync(0xffffffff, dec_sq, m);
    }
    // NORM 0: dot, 1: length, 2: plain
    float norm = length;
    if (NORM == 0) {
        norm = length / fmaxf(dot, 1e-30f);
    } else if (NORM == 1) {
        norm = length / fmaxf(sqrtf(dec_sq), 1e-30f);
    }
    norm = fminf(norm, 65504.f);
    uint32_t* out = packed + vec * W;
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        const uint32_t c = idx[i];
        if (BITS == 3) {
            // codebook.sign_magnitude_3bit
            const int mw = lane >> 4;
            const int k = (lane & 15) >> 2;
            const int j = lane & 3;
            const uint32_t sign = c >> 2;
            const uint32_t mag = (c & 3u) ^ ((sign ^ 1u) * 3u);
            const uint32_t m = mag << (8 * k + 2 * j);
            const uint32_t s = sign << (mw * 8 + (k >> 1) * 4 + j + 16 * (k & 1));
            const uint32_t m0 = __reduce_or_sync(0xffffffff, mw == 0 ? m : 0u);
            const uint32_t m1 = __reduce_or_sync(0xffffffff, mw == 1 ? m : 0u);
            const uint32_t sw = __reduce_or_sync(0xffffffff, s);
            if (lane == 0) {
                out[3 * i] = m0;
                out[3 * i + 1] = m1;
                out[3 * i + 2] = sw;
            }
        } else {
            // eight indices per word, in order (5-bit: their low four bits,
            // the high bits in a fifth word: codebook.split_5bit)
            #pragma unroll
            for (int w = 0; w < 4; ++w) {
                const uint32_t word = __reduce_or_sync(
                    0xffffffff, (lane >> 3) == w ? (c & 15u) << (4 * (lane & 7)) : 0u);
                if (lane == 0) {
                    out[BITS * i + w] = word;
                }
            }
            if (BITS == 5) {
                const int at = high_bit5(lane);
                const uint32_t high = __reduce_or_sync(0xffffffff, (c >> 4) << at);
                if (lane == 0) {
                    out[5 * i + 4] = high;
                }
            }
        }
    }
    if (lane == 0) {
        norms[vec] = __float2half_rn(norm);
    }
"""


_DEQUANT_SOURCE = """
    // a warp per vector: levels times norm, rotated back
    constexpr int E = D / 32;
    constexpr int W = D * BITS / 32;
    const int lane = threadIdx.x & 31;
    const size_t n_vectors = packed_shape[0] * packed_shape[1] * packed_shape[2];
    const size_t vec = (size_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (vec >= n_vectors) {
        return;
    }
    const uint32_t* row = packed + vec * W;
    const float scale = static_cast<float>(norms[vec]) / sqrtf((float)D);
    float v[E];
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        float level;
        if (BITS == 3) {
            const int mw = lane >> 4;
            const int k = (lane & 15) >> 2;
            const int j = lane & 3;
            const uint32_t mag = (row[3 * i + mw] >> (8 * k + 2 * j)) & 3u;
            const uint32_t sign =
                (row[3 * i + 2] >> (mw * 8 + (k >> 1) * 4 + j + 16 * (k & 1))) & 1u;
            level = CB_LEVELS3[sign ? 4 + mag : 3 - mag];
        } else if (BITS == 4) {
            const uint32_t c = (row[4 * i + (lane >> 3)] >> (4 * (lane & 7))) & 15u;
            level = CB_LEVELS4[c];
        } else {
            const uint32_t low = (row[5 * i + (lane >> 3)] >> (4 * (lane & 7))) & 15u;
            const int at = high_bit5(lane);
            level = CB_LEVELS5[low | (((row[5 * i + 4] >> at) & 1u) << 4)];
        }
        v[i] = level * scale;
    }
    if (ROT) {
        fwht_warp<E>(v, lane);
        const float r = 1.f / sqrtf((float)D);
        #pragma unroll
        for (int i = 0; i < E; ++i) {
            v[i] *= r;
        }
    }
    #pragma unroll
    for (int i = 0; i < E; ++i) {
        out[vec * D + i * 32 + lane] = static_cast<O>(v[i]);
    }
"""


_DECODE_SOURCE = """
    // patch 0011's decode kernel over codebook pages: 16 keys at a time on
    // tensor cores against the (up to 8) query heads of a KV head. A lane
    // holds the fragments of mma.sync's layout: "quad" (lane / 4) picks rows,
    // "pos" (lane % 4) columns. The order of dimensions inside a dot product
    // is free: a lane takes a contiguous quarter of a key row (D / 4 dims) and
    // an eighth of a value row, in the order their codes unpack in.
    constexpr int KC = D / 4;                    // a lane's dims of a key row
    constexpr int STEPS = D / 16;                // mma steps over the head dim
    constexpr int VC = D / 8;                    // a lane's dims of a value row
    constexpr int KW = D * KB / 32;              // words per key row
    constexpr int VW = D * VB / 32;              // and per value row
    constexpr int KHB = KC / 16;                 // 3-bit: half-blocks per lane,
    constexpr int KSW = KHB > 1 ? KHB / 2 : 1;   // their sign words
    constexpr int KTW = KC >= 32 ? KC / 32 : 1;  // 5-bit: high-bit words
    // a lane's words of a key
    constexpr int KL = KB == 3 ? KHB + KSW : KB == 5 ? KC / 8 + KTW : KC / 8;
    constexpr int VMW = VC >= 16 ? VC / 16 : 1;
    // a lane's words of a value (3-bit: signs, 5-bit: high bits last)
    constexpr int VL = VB == 3 ? VMW + 1 : VB == 5 ? VC / 8 + 1 : VC / 8;
    const float neg_inf = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31;
    const int quad = lane >> 2;
    const int pos = lane & 3;
    const int warp = threadIdx.x >> 5;
    const int bh = blockIdx.y;
    const int span = meta[3 * NP];
    const int splits = meta[3 * NP + 1];
    const int mask_keys = mask_shape[3];
    const float inv_sqrt_d = 1.f / sqrtf((float)D);
    const float scale = __int_as_float(meta[3 * NP + 2]);

    // the first block takes the held (unquantized, unrotated) decode tokens,
    // if any, and the kept first tokens (KEPT: unquantized, rotated like the
    // pages) on CUDA cores: a warp per query head, a lane D / 32 dims; they
    // start first so as not to run alone at the end. The held tokens' weighted
    // values are rotated like the pages' (RV), the kept ones' already are.
    const int n_held = held_count[0];
    const int row_kept = kept_shape[0] > 1 ? bh / NKV : 0;
    if ((n_held > 0 || KEPT) && blockIdx.x == 0) {
        int stored = 0;
        for (int i = 0; i < NP; ++i) {
            stored = max(stored, meta[2 * NP + i] + meta[i]);
        }
        const auto mask_seq = mask + (MB ? (size_t)(bh / NKV) * mask_keys : 0);
        const int buffer = held_keys_shape[2];
        const size_t part = (size_t)bh * gridDim.x;
        // INC: the last held token comes as new_keys / new_values, as the
        // model made it: centered (CK, CV) and weighted (WK) here, rounded
        // as the cache's MLX ops round; the buffer with it in place is an
        // output (the cache's next buffer), and what the block reads
        const auto fresh_keys = new_keys + (size_t)bh * D;
        const auto fresh_values = new_values + (size_t)bh * D;
        if (INC) {
            const size_t base = (size_t)bh * buffer * D;
            for (int i = threadIdx.x; i < buffer * D; i += blockDim.x) {
                const int d = i % D;
                if (i / D == n_held - 1) {
                    float k = static_cast<float>(fresh_keys[d]);
                    float v = static_cast<float>(fresh_values[d]);
                    if (CK) {
                        k = static_cast<float>(static_cast<HT>(k - key_mean[bh * D + d]));
                    }
                    if (WK) {
                        k = static_cast<float>(static_cast<HT>(k * key_weights[bh * D + d]));
                    }
                    if (CV) {
                        v -= value_mean[bh * D + d];
                    }
                    out_held_keys[base + i] = static_cast<HT>(k);
                    out_held_values[base + i] = static_cast<HT>(v);
                } else {
                    out_held_keys[base + i] = held_keys[base + i];
                    out_held_values[base + i] = held_values[base + i];
                }
            }
            __syncthreads();
        }
        const int kept_first = KEPT ? kept[2 * row_kept] : 0;
        const int n_kept = KEPT ? kept[2 * row_kept + 1] : 0;
        const int kept_rows = kept_keys_shape[2];
        for (int g = warp; g < G; g += WARPS) {
            const auto q_src = queries + ((size_t)bh * G + g) * D;
            float q[D / 32];
            float q_rot[D / 32];
            float acc[D / 32];
            float acc_rot[D / 32];
            #pragma unroll
            for (int i = 0; i < D / 32; ++i) {
                q[i] = static_cast<float>(q_src[i * 32 + lane]) * scale;
                if (WK) {
                    q[i] /= key_weights[bh * D + i * 32 + lane];
                }
                q_rot[i] = q[i];
                acc[i] = 0.f;
                acc_rot[i] = 0.f;
            }
            if (KEPT && RK) {
                fwht_warp<D / 32>(q_rot, lane);
                #pragma unroll
                for (int i = 0; i < D / 32; ++i) {
                    q_rot[i] *= inv_sqrt_d;
                }
            }
            float m = neg_inf;
            float l = 0.f;
            // count keys from rows (row k of this head at rows + k * D), at
            // positions mask_at on: four at a time, their rows loaded before
            // any is used, their weighted values into sum (the other
            // accumulator rescaled too)
            auto attend = [&](const HT* rows, const HT* value_rows, int count,
                              const MT* mask_at, const float (&qv)[D / 32],
                              float (&sum)[D / 32], float (&other)[D / 32]) {
                for (int k0 = 0; k0 < count; k0 += 4) {
                    float hk[4][D / 32];
                    float hv[4][D / 32];
                    #pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int k = min(k0 + u, count - 1);
                        const auto key_row = rows + (size_t)k * D;
                        const auto value_row = value_rows + (size_t)k * D;
                        #pragma unroll
                        for (int i = 0; i < D / 32; ++i) {
                            hk[u][i] = static_cast<float>(key_row[i * 32 + lane]);
                            hv[u][i] = static_cast<float>(value_row[i * 32 + lane]);
                        }
                    }
                    float s[4];
                    #pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        s[u] = 0.f;
                        #pragma unroll
                        for (int i = 0; i < D / 32; ++i) {
                            s[u] += qv[i] * hk[u][i];
                        }
                    }
                    #pragma unroll
                    for (int o_ = 16; o_ > 0; o_ >>= 1) {
                        #pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            s[u] += __shfl_xor_sync(0xffffffff, s[u], o_);
                        }
                    }
                    #pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int k = k0 + u;
                        if (k >= count) {
                            break;
                        }
                        if (MASK == 1 && !static_cast<bool>(mask_at[k])) {
                            continue;
                        }
                        const float sk = MASK == 2 ? s[u] + static_cast<float>(mask_at[k]) : s[u];
                        const float m_new = fmaxf(m, sk);
                        const float correction = __expf(m - m_new);
                        const float p = __expf(sk - m_new);
                        l = l * correction + p;
                        #pragma unroll
                        for (int i = 0; i < D / 32; ++i) {
                            sum[i] = sum[i] * correction + p * hv[u][i];
                            if (KEPT) {
                                other[i] *= correction;
                            }
                        }
                        m = m_new;
                    }
                }
            };
            if (KEPT) {
                const size_t kept_base = (size_t)bh * kept_rows * D;
                attend(kept_keys + kept_base, kept_values + kept_base, n_kept,
                       mask_seq + kept_first, q_rot, acc_rot, acc);
            }
            const size_t held_base = (size_t)bh * buffer * D;
            attend((INC ? out_held_keys : held_keys) + held_base,
                   (INC ? out_held_values : held_values) + held_base, n_held,
                   mask_seq + stored, q, acc, acc_rot);
            if (RV) {
                fwht_warp<D / 32>(acc, lane);
                #pragma unroll
                for (int i = 0; i < D / 32; ++i) {
                    acc[i] *= inv_sqrt_d;
                }
            }
            #pragma unroll
            for (int i = 0; i < D / 32; ++i) {
                out_values[(part * G + g) * D + i * 32 + lane] = acc[i] + acc_rot[i];
            }
            if (lane == 0) {
                out_max[part * G + g] = m;
                out_sum[part * G + g] = l;
            }
        }
        return;
    }
    const int block = blockIdx.x - (n_held > 0 || KEPT);
    const int page = block / splits;
    const int page_size = meta[NP + page];
    const int page_offset = meta[2 * NP + page];
    const int first = (block % splits) * span;
    const int last = min(first + span, meta[page]);
    const auto mask_row = mask + (MB ? (size_t)(bh / NKV) * mask_keys : 0) + page_offset;
    // SKIP: the kept first tokens' stored copies are not attended (the
    // extra block reads them unquantized), nor what comes before them
    const int kept_end = SKIP ? kept[2 * row_kept] + kept[2 * row_kept + 1] - page_offset : 0;

    PAGE_POINTERS

    __shared__ float q_s[G][D];
    __shared__ float warp_max[WARPS][G];
    __shared__ float warp_sum[WARPS][G];
    __shared__ float warp_acc[WARPS][G][D];

    // the queries, rotated (RK) and scaled, once per block
    for (int g = warp; g < G; g += WARPS) {
        float v[D / 32];
        const auto q_src = queries + ((size_t)bh * G + g) * D;
        #pragma unroll
        for (int i = 0; i < D / 32; ++i) {
            v[i] = static_cast<float>(q_src[i * 32 + lane]);
            if (WK) {
                v[i] /= key_weights[bh * D + i * 32 + lane];
            }
        }
        float r = scale;
        if (RK) {
            fwht_warp<D / 32>(v, lane);
            r *= inv_sqrt_d;
        }
        #pragma unroll
        for (int i = 0; i < D / 32; ++i) {
            q_s[g][i * 32 + lane] = v[i] * r;
        }
    }
    __syncthreads();

    // the B operand: head quad, dims a (low half) and a + 4 of pair p
    uint32_t q_frag[STEPS][2];
    #pragma unroll
    for (int p = 0; p < 2 * STEPS; ++p) {
        const int a = pos * KC + 8 * (p / 4) + p % 4;
        const float q0 = quad < G ? q_s[quad % G][a] : 0.f;
        const float q1 = quad < G ? q_s[quad % G][a + 4] : 0.f;
        q_frag[p / 2][p % 2] = h2_bits(__floats2half2_rn(q0, q1));
    }

    float m_run[2] = {neg_inf, neg_inf};
    float l_run[2] = {0.f, 0.f};
    float o[STEPS][4];
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[i][j] = 0.f;
        }
    }

    const size_t rows = (size_t)bh * page_size;
    // a lane's words of a key row: k_first + k_word(i), the offsets known at
    // compile time where the lane's dims are whole 32-element blocks
    const int k_first = KB == 3 && KHB == 1 ? (pos >> 1) * 3
                        : KB == 5             ? (pos * KC / 32) * 5
                                              : pos * KL;
    // (5-bit: the low-bit words, then the high-bit words of the lane's blocks)
    auto k_word = [&](int i) {
        if (KB == 5) {
            if (KC == 16) {
                return i < 2 ? (pos & 1) * 2 + i : 4;
            }
            return i < KC / 8 ? (i / 4) * 5 + i % 4 : (i - KC / 8) * 5 + 4;
        }
        if (KB == 3) {
            if (KHB == 1) {
                return i == 0 ? (pos & 1) : 2;
            }
            return i < KHB ? (i >> 1) * 3 + (i & 1) : (i - KHB) * 3 + 2;
        }
        return i;
    };
    // and of a value row: magnitudes (low bits) from v_first, 3-bit signs
    // (5-bit high bits) from v_signs; a lane's value dims are in one block
    const int v_start = quad * VC;
    const int v_first = VB == 3 ? mag_word3(v_start / 16)
                        : VB == 5 ? (v_start / 32) * 5 + (v_start % 32) / 8
                                  : v_start / 8;
    const int v_signs = VB == 5 ? (v_start / 32) * 5 + 4 : (v_start / 32) * 3 + 2;
    auto v_word = [&](int i) {
        return VB == 3 ? (i >> 1) * 3 + (i & 1) : i;
    };
    // a tile's words and norms, loaded a tile ahead of their use (keys quad
    // and quad + 8; values 2 pos, 2 pos + 8, 2 pos + 1, 2 pos + 9)
    struct Tile {
        uint32_t k[2][KL];
        float k_norm[2];
        float v_norm[2];
        uint32_t v[4][VL];
    };
    const uint32_t* k_lane = k_packed + rows * KW + k_first;
    const uint32_t* v_lane = v_packed + rows * VW + v_first;
    const uint32_t* s_lane = v_packed + rows * VW + v_signs;
    const auto k_norm_rows = k_norms + rows;
    const auto v_norm_rows = v_norms + rows;
    // a tile's rows: one address per group of rows and offsets known at
    // compile time where every page's size is a multiple of 16 (WHOLE: a
    // tile is within its page), else rows past the page's end read its last
    // row. Rows past `last` have their scores masked and their values' norms
    // zeroed (a page's unused rows hold anything)
    auto fetch = [&](int tile, Tile& t) {
        const int key_row = tile + quad;
        const int value_row = tile + 2 * pos;
        if (WHOLE) {
            const uint32_t* k_row = k_lane + (size_t)(uint32_t)key_row * KW;
            const uint32_t* v_row = v_lane + (size_t)(uint32_t)value_row * VW;
            const uint32_t* s_row = s_lane + (size_t)(uint32_t)value_row * VW;
            const auto k_norm_row = k_norm_rows + (uint32_t)key_row;
            const auto v_norm_row = v_norm_rows + (uint32_t)key_row;
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                #pragma unroll
                for (int i = 0; i < KL; ++i) {
                    t.k[r][i] = k_row[8 * r * KW + k_word(i)];
                }
                t.k_norm[r] = static_cast<float>(k_norm_row[8 * r]);
                t.v_norm[r] = static_cast<float>(v_norm_row[8 * r]);
            }
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int down = 8 * (r & 1) + (r >> 1);
                #pragma unroll
                for (int i = 0; i < VL; ++i) {
                    const bool sign = (VB == 3 || VB == 5) && i == VL - 1;
                    t.v[r][i] = sign ? s_row[down * VW] : v_row[down * VW + v_word(i)];
                }
            }
        } else {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const size_t k = (uint32_t)min(key_row + 8 * r, page_size - 1);
                #pragma unroll
                for (int i = 0; i < KL; ++i) {
                    t.k[r][i] = k_lane[k * KW + k_word(i)];
                }
                t.k_norm[r] = static_cast<float>(k_norm_rows[k]);
                t.v_norm[r] = static_cast<float>(v_norm_rows[k]);
            }
            #pragma unroll
            for (int r = 0; r < 4; ++r) {
                const size_t k = (uint32_t)min(value_row + 8 * (r & 1) + (r >> 1), page_size - 1);
                #pragma unroll
                for (int i = 0; i < VL; ++i) {
                    const bool sign = (VB == 3 || VB == 5) && i == VL - 1;
                    t.v[r][i] = sign ? s_lane[k * VW] : v_lane[k * VW + v_word(i)];
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            t.k_norm[r] *= inv_sqrt_d * LOG2E;
            t.v_norm[r] = key_row + 8 * r < last ? t.v_norm[r] * inv_sqrt_d : 0.f;
        }
    };

    // a tile's scores, softmax and weighted values
    auto step = [&](int tile, const Tile& t) {
        const int key[2] = {tile + quad, tile + quad + 8};

        // scores: (key quad, head 2 pos), (quad, 2 pos + 1), (quad + 8, 2 pos),
        // (quad + 8, 2 pos + 1)
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            uint32_t a_key[2][2];
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                #pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int p = 2 * i + c;
                    if (KB == 3) {
                        const int h = p / 8;
                        const int kk = (p % 8) / 4;
                        const int j = p % 4;
                        const int pair = ((pos * KHB + h) & 1) * 8 + kk * 4 + j;
                        const uint32_t sw = t.k[r][KHB + (KHB > 1 ? h / 2 : 0)];
                        a_key[r][c] = cb3_pair(t.k[r][h], 16 * kk + 2 * j, neg_bits(sw, 15 - pair));
                    } else if (KB == 5) {
                        // the low-bit word w of the lane's, word w_in of its block
                        const int w = p / 4;
                        const int j = p % 4;
                        const int w_in = KC == 16 ? (pos & 1) * 2 + w : w % 4;
                        const uint32_t high = t.k[r][KC / 8 + (KC >= 32 ? w / 4 : 0)];
                        a_key[r][c] = cb5_pair(((t.k[r][w] >> (4 * j)) & 0x000F000Fu) |
                                               high_pair5(high, w_in, j));
                    } else {
                        const int w = p / 4;
                        const int j = p % 4;
                        a_key[r][c] = cb4_pair((t.k[r][w] >> (4 * j)) & 0x000F000Fu);
                    }
                }
            }
            const uint32_t a[4] = {a_key[0][0], a_key[1][0], a_key[0][1], a_key[1][1]};
            mma_16x8x16(s, a, q_frag[i]);
        }
        bool valid[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            valid[r] = key[r] < last && (!SKIP || key[r] >= kept_end);
            float added = 0.f;
            if (MASK == 1 && valid[r]) {
                valid[r] = static_cast<bool>(mask_row[key[r]]);
            } else if (MASK == 2 && valid[r]) {
                added = static_cast<float>(mask_row[key[r]]) * LOG2E;
            }
            s[2 * r] = valid[r] ? s[2 * r] * t.k_norm[r] + added : neg_inf;
            s[2 * r + 1] = valid[r] ? s[2 * r + 1] * t.k_norm[r] + added : neg_inf;
        }

        // online softmax over the tile, heads 2 pos and 2 pos + 1, in base 2
        // (the scores carry log2(e)); a head with no key yet leaves m_run
        // at -inf and its probabilities at 0
        float p[4];
        float correction[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float top = fmaxf(s[h], s[2 + h]);
            #pragma unroll
            for (int o_ = 4; o_ < 32; o_ <<= 1) {
                top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o_));
            }
            const float m_new = fmaxf(m_run[h], top);
            const float m_from = m_new == neg_inf ? 0.f : m_new;
            correction[h] = m_new == m_run[h] ? 1.f : exp2_ftz(m_run[h] - m_from);
            p[h] = exp2_ftz(s[h] - m_from);
            p[2 + h] = exp2_ftz(s[2 + h] - m_from);
            l_run[h] = l_run[h] * correction[h] + p[h] + p[2 + h];
            m_run[h] = m_new;
        }
        // the running maxima settle after the first tiles: most tiles skip
        // the rescaling of the weighted values (an instruction-bound loop)
        if (__any_sync(0xffffffff, correction[0] != 1.f || correction[1] != 1.f)) {
            #pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    o[i][h] *= correction[h];
                    o[i][2 + h] *= correction[h];
                }
            }
        }

        // the probabilities times the values' norms as the B operand (16
        // keys by 8 heads): a lane needs head quad of keys 2 pos, 2 pos + 8
        // (lane 8 pos + quad / 2 has them) and 2 pos + 1, 2 pos + 9 (lane
        // 8 pos + 4 + quad / 2)
        const uint32_t p_even = h2_bits(
            __floats2half2_rn(p[0] * t.v_norm[0], p[2] * t.v_norm[1]));
        const uint32_t p_odd = h2_bits(
            __floats2half2_rn(p[1] * t.v_norm[0], p[3] * t.v_norm[1]));
        const int src = 8 * pos + quad / 2;
        const uint32_t e0 = __shfl_sync(0xffffffff, p_even, src);
        const uint32_t o0 = __shfl_sync(0xffffffff, p_odd, src);
        const uint32_t e1 = __shfl_sync(0xffffffff, p_even, src + 4);
        const uint32_t o1 = __shfl_sync(0xffffffff, p_odd, src + 4);
        const uint32_t p_frag[2] = {quad & 1 ? o0 : e0, quad & 1 ? o1 : e1};

        // values: rows are dims (row quad: dim v_start + 8 (i / 4) + i % 4,
        // row quad + 8: 4 dims on), columns keys (2 pos, 2 pos + 8 | 2 pos + 1,
        // 2 pos + 9)
        #pragma unroll
        for (int g8 = 0; g8 < VC / 8; ++g8) {
            // the codes of the group of 8 dims of the two key pairs, their
            // bytes interleaved so that one shift and mask picks a pair
            uint32_t y[2];
            uint32_t z[2];
            // (compile-time where the lane's dims are whole half-blocks)
            const int b0 = (((VC >= 16 ? 0 : v_start) + 8 * g8) % 16) / 4;
            if (VB == 3) {
                const int m = VC >= 16 ? (8 * g8) / 16 : 0;
                const int mw = ((v_start + 8 * g8) / 16) & 1;
                const uint32_t sel = b0 | ((b0 + 4) << 4) | ((b0 + 1) << 8) | ((b0 + 5) << 12);
                const uint32_t ssel = mw | ((mw + 2) << 4) | ((mw + 4) << 8) | ((mw + 6) << 12);
                #pragma unroll
                for (int kp = 0; kp < 2; ++kp) {
                    y[kp] = __byte_perm(t.v[2 * kp][m], t.v[2 * kp + 1][m], sel);
                    z[kp] = __byte_perm(t.v[2 * kp][VMW], t.v[2 * kp + 1][VMW], ssel);
                }
            } else {
                #pragma unroll
                for (int kp = 0; kp < 2; ++kp) {
                    y[kp] = t.v[2 * kp][g8];
                    z[kp] = t.v[2 * kp + 1][g8];
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int i = 4 * g8 + j;
                uint32_t a[4];
                #pragma unroll
                for (int kp = 0; kp < 2; ++kp) {
                    if (VB == 3) {
                        const int q = (b0 / 2) * 4 + j;
                        a[2 * kp] = cb3_pair(y[kp], 2 * j, neg_bits(z[kp], 15 - q));
                        a[2 * kp + 1] = cb3_pair(y[kp], 16 + 2 * j, neg_bits(z[kp], 7 - q));
                    } else {
                        // nibble j (row quad) and 4 + j (row quad + 8) of two keys
                        const int b = j / 2;
                        const int sh = 4 * (j % 2);
                        const uint32_t w0 = __byte_perm(y[kp], z[kp], b | ((b + 4) << 8));
                        const uint32_t w1 = __byte_perm(y[kp], z[kp], (b + 2) | ((b + 6) << 8));
                        const uint32_t t0 = (w0 >> sh) & 0x000F000Fu;
                        const uint32_t t1 = (w1 >> sh) & 0x000F000Fu;
                        if (VB == 5) {
                            // the two keys' high bits of dims e and e + 4 of the block
                            const uint32_t h0 = t.v[2 * kp][VL - 1];
                            const uint32_t h1 = t.v[2 * kp + 1][VL - 1];
                            const int at = 4 * ((v_start % 32) / 8 + g8) + j;
                            const uint32_t e = ((h0 >> at) & 1u) | (((h1 >> at) & 1u) << 16);
                            const uint32_t e4 = ((h0 >> (at + 16)) & 1u) | (((h1 >> (at + 16)) & 1u) << 16);
                            a[2 * kp] = cb5_pair(t0 | (e << 4));
                            a[2 * kp + 1] = cb5_pair(t1 | (e4 << 4));
                        } else {
                            a[2 * kp] = cb4_pair(t0);
                            a[2 * kp + 1] = cb4_pair(t1);
                        }
                    }
                }
                mma_16x8x16(o[i], a, p_frag);
            }
        }
    };
    // two tiles in turn: one is used while the other loads
    Tile even;
    Tile odd;
    constexpr int STRIDE = WARPS * 16;
    int tile = first + warp * 16;
    if (tile < last) {
        fetch(tile, even);
    }
    while (tile < last) {
        if (tile + STRIDE < last) {
            fetch(tile + STRIDE, odd);
        }
        step(tile, even);
        tile += STRIDE;
        if (tile >= last) {
            break;
        }
        if (tile + STRIDE < last) {
            fetch(tile + STRIDE, even);
        }
        step(tile, odd);
        tile += STRIDE;
    }

    // the lanes of a head (one per quad) hold parts of its sum
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        #pragma unroll
        for (int o_ = 4; o_ < 32; o_ <<= 1) {
            l_run[h] += __shfl_xor_sync(0xffffffff, l_run[h], o_);
        }
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int g = 2 * pos + h;
        if (g < G) {
            if (quad == 0) {
                warp_max[warp][g] = m_run[h] * LN2;
                warp_sum[warp][g] = l_run[h];
            }
            #pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                const int d = v_start + 8 * (i / 4) + i % 4;
                warp_acc[warp][g][d] = o[i][h];
                warp_acc[warp][g][d + 4] = o[i][2 + h];
            }
        }
    }
    __syncthreads();

    const size_t part = (size_t)bh * gridDim.x + blockIdx.x;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D;
        const int d = i % D;
        float block_max = neg_inf;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            block_max = fmaxf(block_max, warp_max[w][g]);
        }
        float total = 0.f;
        float weighted = 0.f;
        if (block_max > neg_inf) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float weight = __expf(warp_max[w][g] - block_max);
                total += weight * warp_sum[w][g];
                weighted += weight * warp_acc[w][g][d];
            }
        }
        out_values[(part * G + g) * D + d] = weighted;
        if (d == 0) {
            out_max[part * G + g] = block_max;
            out_sum[part * G + g] = total;
        }
    }
"""

_COMBINE_SOURCE = """
    // the blocks' partials of one (row, head) into its output: the top of
    // their maxima first, then each warp weighs every CW-th partial against
    // it (loads that wait on no running value), the warps' sums are joined
    // and warp 0 rotates the row back (RV)
    constexpr int E = D / 32;
    const int rg = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int r = rg / G;
    const int g = rg % G;
    const int S = part_max_shape[1];
    const float neg_inf = __int_as_float(0xff800000);
    __shared__ float warp_max[CW];
    __shared__ float warp_sum[CW];
    __shared__ float acc_s[CW][D];
    float m = neg_inf;
    for (int s = threadIdx.x; s < S; s += CW * 32) {
        m = fmaxf(m, part_max[(r * S + s) * G + g]);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    }
    if (lane == 0) {
        warp_max[warp] = m;
    }
    __syncthreads();
    float top = neg_inf;
    #pragma unroll
    for (int w = 0; w < CW; ++w) {
        top = fmaxf(top, warp_max[w]);
    }
    float l = 0.f;
    float acc[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        acc[e] = 0.f;
    }
    #pragma unroll 4
    for (int s = warp; s < S; s += CW) {
        const int i = (r * S + s) * G + g;
        const float w = __expf(part_max[i] - top);  // 0 for a block without keys
        l += w * part_sum[i];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[e] += w * part_values[(size_t)i * D + e * 32 + lane];
        }
    }
    if (lane == 0) {
        warp_sum[warp] = l;
    }
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        acc_s[warp][e * 32 + lane] = acc[e];
    }
    __syncthreads();
    if (warp > 0) {
        return;
    }
    float total = 0.f;
    float out_row[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        out_row[e] = 0.f;
    }
    #pragma unroll
    for (int w = 0; w < CW; ++w) {
        total += warp_sum[w];
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            out_row[e] += acc_s[w][e * 32 + lane];
        }
    }
    float norm = 1.f / total;
    if (RV) {
        fwht_warp<E>(out_row, lane);
        norm *= 1.f / sqrtf((float)D);
    }
    // CV: the values' mean back (rounded as the cache's MLX ops round)
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        const float o = static_cast<float>(static_cast<O>(out_row[e] * norm));
        const float mean = CV ? value_mean[(size_t)r * D + e * 32 + lane] : 0.f;
        out[(size_t)rg * D + e * 32 + lane] = static_cast<O>(o + mean);
    }
"""

_PAGE_PARTS = ("k_packed", "k_norms", "v_packed", "v_norms")
_kernels = {}


def _compiled_name(name, source):
    """``name`` with a digest of the kernel's code (patch 0022's
    ``kernel_name``: MLX's PTX cache on disk is keyed by name alone)."""
    return qd.kernel_name(name, _header() + source)


def _kernel(name, inputs, outputs, source):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=_compiled_name(name, source),
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=_header(),
        )
    return _kernels[name]


def _page_pointers(n_pages):
    lines = []
    for part in _PAGE_PARTS:
        chain = f"{part}_{n_pages - 1}"
        for i in reversed(range(n_pages - 1)):
            chain = f"page == {i} ? {part}_{i} : {chain}"
        lines.append(f"const auto {part} = {chain};")
    return "\n    ".join(lines)


# the decode kernel's inputs for kept tokens, centering and key weights, and
# their stand-ins where a cache has none (each input a launch takes costs the
# host: a decode step of a plain cache takes none of them)
_DECODE_EXTRAS = ["kept_keys", "kept_values", "kept", "key_mean", "value_mean"]
_DECODE_EXTRAS += ["key_weights"]
_NO_DECODE_EXTRAS = """
    const HT* kept_keys = nullptr;
    const HT* kept_values = nullptr;
    const int* kept = nullptr;
    constexpr int kept_shape[1] = {1};
    constexpr int kept_keys_shape[4] = {1, 1, 1, 1};
    const float* key_mean = nullptr;
    const float* value_mean = nullptr;
    const float* key_weights = nullptr;
"""


@functools.cache
def _decode_kernel(n_pages, extras):
    """The decode kernel's name, inputs, outputs and source (made per
    template by ``quantized_decode.specialized_kernel``, patch 0023)."""
    inputs = ["queries"]
    inputs += [f"{part}_{i}" for i in range(n_pages) for part in _PAGE_PARTS]
    inputs += ["meta", "mask", "held_keys", "held_values", "held_count"]
    inputs += ["new_keys", "new_values"]
    source = _DECODE_SOURCE.replace("PAGE_POINTERS", _page_pointers(n_pages))
    return (
        f"codebook_sdpa_decode_{n_pages}" + ("_x" if extras else ""),
        tuple(inputs + (_DECODE_EXTRAS if extras else [])),
        ("out_values", "out_max", "out_sum", "out_held_keys", "out_held_values"),
        source if extras else _NO_DECODE_EXTRAS + source,
    )


# ---------------------------------------------------------------------------
# When the kernels apply


@functools.cache
def _cuda_available():
    return qd._cuda_available()


PARTS = ("encode", "prefill", "decode")
# the parts switched off, innermost ``disabled`` last
_disabled = [frozenset()]
# the dtype prefill attention decodes keys and values into (None: the
# queries'); see ``prefill_attention``
_prefill_dtype = [None]
# whether prefill decodes its pages by MLX ops (``decoding_by_ops``)
_pages_by_ops = [False]


@contextlib.contextmanager
def disabled(*parts):
    """Within it the kernels of ``parts`` (``PARTS``; all by default: the
    MLX-ops reference) are not used. With the decode kernel off, decode
    tokens are not held for it either."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"Unknown kernel parts {sorted(unknown)}; expected {PARTS}.")
    _disabled.append(_disabled[-1] | frozenset(parts or PARTS))
    try:
        yield
    finally:
        _disabled.pop()


@contextlib.contextmanager
def decoding_by_ops():
    """Within it prefill attention decodes its pages by MLX ops
    (``dequantize_by_ops``) instead of the dequantize kernel, to compare."""
    _pages_by_ops.append(True)
    try:
        yield
    finally:
        _pages_by_ops.pop()


@contextlib.contextmanager
def prefill_in(dtype):
    """Within it prefill attention decodes keys and values into ``dtype`` and
    attends in it (the output comes back in the queries' dtype), where
    ``prefill_attention`` would choose by the head dim."""
    _prefill_dtype.append(dtype)
    try:
        yield
    finally:
        _prefill_dtype.pop()


def _on_cuda(part) -> bool:
    return (
        part not in _disabled[-1]
        and mx.default_device() == mx.gpu
        and _cuda_available()
    )


def _rotates(codec) -> bool | None:
    """Whether a codec the kernels take is rotated (None: not taken). The
    kernels read and write float16 norms: 8-bit ones (``-n8``) take the ops
    path."""
    if not isinstance(codec, Codebook) or codec.bits not in (3, 4, 5):
        return None
    if codec.norm_bits != NORM_BITS:
        return None
    if codec.rotation not in ("hadamard", "none"):
        return None
    return codec.rotation == "hadamard"


def encodes(x: mx.array, codec) -> bool:
    """Whether ``encode`` takes these vectors (the last axis) for ``codec``."""
    return (
        x.ndim == 4
        and x.shape[-1] in (64, 128, 256)
        and _rotates(codec) is not None
        and _on_cuda("encode")
    )


def holds(keys, values, key_codec, value_codec) -> bool:
    """Whether decode tokens like these may wait unquantized for the decode
    kernel (``kv.kernels.Hold``)."""
    D = keys.shape[-1]
    return (
        D in (64, 128, 256)
        and values.shape[-1] == D
        and _rotates(key_codec) is not None
        and _rotates(value_codec) is not None
        and not key_codec.debias
        and _on_cuda("decode")
    )


def applies(
    queries,
    key_pages,
    value_pages,
    key_codec,
    value_codec,
    mask,
    sinks,
    length,
    held=None,
):
    """Whether ``attention`` handles this call (``length`` keys attended, held
    ones included)."""
    if sinks is not None or not key_pages:
        return False
    if not _on_cuda("decode" if queries.shape[2] == 1 else "prefill"):
        return False
    if _rotates(key_codec) is None or _rotates(value_codec) is None:
        return False
    if key_codec.debias:
        # the kernels have no score correction (``Codebook.debias``) yet
        return False
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = key_pages[0][0].shape[1]
    if D not in (64, 128, 256) or key_codec.dim(key_pages[0]) != D:
        return False
    if value_codec.dim(value_pages[0]) != D or n_q_heads % n_kv_heads:
        return False
    if L > 1:
        return held is None
    return n_q_heads // n_kv_heads <= 8 and qd._mask_kind(mask, B, length) is not None


# ---------------------------------------------------------------------------
# Kernels


def encode(x: mx.array, codec) -> tuple[mx.array, mx.array]:
    """``Codebook.encode`` of (B, H, L, D) vectors in one launch: (packed
    indices, float16 norms)."""
    B, H, L, D = x.shape
    n = B * H * L
    kernel = _kernel("codebook_encode", ["x"], ["packed", "norms"], _ENCODE_SOURCE)
    norm = ("dot", "length", "plain").index(codec.norm)
    blocks = (n + ENCODE_WARPS - 1) // ENCODE_WARPS
    packed, norms = kernel(
        inputs=[x],
        template=[
            ("D", D),
            ("BITS", codec.bits),
            ("ROT", codec.rotation == "hadamard"),
            ("NORM", norm),
            # the input's type is part of the signature, so of the kernel's name
            ("XT", x.dtype),
        ],
        grid=(blocks * ENCODE_WARPS * 32, 1, 1),
        threadgroup=(ENCODE_WARPS * 32, 1, 1),
        output_shapes=[(B, H, L, D * codec.bits // 32), (B, H, L, 1)],
        output_dtypes=[mx.uint32, mx.float16],
    )
    return packed, norms


def dequantize(page, codec, dtype) -> mx.array:
    """The vectors of a page (packed indices, norms), decoded and rotated
    back (``Codebook.decode`` then the inverse rotation), in ``dtype``."""
    packed, norms = page
    B, H, S, W = packed.shape
    D = W * 32 // codec.bits
    n = B * H * S
    kernel = _kernel(
        "codebook_dequantize", ["packed", "norms"], ["out"], _DEQUANT_SOURCE
    )
    blocks = (n + ENCODE_WARPS - 1) // ENCODE_WARPS
    return kernel(
        inputs=[packed, norms],
        template=[
            ("D", D),
            ("BITS", codec.bits),
            ("ROT", codec.rotation == "hadamard"),
            ("O", dtype),
        ],
        grid=(max(blocks, 1) * ENCODE_WARPS * 32, 1, 1),
        threadgroup=(ENCODE_WARPS * 32, 1, 1),
        output_shapes=[(B, H, S, D)],
        output_dtypes=[dtype],
    )[0]


def dequantize_by_ops(page, codec, dtype) -> mx.array:
    """What ``dequantize`` computes, by MLX ops on any backend (on CUDA their
    float32 matmuls round in TF32 unless ``MLX_ENABLE_TF32=0``; the kernel's
    transform does not)."""
    decoded = codec.decode(page, mx.float32)
    return rotate(decoded, codec.rotation, inverse=True).astype(dtype)


def _dequantize_pages(pages, codec, length, dtype):
    decode = dequantize_by_ops if _pages_by_ops[-1] else dequantize
    parts, start = [], 0
    for page in pages:
        n = min(page[0].shape[2], length - start)
        if n <= 0:
            break
        if n < page[0].shape[2]:
            page = tuple(x[:, :, :n] for x in page)
        parts.append(decode(page, codec, dtype))
        start += n
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _fused(D, dtype) -> bool:
    """Whether ``mx.fast.scaled_dot_product_attention`` attends queries like
    these in one fused pass with float32 scores (cuDNN's flash attention:
    halves, heads up to 128, as ``quantized_prefill.DECODED_HEAD_DIMS``);
    else MLX makes the whole score matrix, in the inputs' dtype."""
    return D in qp.DECODED_HEAD_DIMS and dtype in (mx.float16, mx.bfloat16)


def _blocked_attention(queries, keys, values, scale, mask):
    """``mx.fast.scaled_dot_product_attention`` a block of queries at a time,
    so that the score matrix its unfused path makes stays within
    ``tile_scores()``."""
    B, n_q_heads, L, _ = queries.shape
    S = keys.shape[2]
    rows = max(1, tile_scores() // (B * n_q_heads * S))
    if rows >= L:
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask
        )
    outs = []
    for start in range(0, L, rows):
        stop = min(start + rows, L)
        block_mask, seen = mask, S
        if isinstance(mask, str):
            # causal: the block's last query is the one that sees its last key
            seen = S - L + stop
        elif mask is not None and mask.shape[-2] > 1:
            block_mask = mask[..., start:stop, :]
        out = mx.fast.scaled_dot_product_attention(
            queries[:, :, start:stop],
            keys[:, :, :seen],
            values[:, :, :seen],
            scale=scale,
            mask=block_mask,
        )
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=2)


def _with_rows_before(mask, first, before, length, L):
    """A mask array over ``length`` stored keys with columns in front for
    the ``before`` kept tokens at rows ``first`` on (negative: the pages do
    not hold them), seen by the queries (the last ``L`` of the keys) at or
    after their rows."""
    while mask.ndim < 4:
        mask = mask[None]
    mask = mx.broadcast_to(mask, (*mask.shape[:2], L, mask.shape[-1]))
    rows = first + mx.arange(before)
    front = rows[None] <= mx.arange(length - L, length)[:, None]
    if mask.dtype != mx.bool_:
        front = mx.where(front, 0, -float("inf")).astype(mask.dtype)
    front = mx.broadcast_to(front, (*mask.shape[:3], before))
    return mx.concatenate([front, mask], axis=-1)


def prefill_attention(
    queries,
    key_pages,
    value_pages,
    key_codec,
    value_codec,
    scale,
    mask,
    length,
    kept=None,
):
    """Attention of several queries: the stored keys and values decoded, the
    ``kept`` first tokens in place of their copies (as in
    ``decode_attention``; one sequence's, else None is returned for the
    MLX-ops path), and ``mx.fast.scaled_dot_product_attention``.

    That is one fused pass in the queries' dtype where cuDNN takes it
    (``_fused``); elsewhere (heads of 256, float32 models) the copies are
    float32 and the queries go a block at a time (``_blocked_attention``):
    bfloat16 scores of Gemma's heads of 256 lost passkeys that float32 ones
    find (their matmuls are TF32 on CUDA unless ``MLX_ENABLE_TF32=0``).
    ``prefill_in`` sets the dtype instead."""
    D = queries.shape[-1]
    dtype = _prefill_dtype[-1]
    if dtype is None:
        dtype = queries.dtype if _fused(D, queries.dtype) else mx.float32
    keys = _dequantize_pages(key_pages, key_codec, length, dtype)
    values = _dequantize_pages(value_pages, value_codec, length, dtype)
    if kept is not None:
        kept_keys, kept_values, first, count = kept
        if not isinstance(first, int):
            return None
        # the kept tokens the pages do not hold (before row 0) go in front
        before = min(count, max(-first, 0))
        decoded = []
        for x, rows, c in (
            (keys, kept_keys, key_codec),
            (values, kept_values, value_codec),
        ):
            rows = rotate(rows[:, :, :count], c.rotation, inverse=True).astype(dtype)
            start = max(first, 0)
            n = min(count - before, length - start)
            if n > 0:
                x[:, :, start : start + n] = rows[:, :, before : before + n]
            decoded.append(
                mx.concatenate([rows[:, :, :before], x], axis=2) if before else x
            )
        keys, values = decoded
        if before and isinstance(mask, mx.array):
            mask = _with_rows_before(mask, first, before, length, queries.shape[2])
    attend = _blocked_attention
    if _fused(D, dtype):
        attend = mx.fast.scaled_dot_product_attention
    out = attend(queries.astype(dtype), keys, values, scale=scale, mask=mask)
    return out.astype(queries.dtype)


# the combine kernel's name, inputs, outputs and source without and with the
# values' mean (a stand-in the code never reads where a cache has none)
_COMBINE_KERNELS = {
    mean: (
        "codebook_sdpa_combine" + ("_mean" if mean else ""),
        ("part_values", "part_max", "part_sum") + (("value_mean",) if mean else ()),
        ("out",),
        ("" if mean else "    const float* value_mean = nullptr;\n") + _COMBINE_SOURCE,
    )
    for mean in (False, True)
}


def _combine_kernel(G, D, dtype, rotate_back, mean):
    template = (
        ("G", G),
        ("D", D),
        ("O", dtype),
        ("CW", COMBINE_WARPS),
        ("RV", rotate_back),
        ("CV", mean),
    )
    return qd.specialized_kernel(*_COMBINE_KERNELS[mean], template, _header())


def _combine(kernel, values, maxes, sums, dtype, shape, value_mean=None):
    """The decode blocks' partial outputs combined by ``kernel`` (one of
    ``_combine_kernel``)."""
    rows, _, G, _ = values.shape
    mean = [] if value_mean is None else [value_mean]
    return kernel(
        inputs=[values, maxes, sums, *mean],
        grid=(rows * G * COMBINE_WARPS * 32, 1, 1),
        threadgroup=(COMBINE_WARPS * 32, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )[0]


@functools.cache
def _template(D, G, KB, VB, RK, RV, NKV, MASK, MB, QT, MT, HT):
    """The decode kernel's template arguments (made once per kind of call).
    The types of the queries, the mask and the held tokens are part of the
    kernel's signature, so they must be part of its name (MLX caches a
    compiled kernel by its name)."""
    names = ("D", "G", "KB", "VB", "RK", "RV", "NKV", "MASK", "MB", "WARPS")
    values = (D, G, KB, VB, RK, RV, NKV, MASK, MB, WARPS)
    return (*zip(names, values), ("QT", QT), ("MT", MT), ("HT", HT))


@functools.cache
def _held_count(n):
    """The kernel's count of held keys: made once, so that a decode step
    neither uploads it nor adds a node to the graph."""
    return mx.array([n], dtype=mx.int32)


@functools.cache
def _stand_in(dtype):
    """An input the launch does not read (no held tokens, no key mean...)."""
    return mx.zeros((1, 1, 1, 1), dtype=dtype)


@functools.cache
def _kept_span(first, count):
    """The kernel's (first, count) of one sequence's kept tokens: made once
    per count, as ``_held_count``."""
    return mx.array([[first, count]], dtype=mx.int32)


def _kept_inputs(kept, dtype):
    """The kept tokens as the decode kernel reads them: keys and values in
    the held tokens' ``dtype`` and (first, count) per sequence."""
    if kept is None:
        return _stand_in(dtype), _stand_in(dtype), _kept_span(0, 0)
    keys, values, first, count = kept
    if isinstance(first, int):
        span = _kept_span(first, count)
    else:
        span = mx.stack([first, mx.full(first.shape, count)], axis=1)
        span = span.astype(mx.int32)
    return keys.astype(dtype), values.astype(dtype), span


@dataclass(frozen=True)
class _Launch:
    """One decode launch over up to ``MAX_PAGES`` pages: their indices (the
    last repeated to fill ``n_slots``), sizes and first key's position,
    whether its extra block attends the held and kept tokens and whether it
    writes the incoming held token (then its last two outputs are the
    buffers)."""

    kernel: object
    pages: tuple
    n_slots: int
    sizes: list
    page_start: int
    extra_block: bool
    held: bool
    fresh: bool
    buffer_shape: tuple


@dataclass(frozen=True)
class _DecodePlan:
    rows: int
    G: int
    D: int
    scale_bits: int
    launches: tuple
    extras: bool
    output_dtypes: list
    combine: object


@functools.lru_cache(maxsize=256)
def _decode_plan(
    q_shape,
    q_dtype,
    n_kv_heads,
    sizes,
    key_codec,
    value_codec,
    mask,
    held,
    kept,
    transforms,
    scale,
):
    """What a decode call's launches hold that does not change from step to
    step (kernels, page slots, output types), made once per kind of call:
    the host time of a decode step counts. ``mask``: (kind, one row per
    sequence, dtype); ``held``: (buffer shape, dtype, any held, incoming);
    ``transforms``: whether each of key mean, value mean, key weights is
    given."""
    B, n_q_heads, _, D = q_shape
    G = n_q_heads // n_kv_heads
    mask_kind, mask_rows, mask_dtype = mask
    held_shape, held_dtype, has_held, incoming = held
    key_mean, value_mean, key_weights = transforms
    rotates_values = _rotates(value_codec)
    template = _template(
        D,
        G,
        key_codec.bits,
        value_codec.bits,
        _rotates(key_codec),
        rotates_values,
        n_kv_heads,
        mask_kind,
        mask_rows,
        q_dtype,
        mask_dtype,
        held_dtype,
    )
    whole = all(size % 16 == 0 for size in sizes)
    extras = kept or any(transforms)
    launches = []
    for first in range(0, len(sizes), MAX_PAGES):
        pages = list(range(first, min(first + MAX_PAGES, len(sizes))))
        n_slots = 1 << (len(pages) - 1).bit_length()
        # the last launch has one more block for the held and kept keys
        last_launch = first + MAX_PAGES >= len(sizes)
        launch_held = has_held and last_launch
        launch_kept = kept and last_launch
        fresh = incoming and launch_held
        launch = (
            ("NP", n_slots),
            ("INC", fresh),
            ("WHOLE", whole),
            ("KEPT", launch_kept),
            ("SKIP", kept),
            ("CK", key_mean),
            ("CV", value_mean),
            ("WK", key_weights),
        )
        spec = _decode_kernel(n_slots, extras)
        kernel = qd.specialized_kernel(*spec, template + launch, _header())
        launches.append(
            _Launch(
                kernel=kernel,
                pages=tuple(pages + [pages[-1]] * (n_slots - len(pages))),
                n_slots=n_slots,
                sizes=list(sizes[first : pages[-1] + 1]),
                page_start=sum(sizes[:first]),
                extra_block=launch_held or launch_kept,
                held=launch_held,
                fresh=fresh,
                buffer_shape=held_shape if fresh else (1, 1, 1, 1),
            )
        )
    return _DecodePlan(
        rows=B * n_kv_heads,
        G=G,
        D=D,
        scale_bits=struct.unpack("i", struct.pack("f", scale))[0],
        launches=tuple(launches),
        extras=extras,
        output_dtypes=[mx.float32] * 3 + [held_dtype] * 2,
        combine=_combine_kernel(G, D, q_dtype, rotates_values, value_mean),
    )


def decode_attention(
    queries,
    key_pages,
    value_pages,
    key_codec,
    value_codec,
    scale,
    mask,
    length,
    held=None,
    kept=None,
    transforms=(None, None, None),
):
    """Attention of one query token per sequence over the first ``length``
    keys and values of the pages, then the ``held`` ones if given (keys and
    values of shape (B, n_kv_heads, buffer, D), centered like the pages but
    not rotated, how many of them count, and the last of them as a
    (B, n_kv_heads, 1, D) key and value if it is not in the buffer yet, else
    None; ``applies`` says which calls). ``kept``: the cache's first tokens
    kept unquantized (keys and values as stored, rotated like the pages, the
    position of each sequence's first token, an int or a (B,) array, and how
    many), read instead of their copies in the pages. ``transforms``: the
    cache's float32 key mean, value mean and key weights (each (B,
    n_kv_heads, 1, D) or None): the queries are divided by the weights, the
    incoming held token centered and weighted and the output gets the value
    mean back, as the cache's MLX ops do (``omlx_cache.center``). Returns the
    output and, where a last held token was given, the buffer with it in
    place (else None)."""
    B = queries.shape[0]
    sizes, stored = [], 0
    for page in key_pages:
        if sizes and stored >= length:
            break
        sizes.append(page[0].shape[2])
        stored += sizes[-1]
    held_keys, held_values, n_held, incoming = held or (
        _stand_in(queries.dtype),
        _stand_in(queries.dtype),
        0,
        None,
    )
    if mask is None or isinstance(mask, str):
        mask_key = (0, False, mx.bool_)
        mask = qd._no_mask()
    else:
        kind = qd._mask_kind(mask, B, length + n_held)
        mask_key = (kind, mask.shape[0] > 1, mask.dtype)
    key_mean, value_mean, key_weights = transforms
    plan = _decode_plan(
        queries.shape,
        queries.dtype,
        key_pages[0][0].shape[1],
        tuple(sizes),
        key_codec,
        value_codec,
        mask_key,
        (held_keys.shape, held_keys.dtype, n_held > 0, incoming is not None),
        kept is not None,
        (key_mean is not None, value_mean is not None, key_weights is not None),
        scale,
    )
    rows, G, D = plan.rows, plan.G, plan.D
    extra_inputs = []
    if plan.extras:
        extra_inputs = list(_kept_inputs(kept, held_keys.dtype))
        extra_inputs += [_stand_in(mx.float32) if x is None else x for x in transforms]
    no_fresh = [_stand_in(held_keys.dtype)] * 2
    values, maxes, sums, buffers = [], [], [], None
    for launch in plan.launches:
        meta, splits = qd._meta(
            length,
            launch.sizes,
            launch.page_start,
            rows,
            launch.n_slots,
            plan.scale_bits,
        )
        n_blocks = len(launch.sizes) * splits + launch.extra_block
        inputs = [queries]
        for p in launch.pages:
            inputs += [*key_pages[p], *value_pages[p]]
        held_count = _held_count(n_held if launch.held else 0)
        inputs += [meta, mask, held_keys, held_values, held_count]
        inputs += incoming if launch.fresh else no_fresh
        inputs += extra_inputs
        v, m, s, *held_out = launch.kernel(
            inputs=inputs,
            grid=(n_blocks * 32 * WARPS, rows, 1),
            threadgroup=(32 * WARPS, 1, 1),
            output_shapes=[
                (rows, n_blocks, G, D),
                (rows, n_blocks, G),
                (rows, n_blocks, G),
                launch.buffer_shape,
                launch.buffer_shape,
            ],
            output_dtypes=plan.output_dtypes,
        )
        if launch.fresh:
            buffers = tuple(held_out)
        values.append(v)
        maxes.append(m)
        sums.append(s)
    if len(values) > 1:
        values = mx.concatenate(values, axis=1)
        maxes = mx.concatenate(maxes, axis=1)
        sums = mx.concatenate(sums, axis=1)
    else:
        values, maxes, sums = values[0], maxes[0], sums[0]
    shape = (B, queries.shape[1], 1, D)
    out = _combine(plan.combine, values, maxes, sums, queries.dtype, shape, value_mean)
    return out, buffers


def attention(
    queries,
    key_pages,
    value_pages,
    key_codec,
    value_codec,
    scale,
    mask,
    sinks,
    length,
    held=None,
    kept=None,
    transforms=(None, None, None),
):
    """The kernels' attention over a codebook cache's pages (the first
    ``length`` tokens, then the ``held`` ones, the ``kept`` first tokens in
    place of their copies, as in ``decode_attention``, whose ``transforms``
    a decode call takes; more queries come divided by the key weights and
    their output is returned without the value mean): the output and the
    held buffer with its incoming token in place (or None), or None where
    they do not apply (the caller takes the MLX-ops path)."""
    codecs = (key_codec, value_codec)
    n_held = held[2] if held else 0
    if not applies(
        queries, key_pages, value_pages, *codecs, mask, sinks, length + n_held, held
    ):
        return None
    args = (queries, key_pages, value_pages, *codecs, scale, mask, length)
    if queries.shape[2] == 1:
        return decode_attention(*args, held=held, kept=kept, transforms=transforms)
    out = prefill_attention(*args, kept=kept)
    if out is None:
        return None
    # one layer's decoded copy at a time, as patch 0016 does for affine pages:
    # a chunk's lazy graph would hold every layer's (16 GiB at 128K, 8B shape)
    mx.eval(out)
    return out, None


__all__ = [
    "applies",
    "attention",
    "decode_attention",
    "decoding_by_ops",
    "dequantize",
    "dequantize_by_ops",
    "encode",
    "encodes",
    "holds",
    "prefill_attention",
]
