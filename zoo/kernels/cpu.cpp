// zoo's native CPU kernels: float32, row-major, no torch headers (loaded with ctypes by zoo/kernels/__init__.py).
//
// Built with -O3 -march=native -ffp-contract=off -pthread. Contraction is off so that the elementwise kernels
// round exactly like torch's separate mul / add ops (the rotation equals transformers' bit for bit); the
// reductions use explicit fused multiply-adds (fma16) instead.
//
// Shape legend:
//     M = rows of x (tokens)    K = input features    N = output features    T = tokens    D = head dim
//     H = query heads    KV = key/value heads    B = requests    BS = tokens per block
//
// Threads: a kernel splits its work into chunks that the calling thread and the pool's workers claim from
// one atomic counter (Pool below). The caller never waits for a worker that has not started, only for
// chunks a worker has claimed: on a machine shared with other processes a descheduled worker costs at
// most one chunk, where a fork-join barrier (OpenMP) waits for it at every kernel. Every output element is
// computed by one thread in a fixed order: results do not depend on the thread count.
//
// One translation unit made of a file per kernel family (zoo/kernels/cpu/), each readable and tunable alone; one
// unit, so the compiler sees every kernel the fused step calls (templates, inlining) as it did in one file:
//     common.h     vector types and helpers (v16 as one zmm or two ymm halves, bfloat16, fma, exp), the Pool
//     linear.h     GEMV / panel GEMM, float32 and bfloat16 weights
//     quant.h      GGUF block-quantised weights, int8 / int16 activations
//     rows.h       RMS norm, rotary, SiLU / GELU-and-mul
//     moe.h        mixture-of-experts
//     attention.h  multi-head latent attention's decode, causal attention over the paged cache
//     ssm.h        Mamba2 / SSD and Mamba1 mixers
//     sampling.h   greedy argmax over logits rows
//     fused.h      zoo_llama_step, a whole decoder step made of the kernels above (zoo/kernels/fused.py)
#include "cpu/common.h"
#include "cpu/linear.h"
#include "cpu/quant.h"
#include "cpu/rows.h"
#include "cpu/moe.h"
#include "cpu/attention.h"
#include "cpu/ssm.h"
#include "cpu/sampling.h"
#include "cpu/fused.h"

// What this build runs, from the compiler's macros (the instructions -march=native granted), not from cpuid: a
// flag the CPU advertises but the build does not use is absent here. Printed by the benches (kernels.describe()).
extern "C" const char* zoo_kernel_paths() {
    return "isa="
#if defined(__AVX512F__)
           "avx512f "
#endif
#if defined(__AVX512VNNI__)
           "avx512vnni "
#endif
#if defined(__AVX512BF16__)
           "avx512bf16 "
#endif
#if defined(__AVXVNNI__)
           "avxvnni "
#endif
#if defined(__AMX_TILE__)
           "amx-tile "
#endif
#if defined(__AVX2__)
           "avx2 "
#endif
#if defined(__FMA__)
           "fma "
#endif
#if defined(__F16C__)
           "f16c"
#endif
           ";linear float32="
#if defined(__AVX512F__)
           "register-tiled GEMM, 16-lane zmm panels (vfmadd231ps zmm)"
#elif defined(__FMA__)
           "register-tiled GEMM, 8-lane ymm panels (vfmadd231ps ymm)"
#else
           "register-tiled GEMM, generic vectors (no FMA)"
#endif
           ";linear bfloat16="
#if defined(__AVX2__) && !defined(__AVX512F__)
           "even/odd lanes (shift and mask, x permuted to match), float32 FMA"
#elif defined(__AVX512F__)
           "vpmovzxwd widening to zmm, float32 FMA (vdpbf16ps unused)"
#else
           "widened element by element, float32 arithmetic"
#endif
           ";quantized GEMV="
#if defined(__AVX2__)
           "int16 activations vpmaddwd (default) or int8 vpmaddubsw+vpmaddwd, ymm (VNNI vpdpbusd unused)"
#else
           "dequantised float32"
#endif
           ";vector registers="
#if defined(__AVX512VL__)
           "32"
#else
           "16"
#endif
        ;
}
