// BlockPool.gather for INT8 / INT4 pools on the CPU: each slot's block dequantized straight
// into the destination, the slots split across torch's threads. torch's path takes six passes
// over the gathered bytes (index_select, unpack, widen, scale, add, round) with fp32
// intermediates; here each block is read once and written once.
#include "tensor.h"

#include "dequant.h"
#include "kernels.h"
#include "rows.h"

namespace {

using kvchat::Format;

template <typename T, int D>
void gather(const uint8_t* storage, int64_t row_bytes, const int64_t* slots, int64_t n,
            int64_t block, Format format, T* out) {
  const auto dequant = format == Format::Int8 ? kvchat::dequant_int8<T, D> : kvchat::dequant_int4<T, D>;
  kvchat::for_rows(n, 1, [&](int64_t i) {
    dequant(storage + slots[i] * row_bytes, block, 0, block, out + i * block * D);
  });
}

template <typename T>
void dispatch(int64_t D, const uint8_t* storage, int64_t row_bytes, const int64_t* slots, int64_t n,
              int64_t block, Format format, T* out) {
  switch (D) {
    case 32: gather<T, 32>(storage, row_bytes, slots, n, block, format, out); break;
    case 64: gather<T, 64>(storage, row_bytes, slots, n, block, format, out); break;
    case 128: gather<T, 128>(storage, row_bytes, slots, n, block, format, out); break;
    case 256: gather<T, 256>(storage, row_bytes, slots, n, block, format, out); break;
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 128 or 256, got ", D);
  }
}

}  // namespace

// storage: a pool's uint8 rows [n_slots, bytes_per_slot]; slots: int64 [n]; out: contiguous
// [>= n, block, D] in bf16 or fp32; format 1 (INT8) or 2 (INT4). Returns out[:n].
at::Tensor gather_blocks(at::Tensor storage, at::Tensor slots, at::Tensor out,
                            int64_t format) {
  TORCH_CHECK(format == 1 || format == 2, "format 1 (INT8) or 2 (INT4)");
  TORCH_CHECK(storage.scalar_type() == at::kByte && storage.dim() == 2 && storage.is_contiguous(),
              "storage: contiguous uint8 rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots: int64 [n]");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous(), "out: contiguous [n, block, D]");
  const auto f = static_cast<Format>(format);
  const int64_t n = slots.size(0), block = out.size(1), D = out.size(2);
  const int64_t row_bytes = storage.size(1);
  const int64_t per_row = kvchat::value_bytes(f, D) + kvchat::meta_bytes(f, D);
  TORCH_CHECK(D % 32 == 0 && row_bytes == block * per_row, "out's block does not fit the rows");
  TORCH_CHECK(out.size(0) >= n, "out holds fewer blocks than slots");
  auto idx = slots.contiguous();
  const int64_t* s = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < storage.size(0), "slot ", s[i], " is outside the pool");
  const auto* rows = storage.data_ptr<uint8_t>();
  if (out.scalar_type() == at::kBFloat16)
    dispatch<uint16_t>(D, rows, row_bytes, s, n, block, f, reinterpret_cast<uint16_t*>(out.data_ptr()));
  else if (out.scalar_type() == at::kFloat)
    dispatch<float>(D, rows, row_bytes, s, n, block, f, out.data_ptr<float>());
  else
    TORCH_CHECK(false, "out must be bf16 or fp32");
  return out.narrow(0, 0, n);
}
