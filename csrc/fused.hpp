// The CUDA kernel of varuna_core._native (fused.cu), declared without any CUDA header so that bindings.cpp, a
// plain C++ file, can call them. Built only when CMake finds a CUDA compiler (VARUNA_WITH_CUDA); the Python twins
// that the tests compare them with are in src/varuna_core/pipeline/fused.py.
//
// Every argument that names memory is a device address (or a cudaStream_t) as an integer, as torch's
// ``Tensor.data_ptr()`` and ``torch.cuda.Stream.cuda_stream`` give them: the extension links no libtorch, so it
// builds and loads the same under any torch version.
#pragma once

#include <cstdint>
#include <string>

namespace varuna::fused {

// The element types a kernel reads or writes. Codes are shared with fused.py (_DTYPE_CODE).
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements of one tensor that one thread block handles: a tensor of n elements is ceil(n / kChunk) chunks, and a
// list of tensors is the concatenation of its tensors' chunks (the "chunk table" the wrapper builds once).
constexpr int64_t kChunk = 8192;

// A list of n same-typed, contiguous tensors on one device, described by a device array of int64:
//   table[0:n]        each tensor's address
//   table[n:2n]       each tensor's element count
//   table[2n:3n+1]    each tensor's first chunk (a prefix sum of ceil(numel / kChunk)); table[3n] = chunks
struct TensorList {
    uintptr_t table;  // device int64[3n+1]
    int64_t n;        // tensors
    int64_t chunks;   // total chunks (= table[3n], passed so the host sizes the grid without a copy back)
};

// One pass over the tensors: unscale in place (x = x * inv_scale in float, stored back in the tensor's type,
// exactly as torch._amp_foreach_non_finite_check_and_unscale_ does; skipped when inv_scale is 0), set
// *found_inf = 1.0f if any element read was not finite (as torch's kernel does, never reset here), and write each
// tensor's sum of squares of its (unscaled) elements to sq_out[i] (double). The sum is computed in a fixed order
// (float within a chunk, double over a tensor's chunks), so a tensor's result does not depend on which other
// tensors are in the list, on the grid's scheduling, or on the run. `partials` is device float[chunks] scratch.
// Returns "" or the CUDA error's text.
std::string unscale_sq_norms(const TensorList& list, DType dtype, uintptr_t inv_scale, uintptr_t found_inf,
                             uintptr_t partials, uintptr_t sq_out, uintptr_t stream);

}  // namespace varuna::fused
