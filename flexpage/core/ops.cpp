// The CPU kernels of flexpage's native ops in C++, behind torch's dispatcher, so a compiled step
// calls them without entering Python: flexpage::row_linear (row_linear.c's few-row product, once
// per linear layer per step) and flexpage::paged_decode (decode_attention.c over a step's pages,
// once per layer, eager or compiled). The ops' schemas and shape functions are defined in kernels.py.
// Written against torch's stable C++ API (its C shim underneath), whose headers compile in about a
// second where ATen's take several: the build is the first decode step's wait.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

extern "C" {
int flexpage_f32_linear(const float *x, const float *weight, const float *bias, int64_t rows, int64_t in,
                        int64_t out, float *y);
int flexpage_bf16_linear(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, int64_t rows, int64_t in,
                         int64_t out, uint16_t *y);
int flexpage_decode_attention(const float *query, const uint8_t *key_pool, const uint8_t *value_pool, int64_t rows,
                              int64_t kv_heads, int64_t pool_slots, int64_t dim, int64_t group,
                              const int64_t *first_run, const int64_t *starts, const int64_t *counts, float scale,
                              float cap, int64_t part_keys, int format, int bf16_query, float *out);
}

namespace {

using torch::headeronly::BFloat16;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using Strides = torch::headeronly::IntHeaderOnlyArrayRef;

constexpr int64_t PART_KEYS = 256;  // fewest keys a thread's part takes (kernels.PART_KEYS)

// F.linear(x, weight, bias) for float32 or bfloat16 CPU tensors of one dtype, weight contiguous.
Tensor row_linear(Tensor x, Tensor weight, std::optional<Tensor> bias) {
    const ScalarType dtype = x.scalar_type();
    STD_TORCH_CHECK(dtype == ScalarType::Float || dtype == ScalarType::BFloat16,
                    "flexpage::row_linear: float32 or bfloat16, got ", dtype);
    STD_TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous() &&
                        x.size(-1) == weight.size(1),
                    "flexpage::row_linear: a contiguous [out, in] weight of the input's dtype and width");
    STD_TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == weight.size(0)),
                    "flexpage::row_linear: a contiguous bias of the weight's outputs");
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    const int64_t in = weight.size(1), out = weight.size(0), rows = in ? x.numel() / in : 0;
    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = out;
    Tensor y = torch::stable::new_empty(x, sizes);
    const int status =
        dtype == ScalarType::Float
            ? flexpage_f32_linear(static_cast<const float *>(x.const_data_ptr()),
                                  static_cast<const float *>(weight.const_data_ptr()),
                                  bias ? static_cast<const float *>(bias->const_data_ptr()) : nullptr, rows, in, out,
                                  static_cast<float *>(y.mutable_data_ptr()))
            : flexpage_bf16_linear(static_cast<const uint16_t *>(x.const_data_ptr()),
                                   static_cast<const uint16_t *>(weight.const_data_ptr()),
                                   bias ? static_cast<const uint16_t *>(bias->const_data_ptr()) : nullptr, rows, in,
                                   out, static_cast<uint16_t *>(y.mutable_data_ptr()));
    STD_TORCH_CHECK(status == 0, "flexpage::row_linear: this CPU's build lacks ", dtype);
    return y;
}

// decode_attention.c's ``enum format`` of a pool dtype (-1: not one it reads).
int format_of(ScalarType dtype) {
    switch (dtype) {
    case ScalarType::Char: return 0;
    case ScalarType::Float8_e4m3fn: return 1;
    case ScalarType::Float: return 2;
    case ScalarType::BFloat16: return 3;
    default: return -1;
    }
}

// Tokens ``fed`` of a query [1, heads, n, dim] (any strides) as float rows [fed, heads, dim].
template <typename T>
void gather_tokens(const T *query, Strides strides, const std::vector<int64_t> &fed, int64_t heads, int64_t dim,
                   float *rows) {
    for (size_t c = 0; c < fed.size(); c++)
        for (int64_t h = 0; h < heads; h++) {
            const T *from = query + h * strides[1] + fed[c] * strides[2];
            float *to = rows + (c * heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) to[d] = static_cast<float>(from[d * strides[3]]);
        }
}

// Float rows [fed, heads, dim] into a contiguous [1, heads, n, dim] output at tokens ``fed``, zeros elsewhere.
template <typename T>
void scatter_tokens(const float *rows, const std::vector<int64_t> &fed, int64_t n, int64_t heads, int64_t dim,
                    T *out) {
    std::fill(out, out + heads * n * dim, T(0));
    for (size_t c = 0; c < fed.size(); c++)
        for (int64_t h = 0; h < heads; h++) {
            const float *from = rows + (c * heads + h) * dim;
            T *to = out + (h * n + fed[c]) * dim;
            for (int64_t d = 0; d < dim; d++) to[d] = static_cast<T>(from[d]);
        }
}

// Decode tokens' attention (a packed step's decode region): the query [1, Hq, n, D] (float32 or bfloat16), token t
// of page-table row tok_rows[t] at position tok_pos[t] (< 0: padding, whose output is zeros)
// attending its row's keys at positions max(0, pos - window + 1)..pos (window <= 0: all), found
// through ``table`` ([rows, pages] int32 page ids) in pools [1, Hkv, slots, D] (quantised: D + 2)
// and read in place. Scores soft-capped at cap where it is positive. Returns [1, Hq, n, D].
Tensor paged_decode(Tensor query, Tensor key_pool, Tensor value_pool, Tensor table, Tensor tok_rows, Tensor tok_pos,
                    int64_t page_size, int64_t window, double scale, double cap) {
    STD_TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 &&
                        (query.scalar_type() == ScalarType::Float || query.scalar_type() == ScalarType::BFloat16),
                    "flexpage::paged_decode: a float32 or bfloat16 query of shape [1, heads, tokens, dim]");
    const int64_t heads = query.size(1), n = query.size(2), dim = query.size(3);
    const int64_t kv_heads = key_pool.size(1), slots = key_pool.size(2);
    const int format = format_of(key_pool.scalar_type());
    STD_TORCH_CHECK(format >= 0 && key_pool.scalar_type() == value_pool.scalar_type() &&
                        key_pool.sizes().equals(value_pool.sizes()) && key_pool.dim() == 4 && key_pool.size(0) == 1 &&
                        key_pool.is_contiguous() && value_pool.is_contiguous() &&
                        key_pool.size(3) == (format < 2 ? dim + 2 : dim),
                    "flexpage::paged_decode: contiguous pools [1, kv_heads, slots, dim] of one dtype it reads");
    STD_TORCH_CHECK(heads % kv_heads == 0, "flexpage::paged_decode: query heads a multiple of the KV heads");
    STD_TORCH_CHECK(table.scalar_type() == ScalarType::Int && table.dim() == 2 && table.is_contiguous() &&
                        tok_rows.scalar_type() == ScalarType::Long && tok_pos.scalar_type() == ScalarType::Long &&
                        tok_rows.numel() == n && tok_pos.numel() == n && tok_rows.is_contiguous() &&
                        tok_pos.is_contiguous(),
                    "flexpage::paged_decode: an int32 page table and int64 rows and positions, one per token");
    const int32_t *pages = table.const_data_ptr<int32_t>();
    const int64_t *rows = tok_rows.const_data_ptr<int64_t>(), *positions = tok_pos.const_data_ptr<int64_t>();
    const int64_t width = table.size(1);
    // each fed token's keys as runs of consecutive slots, its pages' slots merged where they follow on
    std::vector<int64_t> fed, first_run{0}, starts, counts;
    int64_t keys = 0;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = positions[t];
        if (pos < 0) continue;
        STD_TORCH_CHECK(rows[t] >= 0 && rows[t] < table.size(0) && pos / page_size < width,
                        "flexpage::paged_decode: token ", t, " lies outside the page table");
        const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        for (int64_t at = lo; at <= pos;) {
            const int64_t page = pages[rows[t] * width + at / page_size];
            STD_TORCH_CHECK(page >= 0, "flexpage::paged_decode: token ", t, " reads a page its row does not hold");
            const int64_t start = page * page_size + at % page_size;
            const int64_t count = std::min(page_size - at % page_size, pos + 1 - at);
            STD_TORCH_CHECK(start + count <= slots, "flexpage::paged_decode: a page past the pools");
            if (starts.size() > static_cast<size_t>(first_run.back()) && starts.back() + counts.back() == start)
                counts.back() += count;
            else
                starts.push_back(start), counts.push_back(count);
            at += count;
        }
        keys += pos + 1 - lo;
        fed.push_back(t);
        first_run.push_back(static_cast<int64_t>(starts.size()));
    }
    Tensor out = torch::stable::new_empty(query, {1, heads, n, dim});
    const int64_t count = static_cast<int64_t>(fed.size());
    // the fed tokens' queries as float [count, Hkv, group, D] (each KV head's query heads together)
    std::vector<float> folded(count * heads * dim), attended(count * heads * dim);
    const int bf16 = query.scalar_type() == ScalarType::BFloat16;
    if (bf16)
        gather_tokens(query.const_data_ptr<BFloat16>(), query.strides(), fed, heads, dim, folded.data());
    else
        gather_tokens(query.const_data_ptr<float>(), query.strides(), fed, heads, dim, folded.data());
    if (count > 0) {
        // enough parts for every thread to take a few (the KV heads alone may be fewer than threads)
        const int64_t parts = 4 * static_cast<int64_t>(torch::stable::get_num_threads());
        const int64_t part_keys = std::max(PART_KEYS, (keys * kv_heads + parts - 1) / parts);
        const int status = flexpage_decode_attention(
            folded.data(), static_cast<const uint8_t *>(key_pool.const_data_ptr()),
            static_cast<const uint8_t *>(value_pool.const_data_ptr()), count, kv_heads, slots, dim, heads / kv_heads,
            first_run.data(), starts.data(), counts.data(), static_cast<float>(scale),
            cap > 0 ? static_cast<float>(cap) : 0.0f, part_keys, format, bf16, attended.data());
        STD_TORCH_CHECK(status != 2, "flexpage::paged_decode: out of memory");
        STD_TORCH_CHECK(status == 0, "flexpage::paged_decode: shapes the kernel does not take (at most 16 query "
                                     "heads per KV head, a head dimension of at most 256)");
    }
    if (bf16)
        scatter_tokens(attended.data(), fed, n, heads, dim, out.mutable_data_ptr<BFloat16>());
    else
        scatter_tokens(attended.data(), fed, n, heads, dim, out.mutable_data_ptr<float>());
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(flexpage, CPU, m) {
    m.impl("row_linear", TORCH_BOX(&row_linear));
    m.impl("paged_decode", TORCH_BOX(&paged_decode));
}
