"""Prefill attention over a quantized KV cache, fused into one CUDA kernel.

Flash-attention style: a block takes ``WARPS * 16`` query rows of one KV head
(the query heads that share it folded in, rows ordered by position, then
head) and walks the keys a tile at a time. The block's threads load a tile's
quantized keys and values, dequantize them to halves in registers and store
them in shared memory (values transposed); each warp scores its 16 rows
against the tile on tensor cores (``mma.sync``, halves in, float32 out), folds
the scores into its online softmax (running max and sum in float32, the causal
mask and the stored length applied) and adds the tile's values with a second
``mma.sync``. The next tile's words are loaded while a tile is computed.

Inside a dot product the order of the dimensions is free, so a key row is
stored in the order its bits unpack in (pairs of fields 16 bits apart) and the
queries are permuted the same way.

Registered in ``omlx_cache.kernels`` for stores of two ``Affine`` codecs; the
MLX-ops loop of ``omlx_cache.kv.attention`` is the fallback and the reference.
"""

import math
import struct

import mlx.core as mx
from mlx_lm.models.base import MASKED_SCORES, masked_attention_in_blocks

from ..kv.spans import with_first_rows
from . import affine_decode as quantized_decode

# 8 warps of 16 query rows share a tile's loads and dequantization (faster
# than 4 on an H100: 20.0 against 21.5 ms for 2,048 queries over 128K keys)
WARPS = 8
MAX_PAGES = 32

# A prefill chunk attends over copies of its layer's keys and values
# dequantized to the queries' type, with ``mx.fast.scaled_dot_product_attention``
# (cuDNN's flash attention on CUDA, float32 scores and softmax): on an H100
# about three times the fused kernel's speed at 32K-128K keys. The KV heads
# are taken a few at a time so that a copy takes at most this many bytes
# (at 128K keys, heads of 128: four of 8 KV heads at a time); where one head
# takes more, the fused kernel runs. 0: always the fused kernel.
DECODED_BYTES = 1 << 28
DECODED_HEAD_DIMS = (64, 128)
# A batch's prefill (an array mask hides its padding) materialises the scores:
# at most this many a call (1 GiB in float32; 4 x 32K prompts ran out of
# memory on an H200 without it).
DECODED_SCORES = MASKED_SCORES

_HEADER = (
    quantized_decode._HEADER
    + """
// four 8 x 8 matrices of halves from shared memory: lane l gives the address
// of row l % 8 of matrix l / 8 and gets row l / 4, columns 2 (l % 4), + 1 of
// each matrix
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __half* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(a));
}
"""
)

_PREFILL_SOURCE = """
    constexpr int THREADS = WARPS * 32;
    constexpr int ROWS = WARPS * 16;             // query rows per block
    constexpr int KW = D * KB / 32;              // words per key row
    constexpr int VW = D * VB / 32;              // and per value row
    constexpr int KF = 32 / KB;                  // fields per key word
    constexpr int VF = 32 / VB;
    constexpr int CK = KG * KB / 32 < 4 ? KG * KB / 32 : 4;  // words per key load
    constexpr int CV = VG * VB / 32 < 4 ? VG * VB / 32 : 4;  // and per value load
    constexpr int K_ITEMS = BN * KW / CK;        // (key, chunk) loads per tile
    constexpr int V_ITEMS = BN / 2 * (VW / CV);  // (key pair, chunk) loads
    constexpr int KI = (K_ITEMS + THREADS - 1) / THREADS;
    constexpr int VI = (V_ITEMS + THREADS - 1) / THREADS;
    constexpr int KP = D + 8;                    // shared row pitches, in halves
    constexpr int VP = BN + 8;
    constexpr bool QREG = D <= 128;              // queries in registers, else shared
    const float neg_inf = __int_as_float(0xff800000);

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int quad = lane >> 2;
    const int pos = lane & 3;
    const int warp = tid >> 5;
    const int bh = blockIdx.y;
    const int length = meta[3 * NP];
    const int L = meta[3 * NP + 1];
    const float scale = __int_as_float(meta[3 * NP + 2]);
    const int R = G * L;
    // the blocks with the most keys (the last rows) start first
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ROWS;
    const int row_last = min(R, row0 + ROWS) - 1;
    const int first_pos = length - L;
    const int key_limit = CAUSAL ? first_pos + row_last / G + 1 : length;

    extern __shared__ __align__(16) unsigned char smem[];
    __half* k_s = reinterpret_cast<__half*>(smem);   // [BN][KP]
    __half* v_s = k_s + BN * KP;                     // [D][VP], transposed
    __half* q_s = v_s + D * VP;                      // [ROWS][KP] when !QREG

    // this lane's rows (quad and quad + 8 of the warp's 16) and positions
    int q_pos[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + warp * 16 + quad + 8 * r;
        q_pos[r] = row < R ? first_pos + row / G : -1;
    }
    const int warp_first_pos = first_pos + min(row0 + warp * 16, R - 1) / G;

    // the queries, scaled (by log2(e) too: exp2 below) and permuted as the
    // key rows are stored: position p of a row holds dim perm_dim(p)
    auto perm_dim = [](int p) {
        const int w = p / KF;
        const int r = p % KF;
        return w * KF + r / 2 + (r % 2) * (KF / 2);
    };
    auto q_pair = [&](int row, int p) -> uint32_t {
        if (row >= R) {
            return 0u;
        }
        const auto q_row = queries + ((size_t)(bh * G + row % G) * L + row / G) * D;
        return h2_bits(__floats2half2_rn(
            static_cast<float>(q_row[perm_dim(p)]) * scale,
            static_cast<float>(q_row[perm_dim(p + 1)]) * scale));
    };
    uint32_t q_frag[QREG ? D / 16 : 1][4];
    {
        const int row = row0 + warp * 16 + quad;
        if constexpr (QREG) {
            #pragma unroll
            for (int i = 0; i < D / 16; ++i) {
                q_frag[i][0] = q_pair(row, i * 16 + 2 * pos);
                q_frag[i][1] = q_pair(row + 8, i * 16 + 2 * pos);
                q_frag[i][2] = q_pair(row, i * 16 + 8 + 2 * pos);
                q_frag[i][3] = q_pair(row + 8, i * 16 + 8 + 2 * pos);
            }
        } else {
            // each warp writes and reads only its own 16 rows
            for (int i = lane; i < 16 * D / 2; i += 32) {
                const int r = i / (D / 2);
                const int p = 2 * (i % (D / 2));
                *reinterpret_cast<uint32_t*>(q_s + (warp * 16 + r) * KP + p) =
                    q_pair(row0 + warp * 16 + r, p);
            }
            __syncwarp();
        }
    }

    float m_run[2] = {neg_inf, neg_inf};
    float l_run[2] = {0.f, 0.f};
    float o[D / 8][4];
    #pragma unroll
    for (int i = 0; i < D / 8; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[i][j] = 0.f;
        }
    }

    // a tile's quantized words, scales and biases, loaded a tile ahead
    struct Tile {
        uint32_t k[KI][CK];
        T k_scale[KI];
        T k_bias[KI];
        uint32_t v[VI][2][CV];
        T v_scale[VI][2];
        T v_bias[VI][2];
    };
    // keys of page p this block attends (the causal limit applied)
    auto page_keys = [&](int p) {
        return max(0, min(meta[p], key_limit - meta[2 * NP + p]));
    };
    auto fetch = [&](int page, int start, Tile& t) {
        PAGE_POINTERS
        const size_t rows = (size_t)bh * meta[NP + page];
        const int n = page_keys(page) - start;
        #pragma unroll
        for (int j = 0; j < KI; ++j) {
            const int i = tid + j * THREADS;
            const int key = i / (KW / CK);
            const int c = i % (KW / CK);
            const bool ok = (K_ITEMS % THREADS == 0 || i < K_ITEMS) && key < n;
            if (ok) {
                load_words(t.k[j], k_packed + (rows + start + key) * KW + c * CK);
                const size_t g = (rows + start + key) * (D / KG) + (c * CK * KF) / KG;
                t.k_scale[j] = k_scales[g];
                t.k_bias[j] = k_biases[g];
            } else {
                zero_words(t.k[j]);
                t.k_scale[j] = static_cast<T>(0.f);
                t.k_bias[j] = static_cast<T>(0.f);
            }
        }
        #pragma unroll
        for (int j = 0; j < VI; ++j) {
            const int i = tid + j * THREADS;
            const int kp = i % (BN / 2);
            const int c = i / (BN / 2);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int key = 2 * kp + h;
                const bool ok = (V_ITEMS % THREADS == 0 || i < V_ITEMS) && key < n;
                if (ok) {
                    load_words(t.v[j][h], v_packed + (rows + start + key) * VW + c * CV);
                    const size_t g = (rows + start + key) * (D / VG) + (c * CV * VF) / VG;
                    t.v_scale[j][h] = v_scales[g];
                    t.v_bias[j][h] = v_biases[g];
                } else {
                    zero_words(t.v[j][h]);
                    t.v_scale[j][h] = static_cast<T>(0.f);
                    t.v_bias[j][h] = static_cast<T>(0.f);
                }
            }
        }
    };
    // dequantize a fetched tile into shared memory: keys as rows in unpack
    // order, values transposed (a word holds two keys of one dim)
    auto store = [&](const Tile& t) {
        #pragma unroll
        for (int j = 0; j < KI; ++j) {
            const int i = tid + j * THREADS;
            if (K_ITEMS % THREADS == 0 || i < K_ITEMS) {
                const int key = i / (KW / CK);
                const int c = i % (KW / CK);
                const __half2 sc = __float2half2_rn(static_cast<float>(t.k_scale[j]));
                const __half2 bi = __float2half2_rn(static_cast<float>(t.k_bias[j]));
                uint32_t h[CK * KF / 2];
                #pragma unroll
                for (int w = 0; w < CK; ++w) {
                    #pragma unroll
                    for (int f = 0; f < KF / 2; ++f) {
                        h[w * KF / 2 + f] = dequant_pair<KB>(t.k[j][w], f * KB, sc, bi);
                    }
                }
                uint4* dst = reinterpret_cast<uint4*>(k_s + key * KP + c * CK * KF);
                #pragma unroll
                for (int u = 0; u < CK * KF / 8; ++u) {
                    dst[u] = make_uint4(h[4 * u], h[4 * u + 1], h[4 * u + 2], h[4 * u + 3]);
                }
            }
        }
        #pragma unroll
        for (int j = 0; j < VI; ++j) {
            const int i = tid + j * THREADS;
            if (V_ITEMS % THREADS == 0 || i < V_ITEMS) {
                const int kp = i % (BN / 2);
                const int c = i / (BN / 2);
                const __half2 sc = half_pair(t.v_scale[j][0], t.v_scale[j][1]);
                const __half2 bi = half_pair(t.v_bias[j][0], t.v_bias[j][1]);
                #pragma unroll
                for (int w = 0; w < CV; ++w) {
                    #pragma unroll
                    for (int hi = 0; hi < 2; ++hi) {
                        const uint32_t x = __byte_perm(
                            t.v[j][0][w], t.v[j][1][w], hi ? 0x7632 : 0x5410);
                        #pragma unroll
                        for (int f = 0; f < VF / 2; ++f) {
                            const int d = (c * CV + w) * VF + hi * (VF / 2) + f;
                            *reinterpret_cast<uint32_t*>(v_s + d * VP + 2 * kp) =
                                dequant_pair<VB>(x, f * VB, sc, bi);
                        }
                    }
                }
            }
        }
    };

    // the tiles: pages in order, BN keys at a time, up to the causal limit
    int next_page = 0;
    int next_start = 0;
    while (next_page < NP && page_keys(next_page) == 0) {
        ++next_page;
    }
    Tile buf;
    if (next_page < NP) {
        fetch(next_page, 0, buf);
    }
    while (next_page < NP) {
        const int page = next_page;
        const int start = next_start;
        const int n_valid = min(BN, page_keys(page) - start);
        const int key0 = meta[2 * NP + page] + start;  // first key's position
        next_start += BN;
        if (next_start >= page_keys(page)) {
            next_start = 0;
            ++next_page;
            while (next_page < NP && page_keys(next_page) == 0) {
                ++next_page;
            }
        }
        __syncthreads();  // the previous tile is no longer read
        store(buf);
        __syncthreads();
        if (next_page < NP) {
            fetch(next_page, next_start, buf);
        }
        if (__all_sync(0xffffffff, q_pos[0] < 0)) {
            continue;  // a warp of padding rows
        }

        // scores: s[n] holds keys 8n + 2 pos, + 1 of rows quad (0, 1) and
        // quad + 8 (2, 3)
        float s[BN / 8][4];
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = 0.f;
            }
        }
        // keys 8 n + quad of s[n]; the B fragments of two steps over the
        // head dim per ldmatrix (dims 16 i + 2 pos and + 8, then i + 1)
        #pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < D / 16; i += 2) {
                uint32_t r[4];
                ldmatrix_x4(r, k_s + (8 * n + (lane & 7)) * KP + 16 * i + 8 * (lane >> 3));
                const uint32_t b0[2] = {r[0], r[1]};
                const uint32_t b1[2] = {r[2], r[3]};
                if constexpr (QREG) {
                    mma_16x8x16(s[n], q_frag[i], b0);
                    mma_16x8x16(s[n], q_frag[i + 1], b1);
                } else {
                    // rows 0-7 and 8-15 of the warp's queries, dims + 0 and + 8
                    const int row = warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
                    uint32_t a[4];
                    ldmatrix_x4(a, q_s + row * KP + 16 * i + 8 * (lane >> 4));
                    mma_16x8x16(s[n], a, b0);
                    ldmatrix_x4(a, q_s + row * KP + 16 * (i + 1) + 8 * (lane >> 4));
                    mma_16x8x16(s[n], a, b1);
                }
            }
        }
        const bool masked = n_valid < BN || (CAUSAL && key0 + BN - 1 > warp_first_pos);
        if (masked) {
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = 8 * n + 2 * pos + (e & 1);
                    const int qp = q_pos[e >> 1];
                    const bool ok = col < n_valid && (!CAUSAL || key0 + col <= qp) && qp >= 0;
                    s[n][e] = ok ? s[n][e] : neg_inf;
                }
            }
        }

        // online softmax, rows quad (h = 0) and quad + 8 (h = 1)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float top = neg_inf;
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                top = fmaxf(top, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            }
            top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 2));
            const float m_new = fmaxf(m_run[h], top);
            // no visible key yet: nothing to correct, nothing to add
            const float base = m_new == neg_inf ? 0.f : m_new;
            const float correction = exp2f(m_run[h] - base);
            float sum = 0.f;
            #pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                s[n][2 * h] = exp2f(s[n][2 * h] - base);
                s[n][2 * h + 1] = exp2f(s[n][2 * h + 1] - base);
                sum += s[n][2 * h] + s[n][2 * h + 1];
            }
            l_run[h] = l_run[h] * correction + sum;
            m_run[h] = m_new;
            #pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                o[i][2 * h] *= correction;
                o[i][2 * h + 1] *= correction;
            }
        }

        // values: the probabilities' fragments are the A operand as they are
        #pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            const uint32_t a[4] = {
                h2_bits(__floats2half2_rn(s[2 * kk][0], s[2 * kk][1])),
                h2_bits(__floats2half2_rn(s[2 * kk][2], s[2 * kk][3])),
                h2_bits(__floats2half2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1])),
                h2_bits(__floats2half2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]))};
            #pragma unroll
            for (int i = 0; i < D / 8; i += 2) {
                // dims 8 i + quad and 8 (i + 1) + quad, keys of step kk
                uint32_t r[4];
                ldmatrix_x4(r, v_s + (8 * i + (lane & 7) + 8 * (lane >> 4)) * VP + 16 * kk + 8 * ((lane >> 3) & 1));
                const uint32_t b0[2] = {r[0], r[1]};
                const uint32_t b1[2] = {r[2], r[3]};
                mma_16x8x16(o[i], a, b0);
                mma_16x8x16(o[i + 1], a, b1);
            }
        }
    }

    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xffffffff, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xffffffff, l_run[h], 2);
        const int row = row0 + warp * 16 + quad + 8 * h;
        if (row < R) {
            const float inv = 1.f / fmaxf(l_run[h], 1e-30f);
            auto out_row = out + ((size_t)(bh * G + row % G) * L + row / G) * D;
            #pragma unroll
            for (int i = 0; i < D / 8; ++i) {
                out_row[8 * i + 2 * pos] = static_cast<O>(o[i][2 * h] * inv);
                out_row[8 * i + 2 * pos + 1] = static_cast<O>(o[i][2 * h + 1] * inv);
            }
        }
    }
"""

_prefill_kernels = {}


def _prefill_kernel(n_pages, shared_bytes):
    key = (n_pages, shared_bytes)
    if key not in _prefill_kernels:
        inputs = ["queries"]
        inputs += [
            f"{part}_{i}"
            for i in range(n_pages)
            for part in quantized_decode._PAGE_PARTS
        ]
        source = _PREFILL_SOURCE.replace(
            "PAGE_POINTERS", quantized_decode._page_pointers(n_pages)
        )
        _prefill_kernels[key] = mx.fast.cuda_kernel(
            name=quantized_decode.kernel_name(
                f"quantized_sdpa_prefill_{n_pages}", _HEADER + source
            ),
            input_names=inputs + ["meta"],
            output_names=["out"],
            source=source,
            header=_HEADER,
            shared_memory=shared_bytes,
        )
    return _prefill_kernels[key]


def _tile_keys(head_dim):
    """Keys per tile: shared memory holds a tile's keys and values as halves."""
    return 32 if head_dim > 128 else 64


def _shared_bytes(head_dim, tile):
    keys = tile * (head_dim + 8)
    values = head_dim * (tile + 8)
    queries = WARPS * 16 * (head_dim + 8) if head_dim > 128 else 0
    return 2 * (keys + values + queries)


def _stored_pages(key_pages, length):
    """The pages that hold the first ``length`` keys."""
    n, stored = 0, 0
    for page in key_pages:
        if n and stored >= length:
            break
        n += 1
        stored += page[0].shape[-2]
    return n


def applies(queries, mask, key_pages, value_pages, bits, value_bits, length):
    """Whether the fused CUDA prefill kernel handles this call: half-precision
    queries (it multiplies in halves; float32 models keep float32 attention),
    no mask or a causal one, head dims 64, 128 or 256, 2, 4 or 8 bits, at most
    ``MAX_PAGES`` pages holding keys."""
    D = queries.shape[-1]
    value_head_dim = value_pages[0][0].shape[-1] * 32 // value_bits
    return (
        mx.default_device() == mx.gpu
        and quantized_decode._cuda_available()
        and queries.dtype in (mx.float16, mx.bfloat16)
        and (mask is None or (isinstance(mask, str) and mask == "causal"))
        and D in (64, 128, 256)
        and value_head_dim == D
        and bits in (2, 4, 8)
        and value_bits in (2, 4, 8)
        and _stored_pages(key_pages, length) <= MAX_PAGES
    )


def decodes(
    queries, mask, key_pages, value_pages, value_bits, length, exact=None, held=None
):
    """Whether this prefill call attends over dequantized copies of the keys
    and values (``decoded_attention``): on CUDA, several half-precision
    queries, any mask (a batch's hides its padding), and one KV head's copy of
    at most ``DECODED_BYTES``."""
    _, _, L, D = queries.shape
    value_head_dim = value_pages[0][0].shape[-1] * 32 // value_bits
    n_keys = length + (held[2] if held else 0)
    if exact is not None and isinstance(exact[2], int):
        n_keys += min(exact[3], max(-exact[2], 0))
    return (
        L > 1
        and mx.default_device() == mx.gpu
        and quantized_decode._cuda_available()
        and queries.dtype in (mx.float16, mx.bfloat16)
        and D in DECODED_HEAD_DIMS
        and value_head_dim == D
        and _head_bytes(queries, n_keys) <= DECODED_BYTES
    )


def _head_bytes(queries, length):
    """The bytes of one KV head's keys and values, dequantized."""
    B, _, _, D = queries.shape
    return 2 * B * length * D * queries.dtype.size


def _dequantized_pages(pages, length, heads, group_size, bits, dtype):
    """The first ``length`` rows of KV heads ``heads`` (a slice) of the
    pages, dequantized and end to end."""
    parts, start = [], 0
    for page in pages[: _stored_pages(pages, length)]:
        n = min(page[0].shape[-2], length - start)
        rows = tuple(x[:, heads, :n, :] for x in page)
        parts.append(
            mx.dequantize(*rows, group_size=group_size, bits=bits, dtype=dtype)
        )
        start += n
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


def _with_kept(x, kept, first, count, length, heads, dtype):
    """``x`` (the first ``length`` rows, dequantized; None: none) with rows
    ``first`` on replaced by the kept unquantized ones; those before row 0
    (tokens the pages do not hold) go in front."""
    before = min(count, max(-first, 0))
    n = min(count - before, length - max(first, 0))
    if n > 0:
        start = max(first, 0)
        x[..., start : start + n, :] = kept[:, heads, before : before + n].astype(
            x.dtype
        )
    if before:
        rows = kept[:, heads, :before].astype(dtype)
        x = rows if x is None else mx.concatenate([rows, x], axis=-2)
    return x


def _with_held(x, held, count, heads, dtype):
    """``x`` (None: no stored rows) followed by the first ``count`` held
    unquantized rows."""
    if not count:
        return x
    rows = held[:, heads, :count].astype(dtype)
    return rows if x is None else mx.concatenate([x, rows], axis=-2)


def decoded_attention(
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
    exact=None,
    held=None,
    sinks=None,
    key_shift=None,
):
    """Attention of ``queries`` over the first ``length`` keys and values,
    dequantized to the queries' type a few KV heads at a time (see
    ``DECODED_BYTES``), the ``exact`` (kept) ones read unquantized and the
    ``held`` ones after them; arguments as in ``quantized_prefill_attention``
    and ``base.quantized_scaled_dot_product_attention``. ``sinks``: a logit
    per query head; ``key_shift`` (B, n_kv_heads, 1, D): added to every key
    (what centering took) so that the sinks see the keys' own scores."""
    n_kv_heads = key_pages[0][0].shape[-3]
    G = queries.shape[1] // n_kv_heads
    n_held = held[2] if held else 0
    n_before = 0
    if exact is not None and isinstance(exact[2], int):
        n_before = min(exact[3], max(-exact[2], 0))
    head_bytes = _head_bytes(queries, n_before + length + n_held)
    step = max(1, min(n_kv_heads, DECODED_BYTES // head_bytes))
    outs = []
    for h in range(0, n_kv_heads, step):
        heads = slice(h, min(h + step, n_kv_heads))
        # no stored keys yet (a residual holds every token): no copy, as an
        # empty dequantize fails on CUDA
        keys = values = None
        if length:
            keys = _dequantized_pages(
                key_pages, length, heads, group_size, bits, queries.dtype
            )
            values = _dequantized_pages(
                value_pages, length, heads, value_group_size, value_bits, queries.dtype
            )
        per_sequence = exact is not None and not isinstance(exact[2], int)
        if exact is not None and not per_sequence:
            kept_keys, kept_values, first, count = exact
            keys, values = (
                _with_kept(x, kept, first, count, length, heads, queries.dtype)
                for x, kept in ((keys, kept_keys), (values, kept_values))
            )
        if held:
            keys = _with_held(keys, held[0], n_held, heads, queries.dtype)
            values = _with_held(values, held[1], n_held, heads, queries.dtype)
        if per_sequence and keys is not None:
            # a batch's first tokens are in its rows (pages or held), each
            # sequence's after its own padding
            kept_keys, kept_values, first, count = exact
            keys = with_first_rows(keys, kept_keys[:, heads], first, count)
            values = with_first_rows(values, kept_values[:, heads], first, count)
        if key_shift is not None:
            keys = keys + key_shift[:, heads]
        q_heads = slice(heads.start * G, heads.stop * G)
        outs.append(
            _attention_in_blocks(
                queries[:, q_heads],
                keys,
                values,
                scale,
                mask,
                None if sinks is None else sinks[q_heads],
            )
        )
        if step < n_kv_heads:
            # else MLX dequantizes every slice before the first attention
            mx.eval(outs[-1])
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def _attention_in_blocks(queries, keys, values, scale, mask, sinks=None):
    """``mx.fast.scaled_dot_product_attention``; with an array mask (no fused
    kernel takes one: the scores are materialised) in blocks of queries whose
    scores take at most ``DECODED_SCORES`` elements (patch 0011)."""
    if isinstance(mask, mx.array):
        return masked_attention_in_blocks(
            queries, keys, values, scale, mask, sinks, DECODED_SCORES
        )
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def quantized_prefill_attention(
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
):
    """Attention of ``queries`` (the last ``L`` positions of the first
    ``length`` keys when ``mask`` is "causal") over the quantized pages;
    arguments as in ``quantized_scaled_dot_product_attention``."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = key_pages[0][0].shape[-3]
    G = n_q_heads // n_kv_heads
    n_pages = _stored_pages(key_pages, length)
    n_slots = 1 << (n_pages - 1).bit_length()
    sizes = [p[0].shape[-2] for p in key_pages[:n_pages]]
    n_keys, offsets, start = [], [], 0
    for size in sizes:
        n_keys.append(max(0, min(size, length - start)))
        offsets.append(start)
        start += size
    # unused slots repeat the last page and hold no keys
    pad = n_slots - n_pages
    n_keys += [0] * pad
    sizes += [sizes[-1]] * pad
    offsets += [offsets[-1]] * pad
    # the kernel works in powers of two (exp2): log2(e) goes into the scale
    scale_bits = struct.unpack("i", struct.pack("f", scale * math.log2(math.e)))[0]
    meta = mx.array(n_keys + sizes + offsets + [length, L, scale_bits], mx.int32)
    inputs = [queries]
    for p in list(range(n_pages)) + [n_pages - 1] * pad:
        inputs += [*key_pages[p], *value_pages[p]]
    tile = _tile_keys(D)
    rows = WARPS * 16
    n_blocks = (G * L + rows - 1) // rows
    kernel = _prefill_kernel(n_slots, _shared_bytes(D, tile))
    return kernel(
        inputs=inputs + [meta],
        template=[
            ("D", D),
            ("G", G),
            ("KB", bits),
            ("KG", group_size),
            ("VB", value_bits),
            ("VG", value_group_size),
            ("BN", tile),
            ("WARPS", WARPS),
            ("NP", n_slots),
            ("CAUSAL", mask == "causal"),
            # the scales' and the queries' types are part of the signature,
            # so of the kernel's name
            ("T", key_pages[0][1].dtype),
            ("O", queries.dtype),
        ],
        grid=(n_blocks * WARPS * 32, B * n_kv_heads, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )[0]
