// The CUDA kernel of varuna_core._native: one pass over a stage's gradients (unscale, non-finite check, per-tensor
// squared norm). See fused.hpp for the contract; the Python twin is in src/varuna_core/pipeline/fused.py. (A
// pack/cast of several tensors into one buffer was measured here too and dropped: csrc/README.md.)
//
// Layout: one thread block per chunk of kChunk elements of one tensor (fused.hpp's chunk table); each thread reads
// kPerThread elements, kThreads apart (coalesced), four loads in flight before any use. Every reduction has a fixed
// shape (per thread in index order, then a warp's shuffle tree, then the warps in order), so results are bitwise
// reproducible and a tensor's result is independent of the other tensors in the list.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "fused.hpp"

namespace varuna::fused {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPerThread = static_cast<int>(kChunk / kThreads);  // 32
constexpr int kInFlight = 4;
static_assert(kChunk % (kThreads * kInFlight) == 0, "a chunk is a whole number of rounds");

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
    __device__ static float load(float v) { return v; }
    __device__ static float store(float v) { return v; }
};
template <>
struct Cvt<__half> {
    __device__ static float load(__half v) { return __half2float(v); }
    __device__ static __half store(float v) { return __float2half_rn(v); }  // torch's Half(float): nearest-even
};
template <>
struct Cvt<__nv_bfloat16> {
    __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// The tensor that chunk `b` belongs to: the largest i < n with first[i] <= b (empty tensors own no chunk).
__device__ int64_t locate(const int64_t* first, int64_t n, int64_t b) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename Acc>
__device__ Acc block_sum(Acc v, Acc* shared) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    Acc total = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < kWarps; ++w) total += shared[w];
    return total;  // meaningful on thread 0 only
}

template <typename T>
__global__ void __launch_bounds__(kThreads) unscale_sq_kernel(const int64_t* __restrict__ table, int64_t n,
                                                             const float* __restrict__ inv_scale,
                                                             float* __restrict__ found_inf,
                                                             float* __restrict__ partials) {
    __shared__ float shared[kWarps];
    const int64_t b = blockIdx.x;
    const int64_t i = locate(table + 2 * n, n, b);
    T* __restrict__ x = reinterpret_cast<T*>(static_cast<uintptr_t>(table[i]));
    const int64_t numel = table[n + i];
    const int64_t start = (b - table[2 * n + i]) * kChunk;
    const int64_t end = start + kChunk < numel ? start + kChunk : numel;
    const bool scale = inv_scale != nullptr;
    const float inv = scale ? *inv_scale : 1.0f;
    float acc = 0.0f;
    bool bad = false;
    for (int round = 0; round < kPerThread; round += kInFlight) {
        float v[kInFlight];
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
            const int64_t j = start + static_cast<int64_t>(round + k) * kThreads + threadIdx.x;
            v[k] = j < end ? Cvt<T>::load(x[j]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kInFlight; ++k) {
            const int64_t j = start + static_cast<int64_t>(round + k) * kThreads + threadIdx.x;
            if (j < end) {
                bad |= !isfinite(v[k]);
                if (scale) {
                    const T out = Cvt<T>::store(inv == 1.0f ? v[k] : v[k] * inv);
                    x[j] = out;
                    v[k] = Cvt<T>::load(out);
                }
                acc = __fmaf_rn(v[k], v[k], acc);
            }
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
    const float total = block_sum(acc, shared);
    if (threadIdx.x == 0) partials[b] = total;
}

// One block per tensor: its chunks' partial sums, added in double in a fixed order.
__global__ void __launch_bounds__(kThreads) sum_chunks_kernel(const int64_t* __restrict__ table, int64_t n,
                                                             const float* __restrict__ partials,
                                                             double* __restrict__ sq_out) {
    __shared__ double shared[kWarps];
    const int64_t i = blockIdx.x;
    const int64_t first = table[2 * n + i], last = table[2 * n + i + 1];
    double acc = 0.0;
    for (int64_t c = first + threadIdx.x; c < last; c += kThreads) acc += static_cast<double>(partials[c]);
    const double total = block_sum(acc, shared);
    if (threadIdx.x == 0) sq_out[i] = total;
}

std::string status() {
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? std::string() : std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

const int64_t* table_of(const TensorList& list) {
    return reinterpret_cast<const int64_t*>(list.table);
}

}  // namespace

std::string unscale_sq_norms(const TensorList& list, DType dtype, uintptr_t inv_scale, uintptr_t found_inf,
                             uintptr_t partials, uintptr_t sq_out, uintptr_t stream) {
    if (list.n == 0) return {};
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    const auto* inv = reinterpret_cast<const float*>(inv_scale);
    auto* inf = reinterpret_cast<float*>(found_inf);
    auto* part = reinterpret_cast<float*>(partials);
    if (list.chunks > 0) {
        const dim3 grid(static_cast<unsigned>(list.chunks));
        switch (dtype) {
            case DType::kFloat32:
                unscale_sq_kernel<float><<<grid, kThreads, 0, s>>>(table_of(list), list.n, inv, inf, part);
                break;
            case DType::kFloat16:
                unscale_sq_kernel<__half><<<grid, kThreads, 0, s>>>(table_of(list), list.n, inv, inf, part);
                break;
            case DType::kBFloat16:
                unscale_sq_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(table_of(list), list.n, inv, inf, part);
                break;
        }
    }
    sum_chunks_kernel<<<dim3(static_cast<unsigned>(list.n)), kThreads, 0, s>>>(
        table_of(list), list.n, part, reinterpret_cast<double*>(sq_out));
    return status();
}

}  // namespace varuna::fused
