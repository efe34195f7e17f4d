/* FIRE's rows at known `start + arange` positions and their pullback, one pass each, on CPU
 * (Li et al., 2024, eq. 3; called by `native.py`).
 *
 * The MLP f(x) = W2 relu(w1 x + b1) + b2 of a scalar x is piecewise linear: its S breakpoints
 * tau (sorted) cut the line into S + 1 segments, f(x) = A[h, s] x + B[h, s] on segment s
 * (s = the number of breakpoints below x). Row r of a block reads x = p[m] / n[r] at the table
 * index m = R - 1 - r + j of key j (p: psi of the block's descending distances, n: the rows'
 * normalizers), so along a row x changes monotonically on each side of distance 0 and a row is
 * a few pieces of constant segment: each piece is one affine pass, and its gradient a few sums.
 *
 * Pullback of rows' gradient g (key layout): per head and segment G0 = sum g, G1 = sum g x (the
 * unit gradients follow from these, `native.py`); per row, with g_x = sum_h g_h A[h, s], the
 * sums sum g_x dpsi (dpsi = d psi / d c at the column) and sum g_x x (the normalizer's).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_PIECES 4096

typedef struct {
    int64_t lo, hi, seg; /* columns [lo, hi) of a row in one segment */
} piece;

/* The pieces of row r: columns j in [0, c_len) with m = m0 + j, x = p[m] / n (T the caller's
 * type), written to xs; tau the breakpoints in T. */
#define PIECES(T)                                                                                   \
    static int64_t pieces_##T(const T *p, int64_t m0, int64_t c_len, T n, const T *tau,             \
                              int64_t n_tau, T *restrict xs, piece *out) {                         \
        const T *restrict pr = p + m0;                                                             \
        for (int64_t j = 0; j < c_len; j++) xs[j] = pr[j] / n;                                     \
        int64_t count = 0, s = 0;                                                                  \
        for (int64_t j = 0; j < c_len; j++) {                                                      \
            const T x = xs[j];                                                                     \
            while (s < n_tau && x > tau[s]) s++;                                                   \
            while (s > 0 && x <= tau[s - 1]) s--;                                                  \
            if (count && out[count - 1].seg == s) {                                                \
                out[count - 1].hi = j + 1;                                                         \
            } else {                                                                               \
                if (count == MAX_PIECES) return -1;                                                \
                out[count].lo = j;                                                                 \
                out[count].hi = j + 1;                                                             \
                out[count].seg = s;                                                                \
                count++;                                                                           \
            }                                                                                      \
        }                                                                                          \
        return count;                                                                              \
    }

/* sum u, sum u x and (with d) sum u d over len elements: 32-byte vector partial sums in T (each
 * lane a sum in order: no reassociation flag), their lanes added in double at the end. */
typedef float vec_float __attribute__((vector_size(32)));
typedef double vec_double __attribute__((vector_size(32)));
#define SUMS(T)                                                                                     \
    static inline vec_##T load_##T(const T *u) {                                                  \
        vec_##T v;                                                                                 \
        memcpy(&v, u, sizeof v);                                                                   \
        return v;                                                                                  \
    }                                                                                              \
    static inline double lanes_##T(vec_##T v) {                                                   \
        double s = 0.0;                                                                            \
        for (int k = 0; k < (int)(sizeof v / sizeof(T)); k++) s += (double)v[k];                    \
        return s;                                                                                  \
    }                                                                                              \
    static void sums_##T(const T *u, const T *x, const T *d, int64_t len, double *out) {           \
        const int64_t w = sizeof(vec_##T) / sizeof(T);                                             \
        vec_##T a0 = {0}, a1 = {0}, a2 = {0};                                                      \
        int64_t j = 0;                                                                             \
        if (d) {                                                                                   \
            for (; j + w <= len; j += w) {                                                         \
                const vec_##T g = load_##T(u + j);                                                 \
                a0 += g;                                                                           \
                a1 += g * load_##T(x + j);                                                         \
                a2 += g * load_##T(d + j);                                                         \
            }                                                                                      \
        } else {                                                                                   \
            for (; j + w <= len; j += w) {                                                         \
                const vec_##T g = load_##T(u + j);                                                 \
                a0 += g;                                                                           \
                a1 += g * load_##T(x + j);                                                         \
            }                                                                                      \
        }                                                                                          \
        double s0 = lanes_##T(a0), s1 = lanes_##T(a1), s2 = lanes_##T(a2);                         \
        for (; j < len; j++) {                                                                     \
            s0 += (double)u[j];                                                                    \
            s1 += (double)u[j] * (double)x[j];                                                     \
            if (d) s2 += (double)u[j] * (double)d[j];                                              \
        }                                                                                          \
        out[0] = s0;                                                                               \
        out[1] = s1;                                                                               \
        out[2] = s2;                                                                               \
    }

/* rows[h, r, j] = A[h, s] x + B[h, s]; out at out + h * sh + r * sr + j.
 * Returns 0, or -1 if a row has more pieces than MAX_PIECES (the caller falls back). */
#define ROWS(T)                                                                                     \
    int64_t fire_rows_##T(const T *p, const T *n, int64_t rows, int64_t c_len, const T *tau,       \
                          int64_t n_tau, const T *a, const T *b, int64_t heads, T *out, int64_t sh,  \
                          int64_t sr, T *xs) {                                                     \
        piece pc[MAX_PIECES];                                                                      \
        int64_t segs = n_tau + 1;                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            int64_t count = pieces_##T(p, rows - 1 - r, c_len, n[r], tau, n_tau, xs, pc);          \
            if (count < 0) return -1;                                                              \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                T *o = out + h * sh + r * sr;                                                      \
                for (int64_t i = 0; i < count; i++) {                                              \
                    const T sa = a[h * segs + pc[i].seg], sb = b[h * segs + pc[i].seg];            \
                    for (int64_t j = pc[i].lo; j < pc[i].hi; j++) o[j] = sa * xs[j] + sb;          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

/* The sums of the pullback, in double: g0, g1 [heads, n_tau + 1] (added to), row_c, row_n [rows]
 * (written). Row r's columns j <= last - (rows - 1 - r) only (last < 0: all): past them the
 * caller's mask made g zero. dpsi may be NULL (no c / L gradient: row_c, row_n left 0). */
#define PULLBACK(T)                                                                                 \
    int64_t fire_pullback_##T(const T *p, const T *n, const T *dpsi, int64_t rows, int64_t c_len,   \
                              int64_t last, const T *tau, int64_t n_tau, const T *a,           \
                              int64_t heads, const T *g, int64_t gh, int64_t gr, double *g0,         \
                              double *g1, double *row_c, double *row_n, T *xs) {                    \
        piece pc[MAX_PIECES];                                                                      \
        int64_t segs = n_tau + 1;                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            int64_t m0 = rows - 1 - r;                                                             \
            int64_t c_row = c_len;                                                                 \
            if (last >= 0 && last - m0 + 1 < c_row) c_row = last - m0 + 1;                         \
            row_c[r] = 0.0;                                                                        \
            row_n[r] = 0.0;                                                                        \
            if (c_row <= 0) continue;                                                              \
            int64_t count = pieces_##T(p, m0, c_row, n[r], tau, n_tau, xs, pc);                    \
            if (count < 0) return -1;                                                              \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const T *gg = g + h * gh + r * gr;                                                 \
                for (int64_t i = 0; i < count; i++) {                                              \
                    const int64_t lo = pc[i].lo, hi = pc[i].hi, s = pc[i].seg;                     \
                    double sm[3];                                                                  \
                    sums_##T(gg + lo, xs + lo, dpsi ? dpsi + m0 + lo : NULL, hi - lo, sm);         \
                    const double sg = sm[0], sgx = sm[1], sgd = sm[2];                             \
                    g0[h * segs + s] += sg;                                                        \
                    g1[h * segs + s] += sgx;                                                       \
                    const double sa = (double)a[h * segs + s];                                     \
                    row_c[r] += sa * sgd;                                                          \
                    row_n[r] += sa * sgx;                                                          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

SUMS(float)
SUMS(double)
PIECES(float)
PIECES(double)
ROWS(float)
ROWS(double)
PULLBACK(float)
PULLBACK(double)
