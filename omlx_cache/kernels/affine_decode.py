"""Decode attention over a quantized KV cache, fused into CUDA kernels.

One query token attends to the affine-quantized pages of an
``omlx_cache.kv`` store. A block takes a span of one page's
keys; each warp takes 16 keys at a time and scores them against the query
heads of their KV head on tensor cores (``mma.sync``, halves in, float32
out), the keys dequantized to halves on the way in; it folds the scores into
its online softmax (running max and sum in float32) and adds the keys' values,
dequantized the same way, with a second ``mma.sync``. A warp loads a tile's
words while it computes the previous tile. A mask with one row of keys per
sequence (boolean, or added to the scores) is read key by key, which covers
batched decode with left padding. Each block writes a partial (max, sum,
weighted values) and a second kernel combines them. Up to ``MAX_PAGES`` pages
are handled by one launch. Keys and values held unquantized after the pages
(a store's held decode tokens, ``kv.kernels.Hold``) get one more block.
Tensor cores need compute capability 8.0 (Ampere) or later.

Registered in ``omlx_cache.kernels`` for stores of two ``Affine`` codecs; the
MLX-ops loop of ``omlx_cache.kv.attention`` is the fallback and the reference.
"""

import functools
import hashlib
import struct

import mlx.core as mx

WARPS = 4
COMBINE_WARPS = 8
MAX_PAGES = 32

_HEADER = """
// an mma.sync of 16 x 16 halves (row) by 16 x 8 halves (col) into 16 x 8 floats
__device__ __forceinline__ void mma_16x8x16(
    float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t h2_bits(__half2 x) {
  return *reinterpret_cast<uint32_t*>(&x);
}

__device__ __forceinline__ __half2 bits_h2(uint32_t x) {
  return *reinterpret_cast<__half2*>(&x);
}

// the B-bit fields of x at bit s and s + 16, dequantized as a pair of halves:
// 0x6400 | q is the half 1024 + q
template <int B>
__device__ __forceinline__ uint32_t
dequant_pair(uint32_t x, int s, __half2 scale, __half2 bias) {
  constexpr uint32_t m = (1u << B) - 1u;
  const uint32_t q = ((x >> s) & (m | (m << 16))) | 0x64006400u;
  const __half2 v = __hsub2(bits_h2(q), bits_h2(0x64006400u));
  return h2_bits(__hfma2(v, scale, bias));
}

// N words from memory aligned to N words (up to 16 bytes), in the fewest loads
template <int N>
__device__ __forceinline__ void load_words(uint32_t (&dst)[N], const uint32_t* src) {
  if constexpr (N % 4 == 0) {
    #pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if constexpr (N % 2 == 0) {
    #pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(src)[i];
    }
  } else {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = src[i];
    }
  }
}

template <int N>
__device__ __forceinline__ void zero_words(uint32_t (&dst)[N]) {
  #pragma unroll
  for (int i = 0; i < N; ++i) {
    dst[i] = 0u;
  }
}

template <typename T>
__device__ __forceinline__ __half2 half_pair(T a, T b) {
  return __floats2half2_rn(static_cast<float>(a), static_cast<float>(b));
}
"""

_DECODE_SOURCE = """
    // Tensor cores score 16 keys at a time against the (up to 8) query heads
    // of a KV head, then add the 16 keys' values the same way. A lane holds
    // the fragments of mma.sync's layout: "quad" (lane / 4) picks rows, "pos"
    // (lane % 4) columns. Keys are dequantized to halves on the way in; the
    // order of the dimensions inside a dot product is free, so a lane's part of
    // a key row is a contiguous quarter (D / 4 dims) and of a value row an
    // eighth, read with wide loads.
    constexpr int KW = D * KB / 32;
    constexpr int VW = D * VB / 32;
    constexpr int KGROUPS = D / KG;
    constexpr int KC = D / 4;                   // a lane's dims of a key row,
    constexpr int KCW = KC * KB / 32;           // their words,
    constexpr int KCG = KC > KG ? KC / KG : 1;  // their key groups
    constexpr int KGD = KC > KG ? KG : KC;      // and dims per group
    constexpr int KPAIRS = 16 / KB;             // fields 16 bits apart per word
    constexpr int STEPS = D / 16;               // mma steps over the head dim
    constexpr int VC = D / 8;                   // a lane's dims of a value row
    constexpr int VCW = VC * VB / 32;           // and their words
    constexpr int VPAIRS = 16 / VB;
    const float neg_inf = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31;
    const int quad = lane >> 2;
    const int pos = lane & 3;
    const int warp = threadIdx.x >> 5;
    const int bh = blockIdx.y;
    const int span = meta[3 * NP];
    const int splits = meta[3 * NP + 1];
    // the first block takes the held (unquantized) keys, if any: they follow
    // the pages' keys, but it starts first so as not to run alone at the end.
    // They are a sequence's first tokens (first_keys), then its held decode
    // tokens (held_keys).
    const int n_first = held_count[0];
    const int n_held = n_first + held_count[1];
    const bool held = n_held > 0 && blockIdx.x == 0;
    const int block = blockIdx.x - (n_held > 0);
    const int page = held ? 0 : block / splits;
    const int page_size = held ? held_keys_shape[2] : meta[NP + page];
    int page_offset = meta[2 * NP + page];
    if (held) {
        for (int i = 0; i < NP; ++i) {
            page_offset = max(page_offset, meta[2 * NP + i] + meta[i]);
        }
    }
    const int first = held ? 0 : (block % splits) * span;
    const int last = held ? n_held : min(first + span, meta[page]);
    // MASK 1: boolean (false drops a key), 2: added to the scores; one row
    // of keys per sequence (MB) or one for all
    const int mask_keys = mask_shape[3];
    const auto mask_row = mask + (MB ? (size_t)(bh / NKV) * mask_keys : 0) + page_offset;

    PAGE_POINTERS

    __shared__ float warp_max[WARPS][G];
    __shared__ float warp_sum[WARPS][G];
    __shared__ float warp_acc[WARPS][G][D];

    // the queries as the B operand (16 dims by 8 heads per step): head quad,
    // in the order the key bits unpack in
    const float scale = __int_as_float(meta[3 * NP + 2]);
    const auto q_row = queries + ((size_t)bh * G + quad % G) * D + pos * KC;
    uint32_t q_frag[STEPS][2];
    #pragma unroll
    for (int p = 0; p < 2 * STEPS; ++p) {
        const int d = (p / KPAIRS) * (32 / KB) + p % KPAIRS;
        const float q0 = quad < G ? static_cast<float>(q_row[d]) * scale : 0.f;
        const float q1 = quad < G ? static_cast<float>(q_row[d + 16 / KB]) * scale : 0.f;
        q_frag[p / 2][p % 2] = h2_bits(__floats2half2_rn(q0, q1));
    }

    // per lane: the query heads 2 * pos and 2 * pos + 1
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
    const size_t first_rows = (size_t)bh * first_keys_shape[2];
    const int v_group = (quad * VC) / VG;
    // a tile's words and scales, loaded a tile ahead of their use (keys
    // quad and quad + 8; values 2 pos, 2 pos + 8, 2 pos + 1, 2 pos + 9)
    struct Tile {
        uint32_t k[2][KCW];
        T k_scale[2][KCG];
        T k_bias[2][KCG];
        uint32_t v[4][VCW];
        T v_scale[4];
        T v_bias[4];
    };
    auto fetch = [&](int tile, Tile& t) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int k = tile + quad + 8 * r;
            const bool ok = k < last;
            if (ok) {
                load_words(t.k[r], k_packed + (rows + k) * KW + pos * KCW);
            } else {
                zero_words(t.k[r]);
            }
            #pragma unroll
            for (int j = 0; j < KCG; ++j) {
                const size_t i = (rows + k) * KGROUPS + (pos * KC) / KG + j;
                t.k_scale[r][j] = ok ? k_scales[i] : static_cast<T>(0.f);
                t.k_bias[r][j] = ok ? k_biases[i] : static_cast<T>(0.f);
            }
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int k = tile + 2 * pos + 8 * (r & 1) + (r >> 1);
            const bool ok = k < last;
            if (ok) {
                load_words(t.v[r], v_packed + (rows + k) * VW + quad * VCW);
            } else {
                zero_words(t.v[r]);
            }
            const size_t i = (rows + k) * (D / VG) + v_group;
            t.v_scale[r] = ok ? v_scales[i] : static_cast<T>(0.f);
            t.v_bias[r] = ok ? v_biases[i] : static_cast<T>(0.f);
        }
    };
    Tile cur;
    Tile next;
    if (!held && first + warp * 16 < last) {
        fetch(first + warp * 16, cur);
    }
    for (int tile = first + warp * 16; tile < last; tile += WARPS * 16) {
        if (!held && tile + WARPS * 16 < last) {
            fetch(tile + WARPS * 16, next);
        }
        const int key[2] = {tile + quad, tile + quad + 8};
        const int vkey[4] = {tile + 2 * pos, tile + 2 * pos + 8, tile + 2 * pos + 1,
                             tile + 2 * pos + 9};
        uint32_t a_key[2][STEPS][2];
        __half2 v_scale[2];
        __half2 v_bias[2];
        if (held) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int k = key[r] < last ? key[r] : 0;
                const auto k_row = k < n_first
                    ? first_keys + (first_rows + k) * D + pos * KC
                    : held_keys + (rows + k - n_first) * D + pos * KC;
                const bool ok = key[r] < last;
                #pragma unroll
                for (int p = 0; p < 2 * STEPS; ++p) {
                    const int d = (p / KPAIRS) * (32 / KB) + p % KPAIRS;
                    a_key[r][p / 2][p % 2] = ok ? h2_bits(half_pair(k_row[d], k_row[d + 16 / KB])) : 0u;
                }
            }
        } else {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                #pragma unroll
                for (int p = 0; p < 2 * STEPS; ++p) {
                    const int w = p / KPAIRS;
                    const int j = (w * (32 / KB)) / KGD;
                    a_key[r][p / 2][p % 2] = dequant_pair<KB>(
                        cur.k[r][w],
                        (p % KPAIRS) * KB,
                        __float2half2_rn(static_cast<float>(cur.k_scale[r][j])),
                        __float2half2_rn(static_cast<float>(cur.k_bias[r][j])));
                }
            }
            #pragma unroll
            for (int pair = 0; pair < 2; ++pair) {
                v_scale[pair] = half_pair(cur.v_scale[2 * pair], cur.v_scale[2 * pair + 1]);
                v_bias[pair] = half_pair(cur.v_bias[2 * pair], cur.v_bias[2 * pair + 1]);
            }
        }

        // scores: (key quad, head 2 pos), (quad, 2 pos + 1), (quad + 8, 2 pos),
        // (quad + 8, 2 pos + 1)
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const uint32_t a[4] = {a_key[0][i][0], a_key[1][i][0], a_key[0][i][1], a_key[1][i][1]};
            mma_16x8x16(s, a, q_frag[i]);
        }
        bool valid[2];
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            valid[r] = key[r] < last;
            float added = 0.f;
            if (MASK == 1 && valid[r]) {
                valid[r] = static_cast<bool>(mask_row[key[r]]);
            } else if (MASK == 2 && valid[r]) {
                added = static_cast<float>(mask_row[key[r]]);
            }
            s[2 * r] = valid[r] ? s[2 * r] + added : neg_inf;
            s[2 * r + 1] = valid[r] ? s[2 * r + 1] + added : neg_inf;
        }

        // online softmax over the tile, heads 2 pos and 2 pos + 1
        float p[4];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float top = fmaxf(s[h], s[2 + h]);
            #pragma unroll
            for (int o_ = 4; o_ < 32; o_ <<= 1) {
                top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o_));
            }
            const float m_new = fmaxf(m_run[h], top);
            // no key yet (all masked so far): nothing to correct
            const float correction = m_new == neg_inf ? 1.f : __expf(m_run[h] - m_new);
            p[h] = valid[0] && m_new > neg_inf ? __expf(s[h] - m_new) : 0.f;
            p[2 + h] = valid[1] && m_new > neg_inf ? __expf(s[2 + h] - m_new) : 0.f;
            l_run[h] = l_run[h] * correction + p[h] + p[2 + h];
            m_run[h] = m_new;
            #pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                o[i][h] *= correction;
                o[i][2 + h] *= correction;
            }
        }

        // the probabilities as the B operand (16 keys by 8 heads): a lane
        // needs head quad of keys 2 pos, 2 pos + 8 (lane 8 pos + quad / 2
        // has them) and 2 pos + 1, 2 pos + 9 (lane 8 pos + 4 + quad / 2)
        const uint32_t p_even = h2_bits(__floats2half2_rn(p[0], p[2]));
        const uint32_t p_odd = h2_bits(__floats2half2_rn(p[1], p[3]));
        const int src = 8 * pos + quad / 2;
        const uint32_t e0 = __shfl_sync(0xffffffff, p_even, src);
        const uint32_t o0 = __shfl_sync(0xffffffff, p_odd, src);
        const uint32_t e1 = __shfl_sync(0xffffffff, p_even, src + 4);
        const uint32_t o1 = __shfl_sync(0xffffffff, p_odd, src + 4);
        const uint32_t p_frag[2] = {quad & 1 ? o0 : e0, quad & 1 ? o1 : e1};

        // values: rows are dims (a lane's eighth, two per step), columns keys
        #pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            uint32_t a[4];
            if (held) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // (dim 2i, keys 0/1), (2i + 1, keys 0/1), (2i, 2/3), (2i + 1, 2/3)
                    const int d = quad * VC + 2 * i + (j & 1);
                    const int k0 = vkey[2 * (j >> 1)];
                    const int k1 = vkey[2 * (j >> 1) + 1];
                    const auto v0 = k0 >= last ? static_cast<H>(0.f)
                        : k0 < n_first ? first_values[(first_rows + k0) * D + d]
                        : held_values[(rows + k0 - n_first) * D + d];
                    const auto v1 = k1 >= last ? static_cast<H>(0.f)
                        : k1 < n_first ? first_values[(first_rows + k1) * D + d]
                        : held_values[(rows + k1 - n_first) * D + d];
                    a[j] = h2_bits(half_pair(v0, v1));
                }
            } else {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int e = 2 * i + (j & 1);
                    const int w = e / (2 * VPAIRS);
                    const int half = (e % (2 * VPAIRS)) / VPAIRS;
                    const int pair = j >> 1;
                    const uint32_t x = __byte_perm(
                        cur.v[2 * pair][w], cur.v[2 * pair + 1][w], half ? 0x7632 : 0x5410);
                    a[j] = dequant_pair<VB>(x, (e % VPAIRS) * VB, v_scale[pair], v_bias[pair]);
                }
            }
            mma_16x8x16(o[i], a, p_frag);
        }
        cur = next;
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
                warp_max[warp][g] = m_run[h];
                warp_sum[warp][g] = l_run[h];
            }
            #pragma unroll
            for (int i = 0; i < STEPS; ++i) {
                warp_acc[warp][g][quad * VC + 2 * i] = o[i][h];
                warp_acc[warp][g][quad * VC + 2 * i + 1] = o[i][2 + h];
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
    // a block per (row, query head): its warps take the partials in turn, a
    // lane D / 32 dims of each, then the warps' sums are added up
    constexpr int E = D / 32;
    const int rg = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int r = rg / G;
    const int g = rg % G;
    const int S = part_max_shape[1];
    const float neg_inf = __int_as_float(0xff800000);
    __shared__ float reduced[CW];
    __shared__ float acc_s[CW][D];
    float top = neg_inf;
    for (int s = threadIdx.x; s < S; s += CW * 32) {
        top = fmaxf(top, part_max[(r * S + s) * G + g]);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
    }
    if (lane == 0) {
        reduced[warp] = top;
    }
    __syncthreads();
    top = neg_inf;
    #pragma unroll
    for (int w = 0; w < CW; ++w) {
        top = fmaxf(top, reduced[w]);
    }
    __syncthreads();
    float total = 0.f;
    for (int s = threadIdx.x; s < S; s += CW * 32) {
        const int i = (r * S + s) * G + g;
        total += __expf(part_max[i] - top) * part_sum[i];
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        total += __shfl_xor_sync(0xffffffff, total, o);
    }
    if (lane == 0) {
        reduced[warp] = total;
    }
    float acc[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        acc[e] = 0.f;
    }
    #pragma unroll 4
    for (int s = warp; s < S; s += CW) {
        const int i = (r * S + s) * G + g;
        const float weight = __expf(part_max[i] - top);
        const float* v = part_values + (size_t)i * D + lane * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) {
            acc[e] += weight * v[e];
        }
    }
    #pragma unroll
    for (int e = 0; e < E; ++e) {
        acc_s[warp][lane * E + e] = acc[e];
    }
    __syncthreads();
    total = 0.f;
    #pragma unroll
    for (int w = 0; w < CW; ++w) {
        total += reduced[w];
    }
    for (int d = threadIdx.x; d < D; d += CW * 32) {
        float weighted = 0.f;
        #pragma unroll
        for (int w = 0; w < CW; ++w) {
            weighted += acc_s[w][d];
        }
        out[(size_t)rg * D + d] = static_cast<O>(weighted / total);
    }
"""

_PAGE_PARTS = ("k_packed", "k_scales", "k_biases", "v_packed", "v_scales", "v_biases")


def _page_pointers(n_pages):
    """Declarations that point each part's name at the block's page: a chain
    of selects, as an array of pointers indexed by the page would be built in
    every thread's local memory."""
    lines = []
    for part in _PAGE_PARTS:
        chain = f"{part}_{n_pages - 1}"
        for i in reversed(range(n_pages - 1)):
            chain = f"page == {i} ? {part}_{i} : {chain}"
        lines.append(f"const auto {part} = {chain};")
    return "\n    ".join(lines)


def kernel_name(name: str, code: str) -> str:
    """``name`` with a digest of the kernel's ``code`` (source and header).
    MLX keeps compiled CUDA kernels on disk by name alone (its PTX cache, per
    MLX version), so a kernel whose code changed under an old name would run
    as the build that first compiled it on that machine."""
    return f"{name}_{hashlib.sha1(code.encode()).hexdigest()[:10]}"


# MLX's names of the types of template arguments
_CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}


def _constants(template) -> str:
    """Template arguments as the lines MLX writes for them."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {str(value).lower()};")
        elif isinstance(value, int):
            lines.append(f"constexpr int {name} = {value};")
        else:
            lines.append(f"using {name} = {_CUDA_TYPES[value]};")
    return "\n".join(lines) + "\n"


def _compact(source: str) -> str:
    """``source`` without comments, indentation and blank lines."""
    lines = (line.split("//")[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line)


@functools.cache
def specialized_kernel(name, inputs, outputs, source, template, header=""):
    """A kernel made for one ``template`` (a tuple of template arguments) and
    launched with none, named as ``kernel_name`` names it. MLX formats a
    call's template arguments into the kernel's source and copies the source
    on every call: host time that a decode step pays twice a layer, less
    with no arguments and a compacted source."""
    body = _compact(_constants(template) + source)
    return mx.fast.cuda_kernel(
        name=kernel_name(name, header + body),
        input_names=list(inputs),
        output_names=list(outputs),
        source=body,
        header=header,
    )


@functools.cache
def _decode_kernel(n_pages):
    """The decode kernel's name, inputs, outputs and source (made per
    template by ``specialized_kernel``)."""
    inputs = ["queries"]
    inputs += [f"{part}_{i}" for i in range(n_pages) for part in _PAGE_PARTS]
    inputs += ["meta", "mask", "first_keys", "first_values"]
    inputs += ["held_keys", "held_values", "held_count"]
    source = _DECODE_SOURCE.replace("PAGE_POINTERS", _page_pointers(n_pages))
    name = f"quantized_sdpa_decode_{n_pages}"
    return name, tuple(inputs), ("out_values", "out_max", "out_sum"), source


def _combine_partials(values, maxes, sums, dtype, shape):
    """One softmax over the blocks' partials: (rows, S, G, D) to ``shape``
    (rows * G * D elements)."""
    rows, _, G, D = values.shape
    kernel = specialized_kernel(
        "quantized_sdpa_decode_combine",
        ("part_values", "part_max", "part_sum"),
        ("out",),
        _COMBINE_SOURCE,
        (("G", G), ("D", D), ("O", dtype), ("CW", COMBINE_WARPS)),
    )
    return kernel(
        inputs=[values, maxes, sums],
        grid=(rows * G * COMBINE_WARPS * 32, 1, 1),
        threadgroup=(COMBINE_WARPS * 32, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )[0]


@functools.cache
def _no_mask():
    """What the kernel's mask input gets when there is no mask."""
    return mx.zeros((1, 1, 1, 1), dtype=mx.bool_)


@functools.cache
def _cuda_available():
    """CUDA with the ``mma.sync`` shape the kernel uses (sm_80 and later)."""
    if not mx.cuda.is_available():
        return False
    return mx.device_info().get("compute_capability_major", 0) >= 8


def _mask_kind(mask, batch, length):
    """0 (no mask), 1 (boolean) or 2 (additive) for a mask the kernel takes,
    else None: an array mask must hold one row of keys per sequence or one
    for all (shape (B or 1, 1, 1, length))."""
    if mask is None or isinstance(mask, str):
        return 0
    if mask.ndim != 4 or mask.shape[1:] != (1, 1, length):
        return None
    if mask.shape[0] not in (1, batch):
        return None
    return 1 if mask.dtype == mx.bool_ else 2


@functools.cache
def _held_count(n_first, n_held):
    """The kernel's counts of first and held keys: made once, so that a decode
    step neither uploads them nor adds a node to the graph."""
    return mx.array([n_first, n_held], dtype=mx.int32)


@functools.cache
def _no_held(dtype):
    return mx.zeros((1, 1, 1, 1), dtype=dtype)


def _takes(head_dim, value_head_dim, bits, value_bits):
    return (
        mx.default_device() == mx.gpu
        and _cuda_available()
        and head_dim in (64, 128, 256)
        and value_head_dim == head_dim
        and bits in (2, 4, 8)
        and value_bits in (2, 4, 8)
        # a lane takes an eighth of a value row: at least one 32-bit word
        and head_dim * value_bits >= 256
    )


def takes_held_tokens(keys, values, bits, value_bits):
    """Whether decode keys and values like these may wait unquantized for
    the kernel (``held`` in ``quantized_decode_attention``)."""
    return _takes(keys.shape[-1], values.shape[-1], bits, value_bits)


def applies(queries, mask, key_pages, value_pages, bits, value_bits, length):
    """Whether the fused CUDA decode kernel handles this call (``length``:
    the keys attended, held ones included)."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = key_pages[0][0].shape[-3]
    value_head_dim = value_pages[0][0].shape[-1] * 32 // value_bits
    return (
        L == 1
        and _takes(D, value_head_dim, bits, value_bits)
        and _mask_kind(mask, B, length) is not None
        and n_q_heads // n_kv_heads <= 8
    )


def _decode_span(length: int, n_rows: int) -> int:
    """Keys per block: about 512 blocks in all, 128 to 1024 keys each (one
    wave of blocks on an H100 at one sequence; more, shorter blocks spend
    more of their time starting and writing partials)."""
    span = max(128, min(1024, length * n_rows // 512))
    return 1 << (span.bit_length() - 1)


def _launch_layout(length, sizes, page_start, n_rows):
    """Keys in each of a launch's pages, keys per block and blocks per page
    when ``length`` keys are stored (``page_start`` before the first page)."""
    n_keys = []
    for size in sizes:
        n_keys.append(max(0, min(size, length - page_start)))
        page_start += size
    span = _decode_span(length, n_rows)
    return n_keys, span, (max(n_keys) + span - 1) // span


META_ROWS = 256
_meta_tables = {}


def _meta(length, sizes, page_start, n_rows, n_slots, scale_bits):
    """The launch's int32 arguments for ``length`` stored keys (keys, size and
    first key's position per page slot, then keys per block, blocks per page
    and the scale's bits)
    as a device array, and its blocks per page. The rows of the next
    ``META_ROWS`` lengths are uploaded at once, so that a decode step copies
    nothing from the host."""
    key = (tuple(sizes), page_start, n_rows, n_slots, scale_bits)
    first, rows, table, views = _meta_tables.get(key, (length, None, None, None))
    if table is None or not 0 <= length - first < META_ROWS:
        pad = n_slots - len(sizes)
        offsets = [page_start + sum(sizes[:i]) for i in range(len(sizes))]
        slots = sizes + [sizes[-1]] * pad + offsets + [offsets[-1]] * pad
        first, rows = length, []
        for n in range(length, length + META_ROWS):
            n_keys, span, splits = _launch_layout(n, sizes, page_start, n_rows)
            rows.append(n_keys + [0] * pad + slots + [span, splits, scale_bits])
        if len(_meta_tables) >= 64:
            _meta_tables.clear()
        table = mx.array(rows, dtype=mx.int32)
        # a row's view is kept: evaluated once, it adds no node to a graph
        views = {}
        _meta_tables[key] = (first, rows, table, views)
    i = length - first
    if i not in views:
        views[i] = table[i]
    return views[i], rows[i][-2]


def quantized_decode_attention(
    queries,
    key_pages,
    value_pages,
    scale,
    length,
    group_size,
    bits,
    value_group_size,
    value_bits,
    mask=None,
    held=None,
    first=None,
    sinks=None,
):
    """Attention of one query token over the first ``length`` keys of the
    quantized pages, then the ``first`` and the ``held`` ones if given
    (unquantized keys and values of shape (B, n_kv_heads, buffer, D) and how
    many of them count); arguments as in
    ``quantized_scaled_dot_product_attention`` (``applies`` says which masks
    the kernel takes; an array mask's columns: the pages', the first ones',
    the held ones'). ``sinks``: float32 logits (B or 1, n_q_heads, 1) of a
    key with no value per query head."""
    B, n_q_heads, _, D = queries.shape
    n_kv_heads = key_pages[0][0].shape[-3]
    G = n_q_heads // n_kv_heads
    rows = B * n_kv_heads
    # the kernel scales the queries itself: the scale goes in as float bits
    scale_bits = struct.unpack("i", struct.pack("f", scale))[0]

    sizes, stored = [], 0
    for page in key_pages:
        if sizes and stored >= length:
            break
        sizes.append(page[0].shape[-2])
        stored += sizes[-1]
    dtype = key_pages[0][1].dtype
    held_keys, held_values, n_held = held or (_no_held(dtype), _no_held(dtype), 0)
    first_keys, first_values, n_first = first or (None, None, 0)
    if not n_first:
        first_keys = first_values = _no_held(held_keys.dtype)
    elif not n_held:
        held_keys = held_values = _no_held(first_keys.dtype)
    elif first_keys.dtype != held_keys.dtype:
        first_keys = first_keys.astype(held_keys.dtype)
        first_values = first_values.astype(held_keys.dtype)
    template = (
        ("D", D),
        ("G", G),
        ("KB", bits),
        ("KG", group_size),
        ("VB", value_bits),
        ("VG", value_group_size),
        ("WARPS", WARPS),
        ("NKV", n_kv_heads),
        ("MASK", _mask_kind(mask, B, length + n_first + n_held)),
        ("MB", mask is not None and not isinstance(mask, str) and mask.shape[0] > 1),
        # the scales' and the mask's types are part of the signature, so of the
        # kernel's name
        ("T", dtype),
        ("H", held_keys.dtype),
    )
    if mask is None or isinstance(mask, str):
        mask = _no_mask()
    values, maxes, sums = [], [], []
    for launch in range(0, len(sizes), MAX_PAGES):
        pages = list(range(launch, min(launch + MAX_PAGES, len(sizes))))
        # a kernel per power of two of page slots: each compiles once (seconds)
        n_slots = 1 << (len(pages) - 1).bit_length()
        launch_sizes = sizes[launch : pages[-1] + 1]
        meta, splits = _meta(
            length, launch_sizes, sum(sizes[:launch]), rows, n_slots, scale_bits
        )
        n_blocks = len(pages) * splits
        # the last launch has one more block for the first and held keys
        last_launch = launch + MAX_PAGES >= len(sizes)
        counts = (n_first, n_held) if last_launch else (0, 0)
        if sum(counts):
            n_blocks += 1
        # unused slots repeat the last page; no block reads them
        pages += [pages[-1]] * (n_slots - len(pages))
        inputs = [queries]
        for p in pages:
            inputs += [*key_pages[p], *value_pages[p]]
        inputs += [meta, mask, first_keys, first_values]
        inputs += [held_keys, held_values, _held_count(*counts)]
        kernel = specialized_kernel(
            *_decode_kernel(n_slots), template + (("NP", n_slots),), _HEADER
        )
        v, m, s = kernel(
            inputs=inputs,
            grid=(n_blocks * 32 * WARPS, rows, 1),
            threadgroup=(32 * WARPS, 1, 1),
            output_shapes=[
                (rows, n_blocks, G, D),
                (rows, n_blocks, G),
                (rows, n_blocks, G),
            ],
            output_dtypes=[mx.float32] * 3,
        )
        values.append(v)
        maxes.append(m)
        sums.append(s)
    if sinks is not None:
        # a sink is one more partial: its logit the maximum, a sum of 1, no value
        sinks = mx.broadcast_to(sinks, (B, n_q_heads, 1)).reshape(rows, 1, G)
        values.append(mx.zeros((rows, 1, G, D), mx.float32))
        maxes.append(sinks.astype(mx.float32))
        sums.append(mx.ones((rows, 1, G), mx.float32))
    if len(values) > 1:
        values = mx.concatenate(values, axis=1)
        maxes = mx.concatenate(maxes, axis=1)
        sums = mx.concatenate(sums, axis=1)
    else:
        values, maxes, sums = values[0], maxes[0], sums[0]
    # the combined rows are the query heads in order
    return _combine_partials(values, maxes, sums, queries.dtype, (B, n_q_heads, 1, D))


def first_tokens_mask(first, count, n_held, mask, length, B):
    """The mask row (B or 1, 1, 1, keys) for the first ``count`` tokens of
    each sequence from stored row ``first`` (an int or (B,)) attended as the
    kernel's ``first`` keys, after the pages and before ``n_held`` held
    ones: their quantized copies in the pages hidden."""
    if mask is None or isinstance(mask, str):
        mask = mx.ones((1, 1, 1, length + n_held), dtype=mx.bool_)
    while mask.ndim < 4:
        mask = mask[None]
    # where each sequence's kept tokens are: (1 or B, 1, 1, count)
    if isinstance(first, int):
        positions = (first + mx.arange(count))[None, None, None]
    else:
        positions = (first[:, None] + mx.arange(count))[:, None, None]
        mask = mx.broadcast_to(mask, (B, *mask.shape[1:]))
    k_pos = mx.arange(length)
    hidden = (k_pos >= positions[..., :1]) & (k_pos < positions[..., :1] + count)
    index = mx.broadcast_to(
        mx.minimum(positions, mask.shape[-1] - 1), (*mask.shape[:3], count)
    )
    kept = mx.take_along_axis(mask, index, axis=-1)
    valid = positions < length
    stored, decoded = mask[..., :length], mask[..., length:]
    if mask.dtype == mx.bool_:
        stored, kept = stored & ~hidden, kept & valid
    else:
        stored = mx.where(hidden, -float("inf"), stored)
        kept = mx.where(valid, kept, -float("inf"))
    return mx.concatenate([stored, kept, decoded], axis=-1)
