// The draft's greedy chain on the CPU in one native call: k draft steps, each the fusion, the blocks,
// the final norm and the head's argmax, with no Python or torch dispatch between them.
//
// WHY: a torch draft step is about 250 small kernel calls (2-4 us of dispatch each) around 9 matrix-vector
// products, so on a 2-core CPU the calls, not the 9 MB of weights, set its 1.5-2 ms.  Here every matrix is
// int8 with one float scale per output row and is multiplied by the float activation row as it is (no
// activation quantization, so the target features' outlier channels cost nothing); the loops are plain
// C++ vectorized by the compiler for the CPU it is built on (-march, see native.py), and rows are split
// across OpenMP threads.  The arithmetic is DraftRunner._forward_one's and RescoredInt8Head.best's; only
// the rounding differs (int8 weights), and the head's best rows are rescored exactly in float as there.
//
// Built by hetero_spec/draft/native.py with: g++ -O3 -march=<native|x86-64-v3|...> -fopenmp -shared -fPIC
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

namespace {

struct QMat {            // y = (W x) * scale + bias, W [out, in] int8 row-major
    const int8_t* w;
    const float* scale;   // [out]
    const float* bias;    // [out] or null
    const int32_t* wsum;  // [out] the sum of each row's int8 weights (the VNNI kernel's unsigned-offset correction)
    const float* inv_smooth;  // [in] or null: x times this first (SmoothQuant's 1/s, W holding W diag(s); or tap_scale)
    int32_t out, in;
    int32_t act_q;        // 1: the activation row is quantized to int8 too (integer dot products), 0: stays float
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
    QMat head;                // [n_head, n_embd] int8
    const float* head_f32;    // [n_head, n_embd]: the rows rescored exactly
    int32_t rescore;
    const Block* blocks;
    float* holes;             // [max_pos]
};

}  // extern "C"

namespace {

// float activation x int8 weight: the fusion's path (its inputs carry outlier channels a row of 255
// levels cannot hold).  Four rows share each load of x.
void gemv_float(const QMat& m, const float* x, float* y, int nt) {
    const int in = m.in, groups = m.out / 4;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int g = 0; g < groups; ++g) {
        const int r = 4 * g;
        const int8_t* w0 = m.w + (size_t)r * in;
        const int8_t *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int i = 0; i < in; ++i) {
            const float xi = x[i];
            a0 += (float)w0[i] * xi;
            a1 += (float)w1[i] * xi;
            a2 += (float)w2[i] * xi;
            a3 += (float)w3[i] * xi;
        }
        y[r] = a0 * m.scale[r];
        y[r + 1] = a1 * m.scale[r + 1];
        y[r + 2] = a2 * m.scale[r + 2];
        y[r + 3] = a3 * m.scale[r + 3];
    }
    for (int r = 4 * groups; r < m.out; ++r) {
        const int8_t* w = m.w + (size_t)r * in;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int i = 0; i < in; ++i) a += (float)w[i] * x[i];
        y[r] = a * m.scale[r];
    }
}

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
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    acc = _mm_cvtsi128_si32(s);
#else
    (void)u; (void)wsum;
#endif
    for (; i < n; ++i) acc += (int32_t)q[i] * w[i];
    return acc;
}

struct QAct {
    std::vector<int8_t> q;
    std::vector<uint8_t> u;
    std::vector<float> tmp;
    float scale = 1.f;
};

// x (divided by the smoothing scale) -> symmetric int8 with one scale for the row.
void quantize_row(const QMat& m, const float* x, QAct& a) {
    const int n = m.in;
    a.q.resize(n); a.u.resize(n); a.tmp.resize(n);
    float mx = 0.f;
    for (int i = 0; i < n; ++i) {
        const float v = m.inv_smooth ? x[i] * m.inv_smooth[i] : x[i];
        a.tmp[i] = v;
        mx = std::fmax(mx, std::fabs(v));
    }
    a.scale = mx > 0.f ? mx / 127.f : 1.f;
    const float inv = 1.f / a.scale;
    for (int i = 0; i < n; ++i) {
        const int v = (int)std::lrint(a.tmp[i] * inv);
        a.q[i] = (int8_t)v;
        a.u[i] = (uint8_t)(v + 128);
    }
}

void gemv(const QMat& m, const float* x, float* y, int nt) {
    if (!m.act_q) {
        if (m.inv_smooth) {  // a fixed per-channel input scale (the taps' tap_scale), applied to the float row
            thread_local std::vector<float> xs;
            xs.resize(m.in);
            for (int i = 0; i < m.in; ++i) xs[i] = x[i] * m.inv_smooth[i];
            x = xs.data();
        }
        gemv_float(m, x, y, nt);
    } else {
        thread_local QAct a;
        quantize_row(m, x, a);
        const int8_t* q = a.q.data();
        const uint8_t* u = a.u.data();
        const float xs = a.scale;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int r = 0; r < m.out; ++r)
            y[r] = (float)dot_i8(m.w + (size_t)r * m.in, q, u, m.wsum[r], m.in) * xs * m.scale[r];
    }
    if (m.bias)
        for (int r = 0; r < m.out; ++r) y[r] += m.bias[r];
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

struct Scratch {
    std::vector<float> g, x, xn, e, h1, h2, cat, z, qkv, att, tmp, gu, act, feat, scores, logits;
};

// Attention of one query row over cells 0..L-1 of one block, every head; GQA groups of heads share a kv head.
void attend(const Model& M, const Block& B, const float* qkv, int L, float* out, std::vector<float>& scores, int nt) {
    const int hd = M.head_dim, nh = M.n_heads, nkv = M.n_kv, per = nh / nkv;
    const float scale = 1.0f / std::sqrt((float)hd);
    scores.resize((size_t)nh * L);
    // the additive bias of each cell: log s_j (the importance gate) + the holes, with the denoising mask
    std::vector<float> bias(L);
    const bool gated = B.importance_w != nullptr;
    const int old = (gated && M.has_threshold && L > M.recent_window) ? L - M.recent_window : 0;
    for (int j = 0; j < L; ++j) {
        float b = (gated ? B.log_gate[j] : 0.f) + M.holes[j];
        if (j < old && b < M.log_threshold) b = -INFINITY;
        bias[j] = b;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int h = 0; h < nh; ++h) {
        const float* q = qkv + (size_t)h * hd;
        const int kvh = h / per;
        const float* K = B.k_cache + (size_t)kvh * M.max_pos * hd;
        const float* V = B.v_cache + (size_t)kvh * M.max_pos * hd;
        float* s = scores.data() + (size_t)h * L;
        float mx = -INFINITY;
        for (int j = 0; j < L; ++j) {
            const float* kj = K + (size_t)j * hd;
            float d = 0.f;
#pragma omp simd reduction(+ : d)
            for (int t = 0; t < hd; ++t) d += q[t] * kj[t];
            s[j] = d * scale + bias[j];
            mx = std::fmax(mx, s[j]);
        }
        float sum = 0.f;
        for (int j = 0; j < L; ++j) {
            s[j] = (s[j] == -INFINITY) ? 0.f : std::exp(s[j] - mx);
            sum += s[j];
        }
        float* o = out + (size_t)h * hd;
        for (int t = 0; t < hd; ++t) o[t] = 0.f;
        for (int j = 0; j < L; ++j) {
            const float p = s[j] / sum;
            if (p == 0.f) continue;
            const float* vj = V + (size_t)j * hd;
#pragma omp simd
            for (int t = 0; t < hd; ++t) o[t] += p * vj[t];
        }
    }
}

// One position p: g [feature] and token -> x (pre-norm) and feat (the predicted feature); writes cell p.
void step(const Model& M, Scratch& S, const float* g, int64_t token, int p, int nt) {
    const int H = M.hidden, D = M.n_embd, hd = M.head_dim, half = hd / 2;
    const float* e = M.embed + (size_t)token * D;
    float* x = S.x.data();
    if (M.fusion == 0) {
        gemv(M.w1, g, S.h1.data(), nt);
        rms_norm(e, M.emb_norm, S.e.data(), D, M.eps);
        gemv(M.w2, S.e.data(), S.h2.data(), nt);
        for (int i = 0; i < H; ++i) S.h2[i] = silu(S.h2[i]);
        std::memcpy(S.cat.data(), S.h1.data(), H * sizeof(float));
        std::memcpy(S.cat.data() + H, S.h2.data(), H * sizeof(float));
        gemv(M.wz, S.cat.data(), S.z.data(), nt);
        for (int i = 0; i < H; ++i) x[i] = S.h2[i] + sigmoid(S.z[i]) * (S.h1[i] - S.h2[i]);
    } else {
        std::memcpy(S.cat.data(), e, D * sizeof(float));
        std::memcpy(S.cat.data() + D, g, M.w1.in - D > 0 ? (M.w1.in - D) * sizeof(float) : 0);
        gemv(M.w1, S.cat.data(), x, nt);
    }
    M.holes[p] = 0.f;  // this cell gets real states now
    const float* cos = M.rope_cos + (size_t)p * hd;
    const float* sin = M.rope_sin + (size_t)p * hd;
    const int L = p + 1;
    for (int b = 0; b < M.n_blocks; ++b) {
        const Block& B = M.blocks[b];
        const float* xn = x;
        if (B.attn_norm) {
            rms_norm(x, B.attn_norm, S.xn.data(), H, M.eps);
            xn = S.xn.data();
        }
        float* qkv = S.qkv.data();
        gemv(B.qkv, xn, qkv, nt);
        for (int h = 0; h < M.n_heads + M.n_kv; ++h) {  // RoPE (rotate-half) on q and k
            float* v = qkv + (size_t)h * hd;
            for (int t = 0; t < half; ++t) {
                const float a = v[t], c = v[t + half];
                v[t] = a * cos[t] - c * sin[t];
                v[t + half] = c * cos[t + half] + a * sin[t + half];
            }
        }
        for (int h = 0; h < M.n_kv; ++h) {
            std::memcpy(B.k_cache + ((size_t)h * M.max_pos + p) * hd, qkv + (size_t)(M.n_heads + h) * hd, hd * sizeof(float));
            std::memcpy(B.v_cache + ((size_t)h * M.max_pos + p) * hd, qkv + (size_t)(M.n_heads + M.n_kv + h) * hd,
                        hd * sizeof(float));
        }
        if (B.importance_w) {
            float z = B.importance_b;
            for (int i = 0; i < H; ++i) z += B.importance_w[i] * xn[i];
            B.log_gate[p] = log_sigmoid(z);
        }
        attend(M, B, qkv, L, S.att.data(), S.scores, nt);
        gemv(B.o, S.att.data(), S.tmp.data(), nt);
        for (int i = 0; i < H; ++i) x[i] += S.tmp[i];
        rms_norm(x, B.ffn_norm, S.xn.data(), H, M.eps);
        gemv(B.gate_up, S.xn.data(), S.gu.data(), nt);
        for (int i = 0; i < M.ffn; ++i) S.act[i] = silu(S.gu[i]) * S.gu[M.ffn + i];
        gemv(B.down, S.act.data(), S.tmp.data(), nt);
        for (int i = 0; i < H; ++i) x[i] += S.tmp[i];
    }
    const float* f = x;
    if (M.final_norm) {
        rms_norm(x, M.final_norm, S.xn.data(), H, M.eps);
        f = S.xn.data();
    }
    if (M.out_proj.w) {
        gemv(M.out_proj, f, S.feat.data(), nt);
    } else {
        std::memcpy(S.feat.data(), f, D * sizeof(float));
    }
}

inline float dot(const float* a, const float* b, int n) {
    float d = 0.f;
#pragma omp simd reduction(+ : d)
    for (int i = 0; i < n; ++i) d += a[i] * b[i];
    return d;
}

// The target id of the feature's best row: the int8 head's best ``rescore`` rows rescored in float, then the
// rows added for tokens of the text (extra [n_extra, n_embd] float32), which win only when strictly higher.
// With ``p_min`` > 0, ``*p_best`` is the best row's softmax probability over every row (the int8 logits
// outside the rescored best): llama.cpp's draft-p-min stops a chain below it.
int64_t best_token(const Model& M, Scratch& S, const float* feat, const float* extra, int n_extra, const int64_t* d2t,
                   int nt, float p_min, float* p_best) {
    const int D = M.n_embd, R = M.rescore;
    float* lg = S.logits.data();
    gemv(M.head, feat, lg, nt);
    int top[64];
    float val[64];
    int n = 0;
    for (int r = 0; r < M.head.out; ++r) {  // the R largest int8 logits, kept sorted descending
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
// With ``first`` (1) position p0 is first computed from the target's real row g (its
// taps, through the taps' fc, or its feature) and
// ``token``; otherwise (0) g is the pre-norm x and ``feat0`` the feature of the position before p0, both
// computed already.  Writes cells p0.. of every block; returns the number of cells written (the caller
// advances its count), the target ids in ``out``.
int32_t draft_chain(const Model* M, const float* g, const float* feat0, int64_t token, int32_t p0, int32_t k,
                    int32_t first, const float* extra, int32_t n_extra, const int64_t* d2t, int32_t threads, float p_min,
                    int64_t* out, int32_t* n_out) {
    thread_local Scratch S;
    const int H = M->hidden, D = M->n_embd;
    S.x.resize(H); S.xn.resize(H > D ? H : D); S.e.resize(D); S.h1.resize(H); S.h2.resize(H);
    S.cat.resize(2 * (H > D ? H : D) + M->w1.in); S.z.resize(H);
    S.qkv.resize((size_t)(M->n_heads + 2 * M->n_kv) * M->head_dim); S.att.resize((size_t)M->n_heads * M->head_dim);
    S.tmp.resize(H); S.gu.resize(2 * M->ffn); S.act.resize(M->ffn); S.feat.resize(D); S.logits.resize(M->head.out);
    int p = p0, written = 0;
    std::vector<float> g_next(H > D ? H : D);
    if (first) {
        if (M->tap.w) {
            S.g.resize(M->tap.out);
            gemv(M->tap, g, S.g.data(), threads);
            g = S.g.data();
        }
        step(*M, S, g, token, p++, threads);
        ++written;
    } else {
        std::memcpy(S.x.data(), g, H * sizeof(float));
        std::memcpy(S.feat.data(), feat0, D * sizeof(float));
    }
    *n_out = 0;
    for (int j = 0; j < k; ++j) {
        float prob = 1.f;
        const int64_t tok = best_token(*M, S, S.feat.data(), extra, n_extra, d2t, threads, p_min, &prob);
        if (prob < p_min) break;  // the chain stops where the draft is unsure (a tree round's p-min)
        out[j] = tok;
        *n_out = j + 1;
        if (j + 1 == k) break;
        if (p >= M->max_pos) return -1;
        const float* src = M->drafted_is_prenorm ? S.x.data() : S.feat.data();
        std::memcpy(g_next.data(), src, (M->drafted_is_prenorm ? H : D) * sizeof(float));
        step(*M, S, g_next.data(), tok, p++, threads);
        ++written;
    }
    return written;
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
