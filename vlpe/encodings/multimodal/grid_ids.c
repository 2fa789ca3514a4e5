/* The ``grid`` design's ids (Qwen2-VL MRoPE, and its spatial reset) and their checks in one pass over the tokens.
 *
 * A plain C loop for CPU tensors, loaded by vlpe/encodings/multimodal/grid_ids_native.py (built by vlpe/native.py).
 * It returns the ids of vlpe.encodings.multimodal.position_ids' general path exactly, or declines (a non-zero
 * code) where that path raises: token types outside 0 .. 2, a grid row that is not positive or whose H, W are not
 * divisible by the merge size, more or fewer vision tokens than the grid rows describe, a block that is not one
 * run of consecutive vision tokens of one type inside one batch row, or two blocks of one type with no token
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
    int64_t r = 0;          /* the next grid row */
    int64_t left = 0;       /* tokens of the open block still to come (0: no block open) */
    int64_t start = 0, Hm = 1, Wm = 1, adv = 0, kind = 0;
    int64_t tau = 0, i = 0, j = 0;  /* the next token's frame, row and column in the open block */
    for (int64_t b = 0; b < B; b++) {
        const int64_t *trow = types + b * ts0;
        const uint8_t *vrow = valid ? valid + b * vs0 : 0;
        int64_t *ot = out_t + b * S, *oh = out_h + b * S, *ow = out_w + b * S;
        int64_t p = 0, real = 0;
        int ended = 0;      /* the previous token of this row closed a block (of type `kind`) */
        for (int64_t s = 0; s < S; s++) {
            const int64_t t = trow[s * ts1];
            if (t < 0 || t > 2)
                return GRID_IDS_BAD_TYPE;
            if (vrow && !vrow[s * vs1]) {  /* padding */
                if (left)
                    return GRID_IDS_RUN;
                ot[s] = oh[s] = ow[s] = pad;
                ended = 0;
                continue;
            }
            real++;
            if (t == 0) {  /* text */
                if (left)
                    return GRID_IDS_RUN;
                ot[s] = oh[s] = ow[s] = p;
                p++;
                ended = 0;
                continue;
            }
            if (!left) {  /* the first token of grid row r */
                if (r == R)
                    return GRID_IDS_COUNT;
                if (ended && t == kind)
                    return GRID_IDS_RUN;
                const int64_t *g = grid + r * gs0;
                const int64_t T = g[0];
                Hm = g[gs1] / m;
                Wm = g[2 * gs1] / m;
                left = T * Hm * Wm;
                int64_t span = stride * (T - 1);
                if (Hm - 1 > span)
                    span = Hm - 1;
                if (Wm - 1 > span)
                    span = Wm - 1;
                adv = span + 1;
                start = p;
                tau = i = j = 0;
                kind = t;
                r++;
            } else if (t != kind) {
                return GRID_IDS_RUN;
            }
            const int64_t base = spatial_reset ? 0 : start;
            ot[s] = start + stride * tau;
            oh[s] = base + i;
            ow[s] = base + j;
            if (++j == Wm) {  /* raster order: j fastest, then i, then tau */
                j = 0;
                if (++i == Hm) {
                    i = 0;
                    tau++;
                }
            }
            ended = 0;
            if (!--left) {
                p = start + adv;
                ended = 1;
            }
        }
        if (left)  /* a block continues on the next row */
            return GRID_IDS_RUN;
        deltas[b] = p - real;
    }
    return r == R ? GRID_IDS_OK : GRID_IDS_COUNT;
}
