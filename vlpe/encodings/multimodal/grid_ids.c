/* Two CPU kernels of the multimodal layout: vlpe_grid_ids, the ``grid`` design's ids (Qwen2-VL MRoPE, and its
 * spatial reset) with their checks in one pass over the tokens, and vlpe_merge_grids (below), Hugging Face's image
 * and video grid rows in order of appearance. Plain C for CPU tensors, loaded by
 * vlpe/encodings/multimodal/grid_ids_native.py (built by vlpe/native.py).
 *
 * vlpe_grid_ids returns the ids of vlpe.encodings.multimodal.position_ids' general path exactly, or declines (a
 * non-zero code) where that path raises: token types outside 0 .. 2, a grid row that is not positive or whose H, W
 * are not divisible by the merge size, more or fewer vision tokens than the grid rows describe, a block that is not
 * one run of consecutive vision tokens of one type inside one batch row, or two blocks of one type with no token
 * between them. tests/test_mm_grid_ids.py holds it to the general path on random and corrupted batches, and
 * tests/test_mm_fused_ids.py to a per-block loop of the released semantics.
 *
 * Semantics (every batch row restarts at position 0): a text token gets the running position p on every axis and
 * advances it by one; a padding slot (valid[b, s] == 0) gets pad; the k-th token of a block of merged grid
 * (T, H, W), entered at p, gets (p + stride * tau, p + i, p + j) with k = (tau * H + i) * W + j (with
 * spatial_reset: (p + stride * tau, i, j)), and the block advances p by max(stride * (T - 1), H - 1, W - 1) + 1.
 * deltas[b] is the position after row b less its real tokens.
 */

#include <stdint.h>

enum {
    GRID_IDS_OK = 0,
    GRID_IDS_BAD_TYPE = 1,  /* a token type outside 0 .. 2 (padding slots included) */
    GRID_IDS_BAD_ROW = 2,   /* a grid row not positive, H or W not divisible by m, or a block of more than N tokens */
    GRID_IDS_COUNT = 3,     /* more vision tokens than the rows describe, or rows left without tokens */
    GRID_IDS_RUN = 4,       /* a block split by text or padding, across rows, of two types, or glued to the last */
};

int vlpe_grid_ids(const int64_t *types, int64_t ts0, int64_t ts1,      /* (B, S) token types and strides */
                  const uint8_t *valid, int64_t vs0, int64_t vs1,      /* (B, S) real tokens, or NULL: all */
                  const int64_t *grid, int64_t gs0, int64_t gs1,       /* (R, 3) grids in patches, strides */
                  int64_t R, int64_t B, int64_t S, int64_t m, int64_t stride, int spatial_reset, int64_t pad,
                  int64_t *ids,                                        /* (3, B, S) contiguous, written */
                  int64_t *deltas)                                     /* (B,) written */
{
    const int64_t N = B * S;
    /* every row first: the general path checks all of them, reached by tokens or not */
    for (int64_t r = 0; r < R; r++) {
        const int64_t *g = grid + r * gs0;
        int64_t T = g[0], H = g[gs1], W = g[2 * gs1];
        if (T < 1 || H < 1 || W < 1 || H % m != 0 || W % m != 0)
            return GRID_IDS_BAD_ROW;
        H /= m;
        W /= m;
        /* a block of more than N tokens cannot match the batch (and keeps every product below 2**62) */
        if (T > N || H > N || W > N || T * H > N || T * H * W > N)
            return GRID_IDS_BAD_ROW;
    }
    int64_t *out_t = ids, *out_h = ids + N, *out_w = ids + 2 * N;
    int64_t r = 0;  /* the next grid row */
    for (int64_t b = 0; b < B; b++) {
        const int64_t *trow = types + b * ts0;
        const uint8_t *vrow = valid ? valid + b * vs0 : 0;
        int64_t *ot = out_t + b * S, *oh = out_h + b * S, *ow = out_w + b * S;
        int64_t p = 0, real = 0;
        int64_t ended = 0;  /* the type of a block that closed at the previous token of this row (0: none) */
        for (int64_t s = 0; s < S;) {
            const int64_t t = trow[s * ts1];
            if (t < 0 || t > 2)
                return GRID_IDS_BAD_TYPE;
            if (vrow && !vrow[s * vs1]) {  /* padding */
                ot[s] = oh[s] = ow[s] = pad;
                ended = 0;
                s++;
                continue;
            }
            if (t == 0) {  /* text */
                ot[s] = oh[s] = ow[s] = p;
                p++;
                real++;
                ended = 0;
                s++;
                continue;
            }
            /* the first token of grid row r: the whole block is checked (n real tokens of type t, inside this
             * row), then written frame by frame, line by line */
            if (r == R)
                return GRID_IDS_COUNT;
            if (ended == t)
                return GRID_IDS_RUN;
            const int64_t *g = grid + r * gs0;
            const int64_t T = g[0], Hm = g[gs1] / m, Wm = g[2 * gs1] / m, n = T * Hm * Wm;
            if (n > S - s)  /* it would continue on the next row */
                return GRID_IDS_RUN;
            int64_t bad = 0;
            for (int64_t q = s; q < s + n; q++)
                bad |= trow[q * ts1] ^ t;
            if (vrow)
                for (int64_t q = s; q < s + n; q++)
                    bad |= !vrow[q * vs1];
            if (bad)  /* text, padding or the other type inside the block */
                return GRID_IDS_RUN;
            int64_t span = stride * (T - 1);
            if (Hm - 1 > span)
                span = Hm - 1;
            if (Wm - 1 > span)
                span = Wm - 1;
            const int64_t base = spatial_reset ? 0 : p;
            int64_t q = s;
            for (int64_t tau = 0; tau < T; tau++) {
                const int64_t tv = p + stride * tau;
                for (int64_t i = 0; i < Hm; i++) {
                    const int64_t hv = base + i;
                    for (int64_t j = 0; j < Wm; j++) {  /* raster order: j fastest, then i, then tau */
                        ot[q + j] = tv;
                        oh[q + j] = hv;
                        ow[q + j] = base + j;
                    }
                    q += Wm;
                }
            }
            p += span + 1;
            real += n;
            s += n;
            ended = t;
            r++;
        }
        deltas[b] = p - real;
    }
    return r == R ? GRID_IDS_OK : GRID_IDS_COUNT;
}

/* Hugging Face's separate image and video grid rows, interleaved in order of appearance (merge_grids).
 *
 * The first token of the k-th row of a modality is its (c_k + 1)-th token of that modality over the flattened
 * batch, c_k the tokens of that modality's rows before it (merged T * H/m * W/m each), or N where there is no such
 * token; rows are ordered by first token, image rows first on ties (a stable sort of the images, then the videos).
 * This is vlpe.encodings.multimodal.merge_grids' tensor form on any input, valid or not, for grids of
 * non-negative values whose rows hold at most N tokens each: other grids (and m < 1) are declined
 * (GRID_IDS_BAD_ROW) for the tensor form to handle. tests/test_mm_fused_ids.py holds both to a counting loop.
 */
static int rows_start(const int64_t *g, int64_t s0, int64_t s1, int64_t R, int64_t m, int64_t N, int64_t *start)
{
    int64_t sum = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t T = g[r * s0], H = g[r * s0 + s1], W = g[r * s0 + 2 * s1];
        if (T < 0 || H < 0 || W < 0)
            return GRID_IDS_BAD_ROW;
        const int64_t a = T, b = H / m, c = W / m;
        int64_t n = 0;
        if (a && b && c) {
            if (a > N || b > N || c > N || a * b > N || a * b * c > N)
                return GRID_IDS_BAD_ROW;
            n = a * b * c;
        }
        start[r] = sum;
        sum += n;
    }
    return GRID_IDS_OK;
}

int vlpe_merge_grids(const int64_t *types, int64_t ts0, int64_t ts1,   /* (B, S) token types and strides */
                     const uint8_t *valid,                              /* (B * S,) real tokens, or NULL: all */
                     int64_t B, int64_t S,
                     const int64_t *images, int64_t is0, int64_t is1, int64_t Ri,  /* (Ri, 3) and strides */
                     const int64_t *videos, int64_t ws0, int64_t ws1, int64_t Rv,  /* (Rv, 3) and strides */
                     int64_t m,
                     int64_t *first,                                    /* (Ri + Rv,) scratch */
                     int64_t *grid_out,                                 /* (Ri + Rv, 3) contiguous, written */
                     int64_t *kind_out)                                 /* (Ri + Rv,) written */
{
    const int64_t N = B * S;
    if (m < 1)
        return GRID_IDS_BAD_ROW;
    int64_t *fi = first, *fv = first + Ri;  /* the starts c_k first, then the first tokens */
    if (rows_start(images, is0, is1, Ri, m, N, fi) || rows_start(videos, ws0, ws1, Rv, m, N, fv))
        return GRID_IDS_BAD_ROW;
    /* rows placed and tokens counted per modality; the start of the next row to place is kept in a register
     * (INT64_MAX when none is left), so a token costs a load, a compare and an increment */
    int64_t ki = 0, kv = 0, ci = 0, cv = 0;
    int64_t next_i = Ri ? fi[0] : INT64_MAX, next_v = Rv ? fv[0] : INT64_MAX;
    for (int64_t b = 0; b < B && (ki < Ri || kv < Rv); b++) {
        const int64_t *trow = types + b * ts0;
        const uint8_t *vrow = valid ? valid + b * S : 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t t = (vrow && !vrow[s]) ? 0 : trow[s * ts1];
            if (t == 1) {
                if (ci >= next_i) {  /* this is token ci + 1 of the images: the first of rows starting at <= ci */
                    while (ki < Ri && fi[ki] <= ci)
                        fi[ki++] = b * S + s;
                    next_i = ki < Ri ? fi[ki] : INT64_MAX;
                }
                ci++;
            } else if (t == 2) {
                if (cv >= next_v) {
                    while (kv < Rv && fv[kv] <= cv)
                        fv[kv++] = b * S + s;
                    next_v = kv < Rv ? fv[kv] : INT64_MAX;
                }
                cv++;
            }
        }
    }
    while (ki < Ri)
        fi[ki++] = N;
    while (kv < Rv)
        fv[kv++] = N;
    for (int64_t i = 0, j = 0, o = 0; o < Ri + Rv; o++) {
        const int take_image = j == Rv || (i < Ri && fi[i] <= fv[j]);
        const int64_t *g = take_image ? images + (i++) * is0 : videos + (j++) * ws0;
        const int64_t s1 = take_image ? is1 : ws1;
        grid_out[3 * o] = g[0];
        grid_out[3 * o + 1] = g[s1];
        grid_out[3 * o + 2] = g[2 * s1];
        kind_out[o] = take_image ? 1 : 2;
    }
    return GRID_IDS_OK;
}
