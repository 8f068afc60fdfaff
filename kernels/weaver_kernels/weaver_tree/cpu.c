/* Native CPU kernels of a Weaver tree build (cpu.py compiles and loads them; naive.py holds the references).
 *
 * A CPU build is a few hundred tiny torch calls: their dispatch, not their arithmetic, is the cost. Each function
 * here does one stage of a round between two GEMMs (the GEMMs stay with torch) in one call, in the references'
 * arithmetic: fp32 math, results rounded to the tensors' dtypes as torch rounds them, stable orders with the lowest
 * index first among equal values. Compiled with -ffp-contract=off so that a*b + c*d rounds as torch's two ops do.
 *
 * dtype codes: 0 fp32, 1 bf16 (tensors of 16-bit values are passed as uint16_t). Bool tensors are bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define F32 0
#define BF16 1

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet (torch's rule) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ld(const void *p, int dt, int64_t i) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int dt, int64_t i, float v) {
    if (dt == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float round_to(int dt, float v) { return dt == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* 16 floats as one value: GCC lowers it to the widest SIMD the CPU has (one zmm with AVX-512). */
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline float lanes_sum(v16 v) { /* pairwise: 4 dependent adds, not 16 */
    float a[16];
    store16(a, v);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

static float dot(const float *a, const float *b, int64_t n) {
    v16 acc = {0}, acc2 = {0}; /* two chains: the adds' latency, not their throughput, bounds one */
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        acc += load16(a + k) * load16(b + k);
        acc2 += load16(a + k + 16) * load16(b + k + 16);
    }
    for (; k + 16 <= n; k += 16) acc += load16(a + k) * load16(b + k);
    float s = lanes_sum(acc + acc2);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* "a > b" of a descending stable order: NaN above everything (torch's descending sort). */
static inline int above(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* Rows of a tensor to fp32 (rounded to `as` first: the reference's cast to the query's dtype), and back. */
static void to_f32(const void *src, int dt, int64_t offset, float *dst, int64_t count, int as) {
    if (dt == BF16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int64_t j = 0; j < count; j++) dst[j] = bf16_to_f32(p[j]);
    } else {
        const float *p = (const float *)src + offset;
        if (as == BF16)
            for (int64_t j = 0; j < count; j++) dst[j] = round_to(BF16, p[j]);
        else
            memcpy(dst, p, sizeof(float) * count);
    }
}

static void from_f32(const float *src, void *dst, int dt, int64_t offset, int64_t count) {
    if (dt == BF16) {
        uint16_t *p = (uint16_t *)dst + offset;
        for (int64_t j = 0; j < count; j++) p[j] = f32_to_bf16(src[j]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * count);
    }
}

/* WeaverRMSNorm of one fp32 row x [d]: x / rms(x) * w + b in fp32, rounded into row r of `out` (dtype dt). */
static void norm_row(const float *x, const float *w, const float *b, int64_t d, float eps, void *out, int dt,
                     int64_t r) {
    const float inv = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t j = 0; j < d; j++) st(out, dt, r * d + j, x[j] * inv * w[j] + b[j]);
}

/* WeaverRMSNorm of rows (w, b in dtype `wdt`), rounded to x's dtype. With `add`, x = x + add first (rounded to the
 * dtype, torch's residual add), and that sum is written to `x_out`. */
int weaver_rms_norm(const void *x, const void *add, void *x_out, void *out, int dt, const void *weight,
                    const void *bias, int wdt, int64_t rows, int64_t d, float eps) {
    float *tmp = malloc(sizeof(float) * 3 * d), *w = tmp + d, *b = tmp + 2 * d;
    if (!tmp) return -1;
    to_f32(weight, wdt, 0, w, d, F32);
    to_f32(bias, wdt, 0, b, d, F32);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < d; j++) {
            float v = ld(x, dt, r * d + j);
            if (add) {
                v = round_to(dt, v + ld(add, dt, r * d + j));
                st(x_out, dt, r * d + j, v);
            }
            tmp[j] = v;
        }
        norm_row(tmp, w, b, d, eps, out, dt, r);
    }
    free(tmp);
    return 0;
}

/* A Weaver prompt's input rows: the target's hidden state `first [d]` then the drafter's `rest [count, d]` (each in
 * its dtype), rounded to the Weaver's dtype `dt` (the reference casts them so), through WeaverRMSNorm (w, b in `wdt`)
 * into `out [1 + count, d]`. */
int weaver_prompt_norm(const void *first, int fdt, const void *rest, int rdt, int64_t count, int64_t d,
                       const void *weight, const void *bias, int wdt, float eps, void *out, int dt) {
    float *x = malloc(sizeof(float) * 3 * d), *w = x + d, *b = x + 2 * d;
    if (!x) return -1;
    to_f32(weight, wdt, 0, w, d, F32);
    to_f32(bias, wdt, 0, b, d, F32);
    for (int64_t r = 0; r <= count; r++) {
        if (r == 0) to_f32(first, fdt, 0, x, d, dt);
        else to_f32(rest, rdt, (r - 1) * d, x, d, dt);
        norm_row(x, w, b, d, eps, out, dt, r);
    }
    free(x);
    return 0;
}

/* silu(gate) * up of the rows [gate | up] of a gate_up projection, each op rounded to the dtype as torch's two. */
int weaver_silu_mul(const void *gate_up, void *out, int dt, int64_t rows, int64_t width) {
    float *buf = malloc(sizeof(float) * 2 * width), *g = buf, *u = buf + width;
    if (!buf) return -1;
    for (int64_t r = 0; r < rows; r++) {
        to_f32(gate_up, dt, r * 2 * width, g, width, dt);
        to_f32(gate_up, dt, r * 2 * width + width, u, width, dt);
        for (int64_t j = 0; j < width; j++) g[j] = round_to(dt, g[j] / (1.0f + expf(-g[j]))) * u[j];
        from_f32(g, out, dt, r * width, width);
    }
    free(buf);
    return 0;
}

/* node_attention_ref: RoPE (fp32, at `positions`) on q and k of `qkv [M, 3·H·D]`, k and v written into node slots
 * lo..lo+M-1 of `node_k/node_v [H, n, D]`, then attention over the prompt `[H, P, D]` (all visible) and the node
 * slots `mask [M, n]` allows; out [M, H·D]. `out` may be NULL (only the slots are wanted). `cos_table`/`sin_table`
 * [rows, D/2]: the reference's fp32 cos and sin of positions 0..rows-1 (torch's own values; others computed here). */
int weaver_node_attention(const void *qkv, int qdt, const int64_t *positions, const void *prompt_k,
                          const void *prompt_v, int pdt, int64_t P, void *node_k, void *node_v, int ndt, int64_t n,
                          const uint8_t *mask, int64_t M, int64_t H, int64_t D, int64_t lo, float rope_base,
                          float scale, const float *cos_table, const float *sin_table, int64_t table_rows,
                          void *out) {
    const int64_t half = D / 2, width = 3 * H * D, L = P + n;
    float *buf = malloc(sizeof(float) * (3 * D + M * H * D + 2 * L * D + L + D));
    if (!buf) return -1;
    float *cs = buf, *sn = buf + half, *inv_freq = buf + D, *x = buf + 2 * D, *q = buf + 3 * D;
    float *keys = q + M * H * D, *vals = keys + L * D, *p = vals + L * D, *o = p + L;
    for (int64_t j = 0; j < half; j++) inv_freq[j] = powf(rope_base, -((float)(2 * j) / (float)D));
    for (int64_t m = 0; m < M; m++) { /* q rotated into `q`; k rotated and v into their slots */
        if (positions[m] >= 0 && positions[m] < table_rows) {
            memcpy(cs, cos_table + positions[m] * half, sizeof(float) * half);
            memcpy(sn, sin_table + positions[m] * half, sizeof(float) * half);
        } else {
            for (int64_t j = 0; j < half; j++) {
                float a = (float)positions[m] * inv_freq[j];
                cs[j] = cosf(a);
                sn[j] = sinf(a);
            }
        }
        for (int64_t h = 0; h < H; h++)
            for (int part = 0; part < 2; part++) {
                to_f32(qkv, qdt, m * width + part * H * D + h * D, x, D, qdt);
                float *r = part == 0 ? q + (m * H + h) * D : o;
                for (int64_t j = 0; j < half; j++) r[j] = round_to(qdt, x[j] * cs[j] + (-x[j + half]) * sn[j]);
                for (int64_t j = half; j < D; j++)
                    r[j] = round_to(qdt, x[j] * cs[j - half] + x[j - half] * sn[j - half]);
                if (part == 1) {
                    from_f32(o, node_k, ndt, (h * n + lo + m) * D, D);
                    to_f32(qkv, qdt, m * width + 2 * H * D + h * D, x, D, qdt);
                    from_f32(x, node_v, ndt, (h * n + lo + m) * D, D);
                }
            }
    }
    if (out) {
        for (int64_t h = 0; h < H; h++) {
            for (int64_t t = 0; t < P; t++) { /* the keys and values in the query's dtype, as fp32 rows */
                to_f32(prompt_k, pdt, (h * P + t) * D, keys + t * D, D, qdt);
                to_f32(prompt_v, pdt, (h * P + t) * D, vals + t * D, D, qdt);
            }
            for (int64_t t = 0; t < n; t++) {
                to_f32(node_k, ndt, (h * n + t) * D, keys + (P + t) * D, D, qdt);
                to_f32(node_v, ndt, (h * n + t) * D, vals + (P + t) * D, D, qdt);
            }
            for (int64_t m = 0; m < M; m++) {
                const float *qr = q + (m * H + h) * D;
                float mx = -INFINITY;
                for (int64_t t = 0; t < L; t++) {
                    p[t] = t >= P && !mask[m * n + (t - P)] ? -INFINITY : dot(qr, keys + t * D, D) * scale;
                    if (p[t] > mx) mx = p[t];
                }
                float sum = 0.0f;
                for (int64_t t = 0; t < L; t++) {
                    p[t] = p[t] == -INFINITY ? 0.0f : expf(p[t] - mx);
                    sum += p[t];
                }
                const float inv = 1.0f / sum;
                int64_t j0 = 0;
                for (; j0 + 64 <= D; j0 += 64) { /* 4 × 16 columns in registers over all keys: 4 chains */
                    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int64_t t = 0; t < L; t++) {
                        if (p[t] == 0.0f) continue; /* (masked: its slot may hold anything) */
                        const float *vr = vals + t * D + j0;
                        a0 += p[t] * load16(vr);
                        a1 += p[t] * load16(vr + 16);
                        a2 += p[t] * load16(vr + 32);
                        a3 += p[t] * load16(vr + 48);
                    }
                    store16(o + j0, a0 * inv);
                    store16(o + j0 + 16, a1 * inv);
                    store16(o + j0 + 32, a2 * inv);
                    store16(o + j0 + 48, a3 * inv);
                }
                for (; j0 + 16 <= D; j0 += 16) {
                    v16 acc = {0};
                    for (int64_t t = 0; t < L; t++)
                        if (p[t] != 0.0f) acc += p[t] * load16(vals + t * D + j0);
                    store16(o + j0, acc * inv);
                }
                for (; j0 < D; j0++) {
                    float acc = 0.0f;
                    for (int64_t t = 0; t < L; t++)
                        if (p[t] != 0.0f) acc += p[t] * vals[t * D + j0];
                    o[j0] = acc * inv;
                }
                from_f32(o, out, qdt, m * H * D + h * D, D);
            }
        }
    }
    free(buf);
    return 0;
}

/* pool_scores_ref: out[m, c] = pool_logits[rows[m], c] + lm_head[pool_ids[rows[m], c]] · query[m]; the query is
 * taken in the weight's dtype, the dot in fp32, rounded to the weight's dtype (torch's mv). */
int weaver_pool_scores(const void *query, int qdt, int64_t M, int64_t d, const int64_t *rows,
                       const int64_t *pool_ids, int64_t D, const float *pool_logits, int64_t C, const void *weight,
                       int wdt, int64_t V, float *out) {
    for (int64_t m = 0; m < M; m++) { /* (rows past the pool's D, ids past the weight's V: refused, not read) */
        if (rows[m] < 0 || rows[m] >= D) return -2;
        for (int64_t c = 0; c < C; c++)
            if (pool_ids[rows[m] * C + c] < 0 || pool_ids[rows[m] * C + c] >= V) return -2;
    }
    float *qf = malloc(sizeof(float) * 2 * d), *wf = qf + d;
    if (!qf) return -1;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < d; j++) qf[j] = round_to(wdt, ld(query, qdt, m * d + j));
        for (int64_t c = 0; c < C; c++) {
            const int64_t id = pool_ids[rows[m] * C + c];
            float s;
            if (wdt == F32) {
                s = dot(qf, (const float *)weight + id * d, d);
            } else {
                for (int64_t j = 0; j < d; j++) wf[j] = ld(weight, wdt, id * d + j);
                s = round_to(wdt, dot(qf, wf, d));
            }
            out[m * C + c] = pool_logits[rows[m] * C + c] + s;
        }
    }
    free(qf);
    return 0;
}

/* The k largest of each row of logits [rows, V] (row r at r·stride), stable descending (NaN above everything, the
 * lowest index first among equal values: a stable sort's first k) → values [rows, k] in fp32 and ids [rows, k].
 * One pass a row: a block of 64 is skipped unless one of its values beats the k-th kept (a vectorised count);
 * the kept k stay sorted, a newcomer inserted behind the values it does not beat. */
int weaver_pool_topk(const void *logits, int dt, int64_t rows, int64_t V, int64_t stride, int64_t k, float *values,
                     int64_t *ids) {
    float block[64];
    if (k < 1 || k > V) return -1;
    for (int64_t r = 0; r < rows; r++) {
        float *val = values + r * k;
        int64_t *id = ids + r * k, kept = 0;
        for (int64_t b = 0; b < V; b += 64) {
            int64_t len = V - b < 64 ? V - b : 64;
            if (dt == BF16) {
                const uint16_t *src = (const uint16_t *)logits + r * stride + b;
                for (int64_t i = 0; i < len; i++) block[i] = bf16_to_f32(src[i]);
            } else {
                memcpy(block, (const float *)logits + r * stride + b, (size_t)len * sizeof(float));
            }
            if (kept == k) {
                float last = val[k - 1];
                int beats = 0;
                if (isnan(last)) continue; /* k NaNs kept: nothing later beats them */
                for (int64_t i = 0; i < len; i++) beats += !(block[i] <= last); /* (NaN beats too) */
                if (!beats) continue;
            }
            for (int64_t i = 0; i < len; i++) {
                float x = block[i];
                if (kept == k && !above(x, val[k - 1])) continue;
                int64_t at = kept < k ? kept++ : k - 1; /* the slot freed: the end, or the k-th's */
                while (at > 0 && above(x, val[at - 1])) {
                    val[at] = val[at - 1];
                    id[at] = id[at - 1];
                    at--;
                }
                val[at] = x;
                id[at] = b + i;
            }
        }
    }
    return 0;
}

/* The `count` largest of v[0..len) in a stable descending order (ties: lowest index first) → idx. */
static void top_stable(const float *v, int64_t len, int64_t count, int64_t *idx, uint8_t *used) {
    memset(used, 0, (size_t)len);
    for (int64_t t = 0; t < count; t++) {
        int64_t best = -1;
        for (int64_t i = 0; i < len; i++)
            if (!used[i] && (best < 0 || above(v[i], v[best]))) best = i;
        used[best] = 1;
        idx[t] = best;
    }
}

static void log_softmax_row(const float *x, float *y, int64_t C) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < C; c++)
        if (x[c] > mx) mx = x[c];
    float sum = 0.0f;
    for (int64_t c = 0; c < C; c++) sum += expf(x[c] - mx);
    float lse = logf(sum);
    for (int64_t c = 0; c < C; c++) y[c] = x[c] - mx - lse;
}

/* weaver_expand_ref, in place (same buffers and arguments). */
int weaver_expand(const float *cand, int64_t C, const int64_t *pool_ids, int64_t *tokens, int64_t *parents,
                   float *logq, int64_t *depth, float *score, uint8_t *mask, float *f_score, int64_t *f_token,
                   float *f_logq, int64_t n, int64_t fan, int64_t lo, int64_t hi, int64_t take, int64_t max_depth,
                   int64_t spine) {
    const int64_t F = n * fan, most = C > F ? C : F;
    float *work = malloc(sizeof(float) * 2 * C);
    int64_t *iwork = malloc(sizeof(int64_t) * (C + F));
    uint8_t *used = malloc((size_t)most);
    if (!work || !iwork || !used) {
        free(work), free(iwork), free(used);
        return -1;
    }
    float *logp = work, *vals = work + C;
    int64_t *order = iwork;
    if (spine) {
        for (int64_t k = 0; k < spine; k++) {
            log_softmax_row(cand + k * C, logp, C);
            logq[k + 1] = logp[0];
            score[k + 1] = score[k] + logp[0];
        }
    }
    for (int64_t i = lo; i < hi; i++) {
        const float *row = cand + (i - lo) * C;
        log_softmax_row(row, logp, C);
        const int is_parent = spine && i < spine;
        /* a spine parent's column 0 is its spine child: its columns are looked at as 1..C-1, then 0 as -inf */
        for (int64_t c = 0; c < C; c++) {
            int64_t col = is_parent ? (c + 1) % C : c;
            vals[c] = is_parent && col == 0 ? -INFINITY : logp[col];
        }
        top_stable(vals, C, fan, order, used);
        const int64_t d = depth[i];
        const int real = parents[i] >= 0 || i == 0, publish = real && d < max_depth;
        const int64_t row_ids = (d < max_depth - 1 ? d : max_depth - 1) * C;
        for (int64_t j = 0; j < fan; j++) {
            int64_t col = is_parent ? (order[j] + 1) % C : order[j];
            float v = vals[order[j]];
            f_score[i * fan + j] = publish ? score[i] + v : -INFINITY;
            f_token[i * fan + j] = is_parent && col == 0 ? 0 : pool_ids[row_ids + col];
            f_logq[i * fan + j] = v;
        }
    }
    int64_t *best = iwork + C;
    if (take) top_stable(f_score, F, take, best, used);
    for (int64_t t = 0; t < take; t++) {
        const int64_t e = best[t], node = hi + t, parent = e / fan;
        const float v = f_score[e];
        const int valid = v > -INFINITY;
        tokens[node] = valid ? f_token[e] : 0;
        parents[node] = valid ? parent : -1;
        logq[node] = valid ? f_logq[e] : -INFINITY;
        depth[node] = valid ? depth[parent] + 1 : 0;
        score[node] = v;
        for (int64_t j = 0; j < n; j++) mask[node * n + j] = (valid && mask[parent * n + j]) || j == node;
    }
    for (int64_t t = 0; t < take; t++) f_score[best[t]] = -INFINITY;
    free(work), free(iwork), free(used);
    return 0;
}

/* A spine build's buffers before its first round (weaver_tree_tensors' setup): the root, nodes 1..spine the chain of
 * first pool candidates (node i at depth i, parent i - 1), ancestor masks, an empty frontier; nodes past the spine
 * padding roots. */
void weaver_spine_init(const int64_t *root, const int64_t *pool_ids, int64_t C, int64_t spine, int64_t *tokens,
                       int64_t *parents, float *logq, int64_t *depth, float *score, uint8_t *mask, float *f_score,
                       int64_t *f_token, float *f_logq, int64_t n, int64_t fan) {
    for (int64_t i = 0; i < n; i++) {
        const int on = i <= spine;
        tokens[i] = i == 0 ? *root : on ? pool_ids[(i - 1) * C] : 0;
        parents[i] = i > 0 && on ? i - 1 : -1;
        logq[i] = i == 0 ? 0.0f : -INFINITY;
        depth[i] = on ? i : 0;
        score[i] = 0.0f;
        for (int64_t j = 0; j < n; j++) mask[i * n + j] = on ? j <= i : j == i;
    }
    for (int64_t e = 0; e < n * fan; e++) {
        f_score[e] = -INFINITY;
        f_token[e] = 0;
        f_logq[e] = 0.0f;
    }
}

/* tree._root_leaves: the spine root's candidates fan..end-1 after its column 0, stable descending by
 * log-probability → (values, tokens); returns how many (end - fan, or 0). */
int64_t weaver_root_leaves(const float *cand, const int64_t *ids, int64_t C, int64_t fan, int64_t end, float *values,
                           int64_t *tokens) {
    if (end <= fan) return 0;
    float *work = malloc(sizeof(float) * C);
    int64_t *iwork = malloc(sizeof(int64_t) * C);
    uint8_t *used = malloc((size_t)C);
    if (!work || !iwork || !used) {
        free(work), free(iwork), free(used);
        return -1;
    }
    log_softmax_row(cand, work, C);
    top_stable(work + 1, C - 1, end, iwork, used);
    for (int64_t t = fan; t < end; t++) {
        values[t - fan] = work[1 + iwork[t]];
        tokens[t - fan] = ids[1 + iwork[t]];
    }
    free(work), free(iwork), free(used);
    return end - fan;
}

/* tree.best_known: the `budget` best paths among the build's nodes 1..n-1, its frontier and the root's `L` leaves,
 * as draft nodes padded to `budget` (out_tokens, out_parents, out_logq). */
int weaver_best_known(const int64_t *tokens, const int64_t *parents, const float *logq, const int64_t *depth,
                       const float *score, const float *f_score, const int64_t *f_token, const float *f_logq,
                       int64_t n, int64_t fan, const float *leaf_score, const int64_t *leaf_token,
                       const float *leaf_logq, int64_t L, int64_t budget, int64_t *out_tokens, int64_t *out_parents,
                       float *out_logq) {
    const int64_t F = n * fan, total = n - 1 + F + L, k = budget < total ? budget : total;
    double *keys = malloc(sizeof(double) * total);
    int64_t *iwork = malloc(sizeof(int64_t) * (total + n + 1)), *number = iwork + total;
    uint8_t *used = malloc((size_t)total + 1);
    if (!keys || !iwork || !used) {
        free(keys), free(iwork), free(used);
        return -1;
    }
    for (int64_t i = 0; i < total; i++) {
        double s, dep;
        if (i < n - 1) {
            s = parents[i + 1] >= 0 ? (double)score[i + 1] : -INFINITY;
            dep = (double)depth[i + 1];
        } else if (i < n - 1 + F) {
            s = (double)f_score[i - (n - 1)];
            dep = (double)(depth[(i - (n - 1)) / fan] + 1);
        } else {
            s = (double)leaf_score[i - (n - 1) - F];
            dep = (double)(depth[0] + 1);
        }
        keys[i] = s - 1e-12 * dep;
    }
    memset(used, 0, (size_t)total);
    for (int64_t t = 0; t < k; t++) { /* top-k, stable */
        int64_t b = -1;
        for (int64_t i = 0; i < total; i++)
            if (!used[i] && (b < 0 || keys[i] > keys[b] || (isnan(keys[i]) && !isnan(keys[b])))) b = i;
        used[b] = 1;
        iwork[t] = b;
    }
    for (int64_t i = 0; i <= n; i++) number[i] = 0;
    for (int64_t t = 0; t < k; t++) {
        const int64_t e = iwork[t];
        if (e < n - 1 && keys[e] > -INFINITY) number[e + 1] = t + 1;
    }
    for (int64_t t = 0; t < budget; t++) {
        if (t >= k || !(keys[iwork[t]] > -INFINITY)) {
            out_tokens[t] = 0;
            out_parents[t] = -1;
            out_logq[t] = -INFINITY;
            continue;
        }
        const int64_t e = iwork[t];
        int64_t parent;
        if (e < n - 1) {
            out_tokens[t] = tokens[e + 1];
            out_logq[t] = logq[e + 1];
            parent = parents[e + 1];
        } else if (e < n - 1 + F) {
            out_tokens[t] = f_token[e - (n - 1)];
            out_logq[t] = f_logq[e - (n - 1)];
            parent = (e - (n - 1)) / fan;
        } else {
            out_tokens[t] = leaf_token[e - (n - 1) - F];
            out_logq[t] = leaf_logq[e - (n - 1) - F];
            parent = 0;
        }
        out_parents[t] = number[parent < 0 ? 0 : parent];
    }
    free(keys), free(iwork), free(used);
    return 0;
}

/* A spine tree with no rounds after the spine (the CPU's default), from the spine step's `query [spine, d]` (nodes
 * 0..spine-1: the root and the chain but its deepest node): tree.weaver_tree_tensors' bookkeeping for it — pool
 * scores, the expand of nodes 0..spine, the root's leaves (up to `children` children), the best-known pick — in one
 * call, through the functions above. `pool_rows`: the weight's row of each pool entry (`pool_ids` itself, or indices
 * into a gathered copy). Writes the `budget` draft nodes. */
int weaver_spine_tree(const void *query, int qdt, int64_t d, const int64_t *root, const int64_t *pool_ids,
                      const int64_t *pool_rows, const float *pool_logits, int64_t C, const void *weight, int wdt,
                      int64_t V, int64_t spine, int64_t fan, int64_t children, int64_t budget, int64_t *out_tokens,
                      int64_t *out_parents, float *out_logq) {
    const int64_t n = 1 + spine, F = n * fan, end = children < C - 1 ? children : C - 1;
    int64_t *ints = malloc(sizeof(int64_t) * (spine + 3 * n + F + C));
    float *floats = calloc((size_t)(n * C + 2 * n + 2 * F + 2 * C), sizeof(float));
    uint8_t *mask = malloc((size_t)(n * n));
    int status = -1;
    if (!ints || !floats || !mask) goto done;
    int64_t *rows = ints, *tokens = rows + spine, *parents = tokens + n, *depth = parents + n, *f_token = depth + n,
            *leaf_token = f_token + F;
    float *cand = floats, *logq = cand + n * C, *score = logq + n, *f_score = score + n, *f_logq = f_score + F,
          *leaf_score = f_logq + F;
    for (int64_t m = 0; m < spine; m++) rows[m] = m; /* node m is at depth m: its children's pool row */
    if ((status = weaver_pool_scores(query, qdt, spine, d, rows, pool_rows, spine, pool_logits, C, weight, wdt, V,
                                     cand)))
        goto done;
    status = -1;
    /* (the deepest spine node's row stays zero: a placeholder the expand never publishes) */
    weaver_spine_init(root, pool_ids, C, spine, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, n,
                      fan);
    if (weaver_expand(cand, C, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq, n, fan,
                      0, n, 0, spine, spine))
        goto done;
    const int64_t L = weaver_root_leaves(cand, pool_ids, C, fan, end, leaf_score, leaf_token);
    if (L < 0) goto done;
    status = weaver_best_known(tokens, parents, logq, depth, score, f_score, f_token, f_logq, n, fan, leaf_score,
                               leaf_token, leaf_score, L, budget, out_tokens, out_parents, out_logq);
done:
    free(ints), free(floats), free(mask);
    return status;
}
