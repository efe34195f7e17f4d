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
#include <stdlib.h>
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

/* The rows are split over the calling thread's OpenMP team (statically: the same split for the
 * same thread count). Built with -fopenmp the library shares the process's libgomp, so the team
 * is torch's own intra-op threads; built without, the pragmas are ignored. */
#ifdef _OPENMP
#include <omp.h>
#define THREADS() omp_get_max_threads()
#define THREAD() omp_get_thread_num()
#else
#define THREADS() 1
#define THREAD() 0
#endif

/* A thread's buffers for its rows: x of one row (c_len values of `elem` bytes) and its pieces.
 * NULL buffers (out of memory) record status -2; a row with more pieces than MAX_PIECES -1. */
typedef struct {
    void *xs;
    piece *pc;
} scratch;

static scratch scratch_open(int64_t c_len, size_t elem, int64_t *status) {
    scratch s = {malloc((size_t)(c_len > 0 ? c_len : 1) * elem), malloc(MAX_PIECES * sizeof(piece))};
    if (!s.xs || !s.pc) {
        _Pragma("omp atomic write") *status = -2;
    }
    return s;
}

static void scratch_close(scratch s) {
    free(s.xs);
    free(s.pc);
}

/* The pieces of a row (pieces_T) into the thread's scratch; -1 (recorded in status) where it has none. */
#define ROW_PIECES(T)                                                                               \
    static int64_t row_pieces_##T(const T *p, int64_t m0, int64_t c_len, T n, const T *tau,         \
                                  int64_t n_tau, scratch s, int64_t *status) {                     \
        if (!s.xs || !s.pc) return -1;                                                             \
        const int64_t count = pieces_##T(p, m0, c_len, n, tau, n_tau, (T *)s.xs, s.pc);            \
        if (count < 0) {                                                                           \
            _Pragma("omp atomic write") *status = -1;                                              \
        }                                                                                          \
        return count;                                                                              \
    }

/* rows[h, r, j] = A[h, s] x + B[h, s]; out at out + h * sh + r * sr + j.
 * Returns 0, -1 if a row has more pieces than MAX_PIECES (the caller falls back), -2 if out of memory. */
#define ROWS(T)                                                                                     \
    int64_t fire_rows_##T(const T *p, const T *n, int64_t rows, int64_t c_len, const T *tau,       \
                          int64_t n_tau, const T *a, const T *b, int64_t heads, T *out, int64_t sh,  \
                          int64_t sr) {                                                            \
        const int64_t segs = n_tau + 1;                                                            \
        int64_t status = 0;                                                                        \
        _Pragma("omp parallel")                                                                    \
        {                                                                                          \
            const scratch sc = scratch_open(c_len, sizeof(T), &status);                            \
            const T *xs = (const T *)sc.xs;                                                        \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t r = 0; r < rows; r++) {                                                   \
                const int64_t count = row_pieces_##T(p, rows - 1 - r, c_len, n[r], tau, n_tau, sc, &status); \
                for (int64_t h = 0; h < heads; h++) {                                              \
                    T *o = out + h * sh + r * sr;                                                  \
                    for (int64_t i = 0; i < count; i++) {                                          \
                        const T sa = a[h * segs + sc.pc[i].seg], sb = b[h * segs + sc.pc[i].seg];  \
                        for (int64_t j = sc.pc[i].lo; j < sc.pc[i].hi; j++) o[j] = sa * xs[j] + sb; \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            scratch_close(sc);                                                                     \
        }                                                                                          \
        return status;                                                                             \
    }

/* The sums of the pullback, in double: g0, g1 [heads, n_tau + 1] (added to), row_c, row_n [rows]
 * (written). Row r's columns j <= last - (rows - 1 - r) only (last < 0: all): past them the
 * caller's mask made g zero. dpsi may be NULL (no c / L gradient: row_c, row_n left 0). Each
 * thread sums its rows into its own g0, g1, added in thread order after (the same sums for the
 * same thread count). Returns as fire_rows. */
#define PULLBACK(T)                                                                                 \
    int64_t fire_pullback_##T(const T *p, const T *n, const T *dpsi, int64_t rows, int64_t c_len,   \
                              int64_t last, const T *tau, int64_t n_tau, const T *a,                \
                              int64_t heads, const T *g, int64_t gh, int64_t gr, double *g0,         \
                              double *g1, double *row_c, double *row_n) {                           \
        const int64_t segs = n_tau + 1, cells = heads * segs;                                      \
        const int threads = THREADS();                                                             \
        double *parts = calloc((size_t)threads * 2 * cells, sizeof(double));                       \
        if (!parts) return -2;                                                                     \
        int64_t status = 0;                                                                        \
        _Pragma("omp parallel num_threads(threads)")                                               \
        {                                                                                          \
            double *p0 = parts + (size_t)THREAD() * 2 * cells, *p1 = p0 + cells;                   \
            const scratch sc = scratch_open(c_len, sizeof(T), &status);                            \
            const T *xs = (const T *)sc.xs;                                                        \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t r = 0; r < rows; r++) {                                                   \
                const int64_t m0 = rows - 1 - r;                                                   \
                int64_t c_row = c_len;                                                             \
                if (last >= 0 && last - m0 + 1 < c_row) c_row = last - m0 + 1;                     \
                row_c[r] = 0.0;                                                                    \
                row_n[r] = 0.0;                                                                    \
                if (c_row <= 0) continue;                                                          \
                const int64_t count = row_pieces_##T(p, m0, c_row, n[r], tau, n_tau, sc, &status); \
                for (int64_t h = 0; h < heads; h++) {                                              \
                    const T *gg = g + h * gh + r * gr;                                             \
                    for (int64_t i = 0; i < count; i++) {                                          \
                        const int64_t lo = sc.pc[i].lo, hi = sc.pc[i].hi, s = sc.pc[i].seg;        \
                        double sm[3];                                                              \
                        sums_##T(gg + lo, xs + lo, dpsi ? dpsi + m0 + lo : NULL, hi - lo, sm);     \
                        p0[h * segs + s] += sm[0];                                                 \
                        p1[h * segs + s] += sm[1];                                                 \
                        const double sa = (double)a[h * segs + s];                                 \
                        row_c[r] += sa * sm[2];                                                    \
                        row_n[r] += sa * sm[1];                                                    \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            scratch_close(sc);                                                                     \
        }                                                                                          \
        for (int t = 0; t < threads; t++)                                                          \
            for (int64_t i = 0; i < cells; i++) {                                                  \
                g0[i] += parts[(size_t)t * 2 * cells + i];                                         \
                g1[i] += parts[(size_t)t * 2 * cells + cells + i];                                 \
            }                                                                                      \
        free(parts);                                                                               \
        return status;                                                                             \
    }

SUMS(float)
SUMS(double)
PIECES(float)
PIECES(double)
ROW_PIECES(float)
ROW_PIECES(double)
ROWS(float)
ROWS(double)
PULLBACK(float)
PULLBACK(double)
