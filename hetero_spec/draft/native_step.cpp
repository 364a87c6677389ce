// The draft's greedy chain on the CPU in one native call: the round's real rows, then k draft steps, each
// the fusion, the blocks, the final norm and the head's argmax, with no Python or torch dispatch between them.
//
// WHY: a torch draft step is about 250 small kernel calls (2-4 us of dispatch each) around 9 matrix-vector
// products, so on a 2-core CPU the calls, not the 9 MB of weights, set its 1.3-1.9 ms.  Here every matrix is
// int8 with one float scale per output row.  Its activation row is quantized to int8 too (one scale per row,
// after SmoothQuant's per-channel scales) and multiplied with the instruction set's integer dot product,
// except in the layers that read the target's raw states (the taps' fc, the fusion's first layer), whose
// outlier channels a row of 255 levels cannot hold: those multiply the float row.  Rows of a matrix are split
// across OpenMP threads (one pool with llama.cpp's, whose threads wait while the draft runs).  The arithmetic
// is DraftRunner._forward_one's (and _blocks' for several real rows) and RescoredInt8Head.best's; only the
// rounding differs, and the head's best rows are rescored exactly in float as there.  The head, half of the
// weights read per step, may be int4 (native.py's default): its argmax is rescored from more rows instead.
//
// Built by hetero_spec/draft/native.py with: g++ -O3 -march=<native|x86-64-v3|...> -fopenmp -shared -fPIC
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

struct QMat {            // y = (W x) * scale + bias, W [out, in] int8 row-major
    const int8_t* w;
    const float* scale;   // [out]
    const float* bias;    // [out] or null
    const int32_t* wsum;  // [out] the sum of each row's int8 weights (the VNNI kernel's unsigned-offset correction)
    const float* inv_smooth;  // [in] or null: x times this first (SmoothQuant's 1/s, W holding W diag(s); or tap_scale)
    int32_t out, in;
    int32_t act_q;        // 1: the activation row is quantized to int8 too (integer dot products), 0: stays float
    int32_t bits;         // 4: w holds packed int4 rows (the head; see dot_q4), otherwise int8
};

struct Block {
    const float* attn_norm;  // [hidden] or null (q/k/v read x itself)
    QMat qkv, o, gate_up, down;
    const float* importance_w;  // [hidden] or null (no importance gate)
    float importance_b;
    const float* ffn_norm;      // [hidden]
    float* k_cache;             // [n_kv, max_pos, hd] float32
    float* v_cache;
    float* log_gate;            // [max_pos]
};

}  // namespace

extern "C" {

// Everything fixed for a runner's life; filled by native.py.  Layout mirrored by native.py's ctypes.
struct Model {
    int32_t hidden, n_embd, n_heads, n_kv, head_dim, ffn, n_blocks, max_pos;
    int32_t fusion;           // 0: dgf (Dovetail), 1: fc (EAGLE: fc([e; g]) + b)
    int32_t drafted_is_prenorm;  // 1: a drafted position's g is the step's pre-norm x (taps), 0: its feature
    float eps;
    int32_t recent_window;    // denoising: keys this close to the query are never dropped
    int32_t has_threshold;
    float log_threshold;
    const float* embed;       // [n_vocab, n_embd] float32
    const float* rope_cos;    // [max_pos, head_dim]
    const float* rope_sin;
    QMat tap;                 // the taps' fc (the target's concatenated rows x tap_scale -> g); w == null: none
    QMat w1, w2, wz;          // dgf: h1 = W1 g, h2 = silu(W2 norm(e)), z = sigmoid(Wz [h1; h2] + b); fc: w1 = fc
    const float* emb_norm;    // dgf's norm of e
    const float* final_norm;  // [hidden] or null
    QMat out_proj;            // w == null: none
    QMat head;                // [n_head, n_embd] int8, or int4 (bits 4: half the bytes; its best rows are rescored)
    const float* head_f32;    // [n_head, n_embd]: the rows rescored exactly
    int32_t rescore;
    const Block* blocks;
    float* holes;             // [max_pos]
};

}  // extern "C"

namespace {

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Ask for the weight bytes that a thread reads PREFETCH_BYTES later.  WHY: right after a target decode the draft's
// weights come from memory, and the hardware prefetcher stops at every 4 KB page; asking ahead took the int4
// head's read from 0.40 to 0.35 ms on the 2-vCPU development VM (back to back, from cache, it barely matters).
inline void prefetch_ahead(const void* row, size_t bytes, const void* end) {
#if defined(__x86_64__)
    const char* p = (const char*)row + PREFETCH_BYTES;
    for (size_t o = 0; o < bytes && p + o < (const char*)end; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
    (void)row; (void)bytes; (void)end;
#endif
}

// Y[i] = W X[i] (+ bias) for ``rows`` activation rows (X [rows, in], Y [rows, out]): every weight row is read
// once for all of them, so reading m real rows costs little more than one.

// float activation x int8 weight: the path of the layers that read the target's raw states (their outlier
// channels do not fit one row's 255 levels).  Four weight rows share each load of x.
void matmul_float(const QMat& m, const float* X, int rows, float* Y, int nt) {
    const int in = m.in, out = m.out, groups = out / 4;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int g = 0; g < groups; ++g) {
        const int r = 4 * g;
        const int8_t* w0 = m.w + (size_t)r * in;
        prefetch_ahead(w0, 4 * (size_t)in, m.w + (size_t)out * in);
        const int8_t *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        for (int i = 0; i < rows; ++i) {
            const float* x = X + (size_t)i * in;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int t = 0; t < in; ++t) {
                const float xt = x[t];
                a0 += (float)w0[t] * xt;
                a1 += (float)w1[t] * xt;
                a2 += (float)w2[t] * xt;
                a3 += (float)w3[t] * xt;
            }
            float* y = Y + (size_t)i * out;
            y[r] = a0 * m.scale[r];
            y[r + 1] = a1 * m.scale[r + 1];
            y[r + 2] = a2 * m.scale[r + 2];
            y[r + 3] = a3 * m.scale[r + 3];
        }
    }
    for (int r = 4 * groups; r < out; ++r) {
        const int8_t* w = m.w + (size_t)r * in;
        for (int i = 0; i < rows; ++i) {
            const float* x = X + (size_t)i * in;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int t = 0; t < in; ++t) a += (float)w[t] * x[t];
            Y[(size_t)i * out + r] = a * m.scale[r];
        }
    }
}

#if defined(__AVX2__)
// The sum of a vector's eight int32 lanes (the AVX2 kernels' final reduction).
inline int32_t hsum_epi32(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    return _mm_cvtsi128_si32(s);
}
#endif

// The int32 dot product of one int8 weight row with the quantized activation: q (signed, |q| <= 127) and
// u = q + 128 (unsigned, for vpdpbusd, whose u8 x s8 products are corrected by 128 x the row's weight sum).
// One kernel per instruction set, picked at compile time by -march (native.py builds the host's).
inline int32_t dot_i8(const int8_t* w, const int8_t* q, const uint8_t* u, int32_t wsum, int n) {
    int i = 0;
    int32_t acc = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a = _mm512_setzero_si512();
    for (; i + 64 <= n; i += 64)
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(u + i), _mm512_loadu_si512(w + i));
    acc = _mm512_reduce_add_epi32(a) - 128 * wsum;
    for (; i < n; ++i) acc += (int32_t)u[i] * w[i];  // tail, still offset (wsum covers the whole row)
    return acc;
#elif defined(__AVX2__)
    (void)u; (void)wsum;
    __m256i a = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (; i + 32 <= n; i += 32) {  // |q| x (w with q's sign): u8 x s8 pairs of at most 2 x 127 x 127, no saturation
        const __m256i qv = _mm256_loadu_si256((const __m256i*)(q + i));
        const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + i));
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(wv, qv));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(p, ones));
    }
    acc = hsum_epi32(a);
#else
    (void)u; (void)wsum;
#endif
    for (; i < n; ++i) acc += (int32_t)q[i] * w[i];
    return acc;
}

struct QAct {
    std::vector<int8_t> q;
    std::vector<uint8_t> u;
    float scale = 1.f;
};

// x (times the inverse smoothing scale) -> symmetric int8 with one scale for the row.
void quantize_row(const QMat& m, const float* x, QAct& a, std::vector<float>& tmp) {
    const int n = m.in;
    a.q.resize(n); a.u.resize(n); tmp.resize(n);
    float mx = 0.f;
    for (int i = 0; i < n; ++i) {
        const float v = m.inv_smooth ? x[i] * m.inv_smooth[i] : x[i];
        tmp[i] = v;
        mx = std::fmax(mx, std::fabs(v));
    }
    a.scale = mx > 0.f ? mx / 127.f : 1.f;
    const float inv = 1.f / a.scale;
    for (int i = 0; i < n; ++i) {
        const int v = (int)std::lrint(tmp[i] * inv);
        a.q[i] = (int8_t)v;
        a.u[i] = (uint8_t)(v + 128);
    }
}

// The int32 dot product of one packed int4 row with a quantized activation row q, both padded to whole blocks
// of 64 inputs (the padding: weight 0, activation 0).  Block b of a row is 32 bytes: byte i holds weight
// 64b+i in its low nibble and weight 64b+32+i in its high one, each stored as w + 8 (0..15), so the unsigned
// x signed dot products give sum (w + 8) q, which the caller corrects by 8 x sum q.  Unpacking a block takes
// a shift and two ands; the loads halve.
inline int32_t dot_q4(const uint8_t* w, const int8_t* q, int blocks) {
    int32_t acc = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m512i a = _mm512_setzero_si512();
    for (int b = 0; b < blocks; ++b) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * b));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        a = _mm512_dpbusd_epi32(a, wv, _mm512_loadu_si512(q + 64 * b));
    }
    acc = _mm512_reduce_add_epi32(a);
#elif defined(__AVX2__)
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i a = _mm256_setzero_si256();
    for (int b = 0; b < blocks; ++b) {  // u8 <= 15 x s8 pairs: at most 2 x 2 x 15 x 127 per int16 lane, no saturation
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 32 * b));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(q + 64 * b))),
                                           _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 64 * b + 32))));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(p, ones));
    }
    acc = hsum_epi32(a);
#else
    for (int b = 0; b < blocks; ++b)
        for (int i = 0; i < 32; ++i) {
            const int byte = w[32 * b + i];
            acc += (byte & 15) * q[64 * b + i] + (byte >> 4) * q[64 * b + 32 + i];
        }
#endif
    return acc;
}

// Y = W X for an int4 matrix (bits 4): each activation row quantized as for int8, padded with zeros.
void matmul_q4(const QMat& m, const float* X, int rows, float* Y, int nt, std::vector<float>& tmp) {
    const int blocks = (m.in + 63) / 64;
    thread_local std::vector<QAct> acts;
    thread_local std::vector<int32_t> qsum;
    if ((int)acts.size() < rows) acts.resize(rows);
    qsum.resize(rows);
    for (int i = 0; i < rows; ++i) {
        quantize_row(m, X + (size_t)i * m.in, acts[i], tmp);
        acts[i].q.resize((size_t)blocks * 64, 0);  // quantize_row sized it to m.in: the padding is zeros
        int32_t sum = 0;
        for (int t = 0; t < m.in; ++t) sum += acts[i].q[t];
        qsum[i] = sum;
    }
    const QAct* A = acts.data();
    const int32_t* QS = qsum.data();
    const uint8_t* W = (const uint8_t*)m.w;
    const size_t stride = (size_t)blocks * 32;
    const uint8_t* end = W + stride * m.out;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int r = 0; r < m.out; ++r) {
        const uint8_t* w = W + (size_t)r * stride;
        prefetch_ahead(w, stride, end);
        for (int i = 0; i < rows; ++i)
            Y[(size_t)i * m.out + r] = (float)(dot_q4(w, A[i].q.data(), blocks) - 8 * QS[i]) * A[i].scale * m.scale[r];
    }
}

void matmul(const QMat& m, const float* X, int rows, float* Y, int nt) {
    thread_local std::vector<float> tmp;
    if (m.bits == 4) {
        matmul_q4(m, X, rows, Y, nt, tmp);
    } else if (!m.act_q) {
        if (m.inv_smooth) {  // a fixed per-channel input scale (the taps' tap_scale), applied to the float rows
            thread_local std::vector<float> xs;
            xs.resize((size_t)rows * m.in);
            for (int i = 0; i < rows; ++i)
                for (int t = 0; t < m.in; ++t) xs[(size_t)i * m.in + t] = X[(size_t)i * m.in + t] * m.inv_smooth[t];
            X = xs.data();
        }
        matmul_float(m, X, rows, Y, nt);
    } else {
        thread_local std::vector<QAct> acts;
        if ((int)acts.size() < rows) acts.resize(rows);
        for (int i = 0; i < rows; ++i) quantize_row(m, X + (size_t)i * m.in, acts[i], tmp);
        const QAct* A = acts.data();
        const int8_t* end = m.w + (size_t)m.out * m.in;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int r = 0; r < m.out; ++r) {
            const int8_t* w = m.w + (size_t)r * m.in;
            prefetch_ahead(w, m.in, end);
            for (int i = 0; i < rows; ++i)
                Y[(size_t)i * m.out + r] =
                    (float)dot_i8(w, A[i].q.data(), A[i].u.data(), m.wsum[r], m.in) * A[i].scale * m.scale[r];
        }
    }
    if (m.bias)
        for (int i = 0; i < rows; ++i)
            for (int r = 0; r < m.out; ++r) Y[(size_t)i * m.out + r] += m.bias[r];
}

void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / n + eps);
    for (int i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }
inline float silu(float z) { return z * sigmoid(z); }
inline float log_sigmoid(float z) { return std::fmin(z, 0.f) - std::log1p(std::exp(-std::fabs(z))); }

struct Scratch {  // per-row buffers, [rows, width] each
    std::vector<float> g, x, xn, e, h1, h2, cat, z, qkv, att, tmp, gu, act, feat, scores, logits, bias;
};

// Attention of ``rows`` query rows at cells p0.. over their cells 0..p0+i of one block, every head (GQA groups of
// heads share a kv head).  The bias of a cell: log s_j (the importance gate) + the holes, with the denoising mask
// of the last row's length for every row, as the torch forward of several rows (DraftRunner._bias).
//
// ``visible`` [rows, p0 + rows] (a tree level's nodes, DraftRunner._forward_nodes): row i attends to the cells it
// marks, instead of 0..p0+i.
void attend(const Model& M, const Block& B, const float* QKV, int rows, int p0, float* out, Scratch& S, int nt,
            const uint8_t* visible = nullptr) {
    const int hd = M.head_dim, nh = M.n_heads, nkv = M.n_kv, per = nh / nkv, width = (nh + 2 * nkv) * hd;
    const float scale = 1.0f / std::sqrt((float)hd);
    const int L = p0 + rows;
    S.scores.resize((size_t)rows * nh * L);
    S.bias.resize(L);
    const bool gated = B.importance_w != nullptr;
    const int old = (gated && M.has_threshold && L > M.recent_window) ? L - M.recent_window : 0;
    for (int j = 0; j < L; ++j) {
        float b = (gated ? B.log_gate[j] : 0.f) + M.holes[j];
        if (j < old && b < M.log_threshold) b = -INFINITY;
        S.bias[j] = b;
    }
    const float* bias = S.bias.data();
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int ih = 0; ih < rows * nh; ++ih) {
        const int i = ih / nh, h = ih % nh, Li = visible ? L : p0 + i + 1;
        const uint8_t* vis = visible ? visible + (size_t)i * L : nullptr;
        const float* q = QKV + (size_t)i * width + (size_t)h * hd;
        const int kvh = h / per;
        const float* K = B.k_cache + (size_t)kvh * M.max_pos * hd;
        const float* V = B.v_cache + (size_t)kvh * M.max_pos * hd;
        float* s = S.scores.data() + (size_t)ih * L;
        float mx = -INFINITY;
        for (int j = 0; j < Li; ++j) {
            const float* kj = K + (size_t)j * hd;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int t = 0; t < hd; ++t) d += q[t] * kj[t];
            s[j] = (vis && !vis[j]) ? -INFINITY : d * scale + bias[j];
            mx = std::fmax(mx, s[j]);
        }
        float sum = 0.f;
        for (int j = 0; j < Li; ++j) {
            s[j] = (s[j] == -INFINITY) ? 0.f : std::exp(s[j] - mx);
            sum += s[j];
        }
        float* o = out + (size_t)i * nh * hd + (size_t)h * hd;
        for (int t = 0; t < hd; ++t) o[t] = 0.f;
        for (int j = 0; j < Li; ++j) {
            const float p = s[j] / sum;
            if (p == 0.f) continue;
            const float* vj = V + (size_t)j * hd;
#pragma omp simd
            for (int t = 0; t < hd; ++t) o[t] += p * vj[t];
        }
    }
}

// ``rows`` positions p0..: their g [rows, feature] and tokens -> the last row's x (pre-norm, S.x) and feature
// (S.feat); writes their cells.  A tree level (``pos`` and ``visible`` given): row i sits at RoPE position pos[i]
// in cell p0+i and attends to the cells ``visible`` marks; every row's x stays in S.x [rows, hidden], and the
// caller computes their features.
void step_rows(const Model& M, Scratch& S, const float* G, const int64_t* tokens, int rows, int p0, int nt,
               const int32_t* pos = nullptr, const uint8_t* visible = nullptr) {
    const int H = M.hidden, D = M.n_embd, hd = M.head_dim, half = hd / 2, F = M.ffn;
    const int nq = M.n_heads + M.n_kv, width = (M.n_heads + 2 * M.n_kv) * hd;
    const size_t R = rows;
    S.x.resize(R * H); S.xn.resize(R * (H > D ? H : D)); S.e.resize(R * D); S.h1.resize(R * H); S.h2.resize(R * H);
    S.cat.resize(R * (2 * (H > D ? H : D) + M.w1.in)); S.z.resize(R * H); S.qkv.resize(R * width);
    S.att.resize(R * M.n_heads * hd); S.tmp.resize(R * H); S.gu.resize(R * 2 * F); S.act.resize(R * F);
    S.feat.resize(D);
    float* X = S.x.data();
    if (M.fusion == 0) {
        matmul(M.w1, G, rows, S.h1.data(), nt);
        for (int i = 0; i < rows; ++i) rms_norm(M.embed + (size_t)tokens[i] * D, M.emb_norm, S.e.data() + i * D, D, M.eps);
        matmul(M.w2, S.e.data(), rows, S.h2.data(), nt);
        for (size_t t = 0; t < R * H; ++t) S.h2[t] = silu(S.h2[t]);
        for (int i = 0; i < rows; ++i) {
            std::memcpy(S.cat.data() + (size_t)i * 2 * H, S.h1.data() + (size_t)i * H, H * sizeof(float));
            std::memcpy(S.cat.data() + (size_t)i * 2 * H + H, S.h2.data() + (size_t)i * H, H * sizeof(float));
        }
        matmul(M.wz, S.cat.data(), rows, S.z.data(), nt);
        for (size_t t = 0; t < R * H; ++t) X[t] = S.h2[t] + sigmoid(S.z[t]) * (S.h1[t] - S.h2[t]);
    } else {  // fc([e; g]) + b
        const int gin = M.w1.in - D;
        for (int i = 0; i < rows; ++i) {
            std::memcpy(S.cat.data() + (size_t)i * M.w1.in, M.embed + (size_t)tokens[i] * D, D * sizeof(float));
            std::memcpy(S.cat.data() + (size_t)i * M.w1.in + D, G + (size_t)i * gin, gin * sizeof(float));
        }
        matmul(M.w1, S.cat.data(), rows, X, nt);
    }
    for (int i = 0; i < rows; ++i) M.holes[p0 + i] = 0.f;  // these cells get real states now
    for (int b = 0; b < M.n_blocks; ++b) {
        const Block& B = M.blocks[b];
        const float* XN = X;
        if (B.attn_norm) {
            for (int i = 0; i < rows; ++i) rms_norm(X + (size_t)i * H, B.attn_norm, S.xn.data() + (size_t)i * H, H, M.eps);
            XN = S.xn.data();
        }
        matmul(B.qkv, XN, rows, S.qkv.data(), nt);
        for (int i = 0; i < rows; ++i) {
            const int p = p0 + i, rp = pos ? pos[i] : p;
            float* qkv = S.qkv.data() + (size_t)i * width;
            const float* cos = M.rope_cos + (size_t)rp * hd;
            const float* sin = M.rope_sin + (size_t)rp * hd;
            for (int h = 0; h < nq; ++h) {  // RoPE (rotate-half) on q and k
                float* v = qkv + (size_t)h * hd;
                for (int t = 0; t < half; ++t) {
                    const float a = v[t], c = v[t + half];
                    v[t] = a * cos[t] - c * sin[t];
                    v[t + half] = c * cos[t + half] + a * sin[t + half];
                }
            }
            for (int h = 0; h < M.n_kv; ++h) {
                std::memcpy(B.k_cache + ((size_t)h * M.max_pos + p) * hd, qkv + (size_t)(M.n_heads + h) * hd,
                            hd * sizeof(float));
                std::memcpy(B.v_cache + ((size_t)h * M.max_pos + p) * hd, qkv + (size_t)(nq + h) * hd, hd * sizeof(float));
            }
            if (B.importance_w) {
                const float* xn = XN + (size_t)i * H;
                float z = B.importance_b;
                for (int t = 0; t < H; ++t) z += B.importance_w[t] * xn[t];
                B.log_gate[p] = log_sigmoid(z);
            }
        }
        attend(M, B, S.qkv.data(), rows, p0, S.att.data(), S, nt, visible);
        matmul(B.o, S.att.data(), rows, S.tmp.data(), nt);
        for (size_t t = 0; t < R * H; ++t) X[t] += S.tmp[t];
        for (int i = 0; i < rows; ++i) rms_norm(X + (size_t)i * H, B.ffn_norm, S.xn.data() + (size_t)i * H, H, M.eps);
        matmul(B.gate_up, S.xn.data(), rows, S.gu.data(), nt);
        for (int i = 0; i < rows; ++i) {
            const float* gu = S.gu.data() + (size_t)i * 2 * F;
            float* act = S.act.data() + (size_t)i * F;
            for (int t = 0; t < F; ++t) act[t] = silu(gu[t]) * gu[F + t];
        }
        matmul(B.down, S.act.data(), rows, S.tmp.data(), nt);
        for (size_t t = 0; t < R * H; ++t) X[t] += S.tmp[t];
    }
    if (visible) return;
    if (rows > 1) std::memmove(X, X + (R - 1) * H, H * sizeof(float));  // the last row's x leads (S.x[0..H))
    const float* f = X;
    if (M.final_norm) {
        rms_norm(X, M.final_norm, S.xn.data(), H, M.eps);
        f = S.xn.data();
    }
    if (M.out_proj.w) {
        matmul(M.out_proj, f, 1, S.feat.data(), nt);
    } else {
        std::memcpy(S.feat.data(), f, D * sizeof(float));
    }
}

// The target's real rows G [rows, input] (its taps, through the taps' fc, or its features) at cells p0..: as
// ``step_rows``, whose g they become.
void read_rows(const Model& M, Scratch& S, const float* G, const int64_t* tokens, int rows, int p0, int nt) {
    if (M.tap.w) {
        S.g.resize((size_t)rows * M.tap.out);
        matmul(M.tap, G, rows, S.g.data(), nt);
        G = S.g.data();
    }
    step_rows(M, S, G, tokens, rows, p0, nt);
}

inline float dot(const float* a, const float* b, int n) {
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int i = 0; i < n; ++i) d += a[i] * b[i];
    return d;
}

// The R largest of a row's n logits, sorted descending (of equal ones the lower row first): rows in top, logits in
// val; returns how many (R, or n where fewer).
int top_rows(const float* lg, int n_rows, int R, int* top, float* val) {
    int n = 0;
    for (int r = 0; r < n_rows; ++r) {
        const float v = lg[r];
        if (n == R && v <= val[R - 1]) continue;
        int i = (n < R) ? n++ : R - 1;
        while (i > 0 && val[i - 1] < v) {
            val[i] = val[i - 1];
            top[i] = top[i - 1];
            --i;
        }
        val[i] = v;
        top[i] = r;
    }
    return n;
}

// The target id of the feature's best row: the int8 head's best ``rescore`` rows rescored in float, then the
// rows added for tokens of the text (extra [n_extra, n_embd] float32), which win only when strictly higher.
// With ``p_min`` > 0, ``*p_best`` is the best row's softmax probability over every row (the int8 logits
// outside the rescored best): llama.cpp's draft-p-min stops a chain below it.
int64_t best_token(const Model& M, Scratch& S, const float* feat, const float* extra, int n_extra, const int64_t* d2t,
                   int nt, float p_min, float* p_best) {
    const int D = M.n_embd;
    float* lg = S.logits.data();
    matmul(M.head, feat, 1, lg, nt);
    int top[64];
    float val[64];
    const int n = top_rows(lg, M.head.out, M.rescore, top, val);
    int best = -1;
    float score = -INFINITY;
    for (int i = 0; i < n; ++i) {
        const float s = dot(M.head_f32 + (size_t)top[i] * D, feat, D);
        if (s > score || (s == score && top[i] < best)) {
            score = s;
            best = top[i];
        }
    }
    int row = best;
    float extra_best = -INFINITY;
    int extra_row = -1;
    S.scores.resize(n_extra > 0 ? n_extra : 1);
    for (int j = 0; j < n_extra; ++j) {
        const float s = dot(extra + (size_t)j * D, feat, D);
        S.scores[j] = s;
        if (s > extra_best) {
            extra_best = s;
            extra_row = j;
        }
    }
    if (extra_row >= 0 && extra_best > score) {
        row = M.head.out + extra_row;
        score = extra_best;
    }
    if (p_min > 0.f) {
        const float m = std::fmax(score, val[0]);
        float sum = 0.f;
        const int n_head = M.head.out;
#pragma omp simd reduction(+ : sum)
        for (int r = 0; r < n_head; ++r) sum += std::exp(lg[r] - m);
        for (int j = 0; j < n_extra; ++j) sum += std::exp(S.scores[j] - m);
        *p_best = std::exp(score - m) / sum;
    }
    return d2t[row];
}

}  // namespace

extern "C" {

// Up to k greedy proposals (``*n_out`` of them: fewer where the best row's probability falls below ``p_min``).
// With ``rows`` > 0, positions p0.. are first computed from the target's real rows G [rows, input] (its taps,
// through the taps' fc, or its features) and their next tokens; with 0, x0 [hidden] (pre-norm) and feat0
// [n_embd] are the state of the position before p0, computed already.  Writes cells p0..; returns how many
// (the caller advances its count), the target ids in ``out``.
int32_t draft_chain(const Model* M, const float* G, int32_t rows, const int64_t* tokens, const float* x0,
                    const float* feat0, int32_t p0, int32_t k, const float* extra, int32_t n_extra, const int64_t* d2t,
                    int32_t threads, float p_min, int64_t* out, int32_t* n_out) {
    thread_local Scratch S;
    const int H = M->hidden, D = M->n_embd;
    if (p0 + rows + k - 1 > M->max_pos) return -1;
    S.logits.resize(M->head.out);
    int p = p0, written = 0;
    if (rows > 0) {
        read_rows(*M, S, G, tokens, rows, p, threads);
        p += rows;
        written += rows;
    } else {
        S.x.resize(H);
        S.feat.resize(D);
        std::memcpy(S.x.data(), x0, H * sizeof(float));
        std::memcpy(S.feat.data(), feat0, D * sizeof(float));
    }
    std::vector<float> g_next(H > D ? H : D);
    *n_out = 0;
    for (int j = 0; j < k; ++j) {
        float prob = 1.f;
        const int64_t tok = best_token(*M, S, S.feat.data(), extra, n_extra, d2t, threads, p_min, &prob);
        if (prob < p_min) break;  // the chain stops where the draft is unsure (a tree round's p-min)
        out[j] = tok;
        *n_out = j + 1;
        if (j + 1 == k) break;
        const float* src = M->drafted_is_prenorm ? S.x.data() : S.feat.data();
        std::memcpy(g_next.data(), src, (M->drafted_is_prenorm ? H : D) * sizeof(float));
        step_rows(*M, S, g_next.data(), &tok, 1, p++, threads);
        ++written;
    }
    return written;
}

// The target's real rows G [rows, input] (its taps, or its features) and their next tokens read into cells p0..:
// the state of the last one, x_out [hidden] (pre-norm) and feat_out [n_embd].  A greedy tree round's root, read
// as ``draft_chain`` reads a chain's; its levels follow through ``draft_nodes`` (DraftRunner.propose_tree).
// Returns the cells written, or -1 where they do not fit.
int32_t draft_rows(const Model* M, const float* G, int32_t rows, const int64_t* tokens, int32_t p0, int32_t threads,
                   float* x_out, float* feat_out) {
    thread_local Scratch S;
    if (rows < 1 || p0 + rows > M->max_pos) return -1;
    read_rows(*M, S, G, tokens, rows, p0, threads);
    std::memcpy(x_out, S.x.data(), M->hidden * sizeof(float));
    std::memcpy(feat_out, S.feat.data(), M->n_embd * sizeof(float));
    return rows;
}

// One level of a greedy tree (DraftRunner._forward_nodes): its nodes' g [rows, feature] (what their parents'
// states give a child) and tokens, at RoPE positions pos [rows], in cells p0.., each attending to the cells
// visible [rows, p0 + rows] marks (the real ones, its ancestors' and its own).  Writes their cells; x_out
// [rows, hidden] (pre-norm) and feat_out [rows, n_embd] get every node's state.  Returns the cells written, or -1
// where they do not fit.
int32_t draft_nodes(const Model* M, const float* G, int32_t rows, const int64_t* tokens, int32_t p0, const int32_t* pos,
                    const uint8_t* visible, int32_t threads, float* x_out, float* feat_out) {
    thread_local Scratch S;
    const int H = M->hidden, D = M->n_embd;
    if (rows < 1 || p0 + rows > M->max_pos) return -1;
    for (int i = 0; i < rows; ++i)
        if (pos[i] < 0 || pos[i] >= M->max_pos) return -1;
    step_rows(*M, S, G, tokens, rows, p0, threads, pos, visible);
    std::memcpy(x_out, S.x.data(), (size_t)rows * H * sizeof(float));
    const float* f = S.x.data();
    if (M->final_norm) {
        for (int i = 0; i < rows; ++i)
            rms_norm(S.x.data() + (size_t)i * H, M->final_norm, S.xn.data() + (size_t)i * H, H, M->eps);
        f = S.xn.data();
    }
    if (M->out_proj.w) {
        matmul(M->out_proj, f, rows, feat_out, threads);
    } else {
        std::memcpy(feat_out, f, (size_t)rows * D * sizeof(float));
    }
    return rows;
}

// A greedy tree level's ranking (DraftRunner.propose_tree): for each of ``rows`` features feat [rows, n_embd], its
// ``k`` best rows over the head and the added rows extra [n_extra, n_embd] (numbered from the head's row count on,
// as best_token numbers them), best first, in out_rows [rows, k], and their softmax probabilities over every row
// in out_probs [rows, k].  The head's best ``rescore`` rows are rescored in float, as best_token does, so the
// first is the chain's token; every other row enters the normaliser with its quantized logit.  Returns how many
// per row (k, or fewer where the head and the added rows hold fewer candidates), or -1 where k exceeds the
// rescored rows' buffer.
int32_t head_topk(const Model* M, const float* feat, int32_t rows, const float* extra, int32_t n_extra, int32_t k,
                  int32_t threads, int32_t* out_rows, float* out_probs) {
    thread_local Scratch S;
    const int D = M->n_embd, NH = M->head.out;
    if (k < 1 || k > 64) return -1;
    S.logits.resize((size_t)rows * NH);
    matmul(M->head, feat, rows, S.logits.data(), threads);
    std::vector<std::pair<float, int>> cand;
    int kk = 0;
    for (int r = 0; r < rows; ++r) {
        const float* lg = S.logits.data() + (size_t)r * NH;
        const float* f = feat + (size_t)r * D;
        int top[64];
        float val[64];
        const int n = top_rows(lg, NH, M->rescore, top, val);
        cand.clear();
        float m = n > 0 ? val[0] : -INFINITY;
        for (int i = 0; i < n; ++i) {
            const float s = dot(M->head_f32 + (size_t)top[i] * D, f, D);
            cand.emplace_back(s, top[i]);
            m = std::fmax(m, s);
        }
        for (int j = 0; j < n_extra; ++j) {
            const float s = dot(extra + (size_t)j * D, f, D);
            cand.emplace_back(s, NH + j);
            m = std::fmax(m, s);
        }
        float head_sum = 0.f;  // every head row's quantized logit, the rescored ones' replaced by their float scores
#pragma omp simd reduction(+ : head_sum)
        for (int q = 0; q < NH; ++q) head_sum += std::exp(lg[q] - m);
        double sum = head_sum;
        for (int i = 0; i < n; ++i) sum -= std::exp((double)val[i] - m);
        for (const auto& c : cand) sum += std::exp((double)c.first - m);
        kk = std::min<int>(k, (int)cand.size());
        std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), [](const auto& a, const auto& b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (int i = 0; i < kk; ++i) {
            out_rows[(size_t)r * k + i] = cand[i].second;
            out_probs[(size_t)r * k + i] = (float)(std::exp((double)cand[i].first - m) / sum);
        }
    }
    return kk;
}

// The head's logits (before rescoring) of one feature: how the tests check the int4 and int8 kernels' arithmetic.
void head_logits(const Model* M, const float* feat, float* out, int32_t threads) {
    matmul(M->head, feat, 1, out, threads);
}

// The integer dot-product kernel this build took (the tests check each -march they build gets its own).
const char* kernel_name() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
