// zoo/kernels/cpu/sampling.h: greedy sampling's argmax over the logits rows. Built as one unit by ../cpu.cpp,
// which includes every family in order; the includes below name what this one reads.
#pragma once

#include "common.h"

// ---------------------------------------------------------------------------------------------------
// Greedy sampling: out[i] = the first index of the largest value of row i of x [N, V] (row stride ld), as
// torch.argmax; a row holding a NaN gets the index of its first NaN (torch ranks NaN above everything).

// values (may be null): each row's value at its index, from the same pass (the sampler checks it is finite)
extern "C" void zoo_argmax(const float* x, long N, long V, long ld, int64_t* out, float* values, int nt) {
    parallel_for(N, 1, N * V >= 65536 ? nt : 1, [&](long i) {
        const float* r = x + i * ld;
        v16 best = splat(-INFINITY);
        static const int32_t lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        i16 at = splat_i(0), nan = splat_i(0);
        const i16 lane = load_i(lanes);
        long j = 0;
        for (; j + 16 <= V; j += 16) {
            v16 v = load(r + j);
            i16 gt = v > best;  // strict: the earliest index keeps a tie
            best = select(gt, v, best);
            at = select(gt, lane + (int32_t)j, at);
            nan |= v != v;
        }
        bool has_nan = false;
        for (int l = 0; l < 16; l++) has_nan |= nan[l] != 0;
        long found = 0;
        float m = -INFINITY;
        if (j > 0) {  // lanes hold the first maximum of their residue class: the largest, then the earliest
            m = best[0], found = at[0];
            for (int l = 1; l < 16; l++)
                if (best[l] > m || (best[l] == m && at[l] < found)) m = best[l], found = at[l];
        }
        for (; j < V; j++) {
            if (r[j] > m || (j == 0)) m = r[j], found = j;
            has_nan |= std::isnan(r[j]);
        }
        if (has_nan)
            for (long k = 0; k < V; k++)
                if (std::isnan(r[k])) {
                    found = k;
                    break;
                }
        out[i] = found;
        if (values) values[i] = r[found];
    });
}
